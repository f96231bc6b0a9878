"""Chunked prefill: a prompt block through the target (and the draft) C positions at a time, so
one call's temporaries (MoE assignments, attention scores) scale with B x C instead of B x T; same
tokens and cache contents as one call. The last chunk's padding writes slots >= T, masked by
position like any stale slot.
"""

from __future__ import annotations

import jax.numpy as jnp

from eagle3_jax.models.chunks import positions, scan_chunks


def _keep_last(kept_BD, out_BCD, last_B, start):
    """``kept_BD`` with each row's state at its last prompt position taken from this chunk's outputs."""
    C = out_BCD.shape[1]
    here_B = (last_B >= start) & (last_B < start + C)
    at_B = out_BCD[jnp.arange(out_BCD.shape[0]), jnp.clip(last_B - start, 0, C - 1)]
    return jnp.where(here_B[:, None], at_B.astype(kept_BD.dtype), kept_BD)


def chunked_draft(draft, target, shifted_BT, aux_BTX, prompt_len_B, dcache, chunk):
    """The draft prefill ``chunk`` positions per step (its attention over the whole cache is the big
    temporary; logits come from the last prompt position only); returns (cache, hidden [B, D] and
    logits [B, W] at each row's last prompt position)."""
    B = shifted_BT.shape[0]
    embed_VD = target.embed_tokens[...]

    def step(carry, start, xs):
        cache, h_BD = carry
        ids_BC, aux_BCX = xs
        out = draft(ids_BC, draft.fuse(aux_BCX), positions(start, B, chunk), embed_VD, cache, with_logits=False)
        return (out.cache, _keep_last(h_BD, out.hidden_BTD, prompt_len_B - 1, start)), None

    h0 = jnp.zeros((B, draft.cfg.hidden_size), draft.dtype)
    (dcache, h_BD), _ = scan_chunks(step, (dcache, h0), (shifted_BT, aux_BTX), chunk)
    return dcache, h_BD, draft.head(h_BD[:, None])[:, 0]


def chunked_target(target, prompt_BT, prompt_len_B, tcache, aux_ids, chunk):
    """The target over the prompt, ``chunk`` positions per step; returns (hidden at each row's last
    prompt position [B, D], cache, aux states [B, T, X] or None)."""
    B = prompt_BT.shape[0]

    def step(carry, start, ids_BC):
        cache, h_BD = carry
        out = target(ids_BC, positions(start, B, chunk), cache, aux_ids)
        return (out.cache, _keep_last(h_BD, out.hidden_BTD, prompt_len_B - 1, start)), out.aux_BTX

    h0 = jnp.zeros((B, target.cfg.hidden_size), target.dtype)
    (tcache, last_hidden_BD), aux_BTX = scan_chunks(step, (tcache, h0), prompt_BT, chunk)
    return last_hidden_BD, tcache, aux_BTX if aux_ids is not None else None
