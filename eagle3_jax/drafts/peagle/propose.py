"""Parallel drafting (P-EAGLE): a round's K draft tokens from one draft pass. The first comes, as in
the chain, from the draft's output at the anchor; one pass over K - 1 MASK positions after it gives
the rest (catch-up then overwrites their keys). No guess depends on another, so rejection sampling
against the target stays exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_parallel(draft, dlogits_BW: jax.Array, dhidden_BD, dcache, lengths_B: jax.Array, keys, pick, embed_VD,
                     last_B, head):
    """(draft ids [B, K] in the draft vocab, their distributions [B, K, W], the draft cache). The
    guessed positions are n .. n + K - 2 for a row of target length n (``lengths_B``); the anchor's
    hidden state, ``embed_VD``, ``last_B`` and ``head`` are not needed (the draft has its own)."""
    K = len(keys)
    picks = [pick(keys[0], dlogits_BW)]
    if K > 1:
        step = draft.propose(lengths_B[:, None] + jnp.arange(K - 1, dtype=jnp.int32)[None, :], dcache)
        dcache = step.cache
        picks += [pick(keys[j], step.logits_BTW[:, j - 1]) for j in range(1, K)]
    return jnp.stack([d for d, _ in picks], axis=1), jnp.stack([q for _, q in picks], axis=1), dcache
