"""Chain drafting (EAGLE-3): a round's K draft tokens from K - 1 sequential draft steps. The first
guess comes from the draft's output at the anchor (kept in the loop state by the previous catch-up);
each later step feeds the previous guess and hidden state back, one position further, writing keys
the catch-up overwrites with the verified positions'."""

from __future__ import annotations

import jax.numpy as jnp


def propose_chain(draft, dlogits_BW, dhidden_BD, dcache, lengths_B, keys, pick, embed_VD, last_B, head):
    """(draft ids [B, K] in the draft vocab, their distributions [B, K, W], the draft cache).

    ``lengths_B`` is each row's target length n: step j runs at position n - 1 + j. ``last_B`` and
    ``head`` are not needed: the draft has its own."""
    d_B, q_BW = pick(keys[0], dlogits_BW)
    ids, qs = [d_B], [q_BW]
    hidden_BD = dhidden_BD
    for j in range(1, len(keys)):
        pos_B1 = (lengths_B - 1 + j)[:, None]
        step = draft(draft.to_target_ids(d_B)[:, None], hidden_BD[:, None], pos_B1, embed_VD, dcache)
        hidden_BD, dcache = step.hidden_BTD[:, 0], step.cache
        d_B, q_BW = pick(keys[j], step.logits_BTW[:, 0])
        ids.append(d_B)
        qs.append(q_BW)
    return jnp.stack(ids, axis=1), jnp.stack(qs, axis=1), dcache
