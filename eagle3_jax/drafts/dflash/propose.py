"""Block drafting (DFlash) in the decode loop: one block pass anchored at the row's newest token
(position n, not yet run through the target), offset j guessing the token at n + j through the
target's head. The draft keeps only the context's keys between rounds; its catch-up writes the
verified positions'. No guess depends on another, so rejection sampling stays exact.
"""

from __future__ import annotations

import jax.numpy as jnp

from eagle3_jax.drafts.eagle3.model import DraftStep


def propose_block(draft, dlogits_BW, dhidden_BD, dcache, lengths_B, keys, pick, embed_VD, last_B, head):
    """(ids [B, K] in the target vocab, their distributions [B, K, V], the draft cache): the kind
    keeps no anchor output (``dlogits_BW``, ``dhidden_BD`` are None); ``head`` is the target's."""
    K = len(keys)
    logits_BKV = head(draft.propose(last_B, lengths_B, dcache, embed_VD)[:, 1:K + 1])
    picks = [pick(keys[j], logits_BKV[:, j]) for j in range(K)]
    return jnp.stack([d for d, _ in picks], axis=1), jnp.stack([q for _, q in picks], axis=1), dcache


def catch_up(draft, ids_BT, aux_BTX, positions_BT, embed_VD, dcache) -> DraftStep:
    """The verified positions' context keys into the cache (the tokens are not needed)."""
    return DraftStep(hidden_BTD=None, logits_BTW=None, cache=draft.write_context(aux_BTX, positions_BT, dcache))
