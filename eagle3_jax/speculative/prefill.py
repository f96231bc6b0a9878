"""Chunked prefill: a prompt block through the target (and the draft) C positions at a time.

Each chunk is written into the cache before the next one attends to it, so the temporaries of one
call (MoE assignments, attention scores) scale with B x C instead of B x T. Same
tokens, same cache contents as one call over the whole block (tests/test_prefill_chunks.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunks(x_BT, chunk):
    """[B, T] -> [T / chunk, B, chunk] (T padded up to a multiple of chunk with zeros)."""
    B, T = x_BT.shape
    n = -(-T // chunk)
    x_BT = jnp.pad(x_BT, ((0, 0), (0, n * chunk - T)))
    return x_BT.reshape(B, n, chunk).transpose(1, 0, 2)


def chunked_draft(draft, target, shifted_BT, aux_BTX, prompt_len_B, dcache, chunk):
    """The draft prefill ``chunk`` positions per step (its attention over the whole cache is the big
    temporary; logits come from the last prompt position only); returns (cache, hidden [B, D] and logits [B, W] at each row's
    last prompt position)."""
    B, T = shifted_BT.shape
    rows_B = jnp.arange(B)
    n = -(-T // chunk)
    ids_NBC = _chunks(shifted_BT, chunk)
    pos_NBC = _chunks(jnp.broadcast_to(jnp.arange(n * chunk, dtype=jnp.int32), (B, n * chunk)), chunk)
    aux_NBCX = jnp.pad(aux_BTX, ((0, 0), (0, n * chunk - T), (0, 0))).reshape(B, n, chunk, -1).transpose(1, 0, 2, 3)
    embed_VD = target.embed_tokens[...]
    last_B = prompt_len_B - 1

    def step(carry, xs):
        cache, h_BD = carry
        ids_BC, pos_BC, aux_BCX = xs
        out = draft(ids_BC, draft.fuse(aux_BCX), pos_BC, embed_VD, cache, with_logits=False)
        here_B = (last_B >= pos_BC[:, 0]) & (last_B < pos_BC[:, 0] + chunk)
        at_B = jnp.clip(last_B - pos_BC[:, 0], 0, chunk - 1)
        h_BD = jnp.where(here_B[:, None], out.hidden_BTD[rows_B, at_B].astype(h_BD.dtype), h_BD)
        return (out.cache, h_BD), None

    h0 = jnp.zeros((B, draft.cfg.hidden_size), draft.dtype)
    (dcache, h_BD), _ = jax.lax.scan(step, (dcache, h0), (ids_NBC, pos_NBC, aux_NBCX))
    return dcache, h_BD, draft.head(h_BD[:, None])[:, 0]


def chunked_target(target, prompt_BT, prompt_len_B, tcache, aux_ids, chunk):
    """The target over the prompt, ``chunk`` positions per step; returns (hidden at each row's last
    prompt position [B, D], cache, aux states [B, T, X] or None)."""
    B, T = prompt_BT.shape
    rows_B = jnp.arange(B)
    ids_NBC = _chunks(prompt_BT, chunk)
    n = ids_NBC.shape[0]
    # Padding positions past T write cache slots >= T, which hold no prompt token: they are
    # masked by position like any stale slot and overwritten by the first decode steps.
    pos_NBC = _chunks(jnp.broadcast_to(jnp.arange(n * chunk, dtype=jnp.int32), (B, n * chunk)), chunk)
    last_B = prompt_len_B - 1

    def step(carry, xs):
        cache, last_hidden_BD = carry
        ids_BC, pos_BC = xs
        out = target(ids_BC, pos_BC, cache, aux_ids)
        here_B = (last_B >= pos_BC[:, 0]) & (last_B < pos_BC[:, 0] + chunk)
        h_BD = out.hidden_BTD[rows_B, jnp.clip(last_B - pos_BC[:, 0], 0, chunk - 1)]
        last_hidden_BD = jnp.where(here_B[:, None], h_BD, last_hidden_BD)
        return (out.cache, last_hidden_BD), out.aux_BTX

    h0 = jnp.zeros((B, target.cfg.hidden_size), target.dtype)
    (tcache, last_hidden_BD), aux_NBCX = jax.lax.scan(step, (tcache, h0), (ids_NBC, pos_NBC))
    aux_BTX = None
    if aux_ids:
        aux_BTX = aux_NBCX.transpose(1, 0, 2, 3).reshape(B, n * chunk, -1)[:, :T]
    return last_hidden_BD, tcache, aux_BTX
