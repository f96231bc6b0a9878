"""Parallel drafting (P-EAGLE): a round's K draft tokens from one draft pass.

The chain draft feeds each guess back for the next (K - 1 sequential passes). A P-EAGLE draft
guesses positions 2..K at once: the first token comes, as in the chain, from the draft's output at
the anchor (the last known position, kept in the loop state by the previous catch-up), and one pass
over K - 1 MASK positions after the anchor gives the rest. Verify, accept and catch-up are the chain
draft's: the catch-up re-reads the verified positions with the target's aux states, overwriting the
MASK positions' keys this pass left in the draft cache.

Each guess is drawn from its own distribution q_j and none depends on another guess, so rejection
sampling against the target stays exact (the draft's q for position j is what it was drawn from).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_parallel(draft, dlogits_BW: jax.Array, dhidden_BD, dcache, lengths_B: jax.Array, keys, pick, embed_VD,
                     last_B, head):
    """(draft ids [B, K] in the draft vocab, their distributions [B, K, W], the draft cache); the
    anchor's hidden state, the newest token and the target's embedding and head are not needed (the
    draft embeds its own MASK and has its own head).

    ``lengths_B`` is each row's target length n: the anchor is n - 1 and the guessed positions are
    n .. n + K - 2. ``pick(key, logits_BW) -> (ids_B, q_BW)`` chooses a token (greedy or sampled)."""
    K = len(keys)
    ids, qs = [], []
    d_B, q_BW = pick(keys[0], dlogits_BW)
    ids.append(d_B)
    qs.append(q_BW)
    if K > 1:
        positions_BK = lengths_B[:, None] + jnp.arange(K - 1, dtype=jnp.int32)[None, :]
        step = draft.propose(positions_BK, dcache)
        dcache = step.cache
        for j in range(1, K):
            d_B, q_BW = pick(keys[j], step.logits_BTW[:, j - 1])
            ids.append(d_B)
            qs.append(q_BW)
    return jnp.stack(ids, axis=1), jnp.stack(qs, axis=1), dcache
