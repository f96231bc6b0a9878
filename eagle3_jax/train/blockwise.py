"""Causal attention over key blocks with an online softmax, forward and backward: memory linear in T.

The TTT unroll attends, at every simulated step, over step 0's T keys (causal) plus one diagonal key
per earlier step. The dense form materializes a [B, T, N, T] score matrix per step, and the backward
pass keeps every step's: at Kimi-K2.5's draft shape and 8192-token rows that is the whole device.
Here the causal part runs as a ``lax.scan`` over blocks of ``block`` keys keeping a running max, sum
and weighted value per query (flash attention's recurrence); the backward pass is a second scan that
recomputes each block's probabilities from the saved log-sum-exp (a ``custom_vjp``), so what is kept
for the backward pass is q, k, v, the output and one log-sum-exp per query and head.

The causal result comes back with its log-sum-exp so the diagonal keys' scores can be merged into the
same softmax exactly (``merge``); gradients flow through both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _blocks(x_BSGH, block: int):
    """[B, S, G, H] -> [S/block, B, block, G, H], zero-padded at the end (padded keys lie past every
    query, so the causal mask drops them)."""
    B, S = x_BSGH.shape[:2]
    n = -(-S // block)
    x = jnp.pad(x_BSGH, ((0, 0), (0, n * block - S)) + ((0, 0),) * (x_BSGH.ndim - 2))
    return jnp.moveaxis(x.reshape((B, n, block) + x_BSGH.shape[2:]), 1, 0)


def _block_scores(q_BTGRH, k_BKGH, start, scale):
    """Scores of every query against one key block, -inf where the key lies after the query."""
    T, K = q_BTGRH.shape[1], k_BKGH.shape[1]
    s = jnp.einsum("btgrh,bkgh->btgrk", q_BTGRH, k_BKGH, preferred_element_type=jnp.float32) * scale
    visible_TK = jnp.arange(T)[:, None] >= start + jnp.arange(K)[None, :]
    return jnp.where(visible_TK[None, :, None, None, :], s, -jnp.inf)


def _forward(q_BTGRH, k_BSGH, v_BSGH, block):
    B, T, G, R, H = q_BTGRH.shape
    scale = H ** -0.5
    kb, vb = _blocks(k_BSGH, block), _blocks(v_BSGH, block)

    def body(carry, xs):
        m, l, acc = carry
        j, k_BKGH, v_BKGH = xs
        s = _block_scores(q_BTGRH, k_BKGH, j * block, scale)
        m_new = jnp.maximum(m, s.max(-1))
        ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)   # a query with no visible key yet
        p = jnp.exp(s - ref[..., None])
        corr = jnp.exp(m - ref)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("btgrk,bkgh->btgrh", p, v_BKGH.astype(jnp.float32))
        return (m_new, l, acc), None

    init = (jnp.full((B, T, G, R), -jnp.inf, jnp.float32), jnp.zeros((B, T, G, R), jnp.float32),
            jnp.zeros((B, T, G, R, H), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(body, init, (jnp.arange(kb.shape[0]), kb, vb))
    # every query sees at least key 0, so l > 0
    return acc / l[..., None], m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention(q_BTGRH, k_BSGH, v_BSGH, block: int):
    """Causal softmax attention of queries at positions 0..T-1 over keys at 0..S-1.

    Returns (out [B, T, G, R, H] float32, lse [B, T, G, R] float32: the log-sum-exp of the scores)."""
    return _forward(q_BTGRH, k_BSGH, v_BSGH, block)


def _fwd(q_BTGRH, k_BSGH, v_BSGH, block):
    out, lse = _forward(q_BTGRH, k_BSGH, v_BSGH, block)
    return (out, lse), (q_BTGRH, k_BSGH, v_BSGH, out, lse)


def _bwd(block, res, cotangents):
    q_BTGRH, k_BSGH, v_BSGH, out, lse = res
    d_out, d_lse = cotangents
    S, H = k_BSGH.shape[1], q_BTGRH.shape[-1]
    scale = H ** -0.5
    qf = q_BTGRH.astype(jnp.float32)
    # d(out)/d(score_j) = p_j (v_j - out); d(lse)/d(score_j) = p_j
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    kb, vb = _blocks(k_BSGH, block), _blocks(v_BSGH, block)

    def body(dq, xs):
        j, k_BKGH, v_BKGH = xs
        s = _block_scores(q_BTGRH, k_BKGH, j * block, scale)
        p = jnp.exp(s - lse[..., None])
        dv = jnp.einsum("btgrk,btgrh->bkgh", p, d_out)
        dp = jnp.einsum("btgrh,bkgh->btgrk", d_out, v_BKGH.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("btgrk,bkgh->btgrh", ds, k_BKGH.astype(jnp.float32))
        dk = jnp.einsum("btgrk,btgrh->bkgh", ds, qf)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q_BTGRH.shape, jnp.float32), (jnp.arange(kb.shape[0]), kb, vb))

    def unblock(x_NBKGH, like):
        n, B, K = x_NBKGH.shape[:3]
        return jnp.moveaxis(x_NBKGH, 0, 1).reshape((B, n * K) + x_NBKGH.shape[3:])[:, :S].astype(like.dtype)

    return dq.astype(q_BTGRH.dtype), unblock(dk, k_BSGH), unblock(dv, v_BSGH)


causal_attention.defvjp(_fwd, _bwd)


def merge(out_a, lse_a, out_b, lse_b):
    """Two attentions over disjoint key sets -> the attention over their union (one softmax)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None]
