"""Softmax attention, one core in two forms: masked dense, and blockwise with a running max and sum.

Every attention here is softmax(scores over visible keys) . values; callers differ in how scores
and value sums are formed (MLA's absorbed latent plus rope parts, grouped-query heads), so both
forms take them as functions of a key range:

    scores_fn(start, size)            -> [..., T, N, size] float32 scaled scores of keys [start, start + size)
    weighted_fn(p_BTNS, start, size)  -> [..., T, N, X] float32: p times those keys' values

and return (out [..., T, N, X] float32, lse [..., T, N]); the lse lets attentions over disjoint
key sets become one softmax (``merge``).

``dense`` scores every key at once under an explicit mask. ``blockwise`` reads ``block`` keys a
step up to the batch's largest position: cost follows the longest filled row, not the capacity.
``causal_gqa`` is the blockwise form with a gradient that recomputes probabilities from the saved
lse, so training memory stays linear in the row (flash attention's recurrence).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eagle3_jax.models.chunks import scan_chunks

KEY_BLOCK = 128
# The most scores one row's block step holds, T x N x kb: it bounds prefill chunks' blocks.
MAX_BLOCK_SCORES = 1 << 22


def key_block(capacity: int, tokens: int, heads: int, block: int | None = None) -> int:
    """Slots per step of ``blockwise``: at least ``block`` (default ``KEY_BLOCK``) and 4 * T * N (a
    power of two), at most the whole cache and ``MAX_BLOCK_SCORES`` scores a row. A step reads its
    keys (2 * kb * C bytes a row in bf16) and the running float32 sums (8 * T * N * C bytes): blocks
    of 4 * T * N slots or more keep the sums' traffic no larger than the keys'."""
    need = 1 << max(0, (4 * tokens * heads - 1).bit_length())
    cap = 1 << max(0, (MAX_BLOCK_SCORES // max(1, tokens * heads)).bit_length() - 1)
    return min(capacity, max(KEY_BLOCK if block is None else block, min(need, cap)))


def grouped(q_BTNH, k_BSGH, v_BSGH, scale: float | None = None):
    """(scores_fn, weighted_fn) of grouped-query attention, scale H^-1/2 unless ``scale`` is given
    (queries absorbed into a wider key space keep their own head's scale): N = G * R query heads
    share each of G key/value heads. Leading dims before T are batch dims of q, k and v alike."""
    *lead, T, N, H = q_BTNH.shape
    scale = H ** -0.5 if scale is None else scale
    G = k_BSGH.shape[-2]
    q_BTGRH = q_BTNH.reshape(tuple(lead) + (T, G, N // G, H)).astype(k_BSGH.dtype)

    def keys(x_BSGH, start, size):
        return jax.lax.dynamic_slice_in_dim(x_BSGH, start, size, axis=-3)

    def scores(start, size):
        s = jnp.einsum("...tgrh,...sgh->...tgrs", q_BTGRH, keys(k_BSGH, start, size),
                       preferred_element_type=jnp.float32)
        return s.reshape(tuple(lead) + (T, N, size)) * scale

    def weighted(p_BTNS, start, size):
        p = p_BTNS.reshape(tuple(lead) + (T, G, N // G, size)).astype(v_BSGH.dtype)
        out = jnp.einsum("...tgrs,...sgh->...tgrh", p, keys(v_BSGH, start, size), preferred_element_type=jnp.float32)
        return out.reshape(tuple(lead) + (T, N, v_BSGH.shape[-1]))

    return scores, weighted


def dense(scores_fn, weighted_fn, visible_BTS, keys: int | None = None):
    """One softmax over all keys; ``visible_BTS`` [..., T, S] (None: every key of ``keys``)."""
    S = keys if visible_BTS is None else visible_BTS.shape[-1]
    s_BTNS = scores_fn(0, S)
    if visible_BTS is not None:
        s_BTNS = jnp.where(jnp.expand_dims(visible_BTS, -2), s_BTNS, -jnp.inf)
    return weighted_fn(jax.nn.softmax(s_BTNS, axis=-1), 0, S), jax.nn.logsumexp(s_BTNS, axis=-1)


def blockwise(scores_fn, weighted_fn, positions_BT, keys: int, block: int):
    """Keys 0..``keys``-1, ``block`` a step, query at position p seeing keys 0..p; the last block may
    start before j * block (``keys`` not a multiple of it), its keys already seen masked, so none
    counts twice. With block >= keys: the dense form, no loop."""
    def visible(start, size, seen_from):
        slots_S = start + jnp.arange(size)
        return (slots_S <= positions_BT[..., None]) & (slots_S >= seen_from)

    if block >= keys:
        return dense(scores_fn, weighted_fn, visible(0, keys, 0))
    # keys any query of the batch can see; positions past the capacity see every key
    n_blocks = (jnp.clip(jnp.max(positions_BT) + 1, 1, keys) + block - 1) // block

    def step(j, carry):
        m_BTN, l_BTN, acc_BTN_ = carry
        start = jnp.minimum(j * block, keys - block)
        s_BTNS = jnp.where(visible(start, block, j * block)[..., None, :], scores_fn(start, block), -jnp.inf)
        m_new_BTN = jnp.maximum(m_BTN, jnp.max(s_BTNS, axis=-1))
        # A query with nothing visible yet keeps max -inf; shift by 0 there so exp gives 0, not NaN.
        shift_BTN = jnp.where(jnp.isfinite(m_new_BTN), m_new_BTN, 0.0)
        p_BTNS = jnp.exp(s_BTNS - shift_BTN[..., None])
        keep_BTN = jnp.exp(m_BTN - shift_BTN)
        return (m_new_BTN, l_BTN * keep_BTN + p_BTNS.sum(-1),
                acc_BTN_ * keep_BTN[..., None] + weighted_fn(p_BTNS, start, block))

    s_shape = jax.eval_shape(lambda: scores_fn(0, block))
    x_shape = jax.eval_shape(lambda: weighted_fn(jnp.zeros(s_shape.shape, jnp.float32), 0, block))
    init = (jnp.full(s_shape.shape[:-1], -jnp.inf, jnp.float32), jnp.zeros(s_shape.shape[:-1], jnp.float32),
            jnp.zeros(x_shape.shape, jnp.float32))
    m_BTN, l_BTN, acc_BTN_ = jax.lax.fori_loop(0, n_blocks, step, init)
    return acc_BTN_ / l_BTN[..., None], m_BTN + jnp.log(l_BTN)


def merge(out_a, lse_a, out_b, lse_b):
    """Two attentions over disjoint key sets -> the attention over their union (one softmax)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None]


def _causal(q_BTNH, k_BSGH, v_BSGH, block):
    B, T = q_BTNH.shape[:2]
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return blockwise(*grouped(q_BTNH, k_BSGH, v_BSGH), positions_BT, k_BSGH.shape[1], block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_gqa(q_BTNH, k_BSGH, v_BSGH, block: int):
    """Causal grouped-query attention of queries at positions 0..T-1 over keys at 0..S-1, the
    blockwise form: (out [B, T, N, H] float32, lse [B, T, N]), gradients with memory linear in T."""
    return _causal(q_BTNH, k_BSGH, v_BSGH, block)


def _causal_fwd(q_BTNH, k_BSGH, v_BSGH, block):
    out_BTNH, lse_BTN = _causal(q_BTNH, k_BSGH, v_BSGH, block)
    return (out_BTNH, lse_BTN), (q_BTNH, k_BSGH, v_BSGH, out_BTNH, lse_BTN)


def _causal_bwd(block, res, cotangents):
    q_BTNH, k_BSGH, v_BSGH, out_BTNH, lse_BTN = res
    d_out_BTNH, d_lse_BTN = cotangents
    B, T, N, H = q_BTNH.shape
    G = k_BSGH.shape[2]
    R = N // G
    qf_BTGRH = q_BTNH.reshape(B, T, G, R, H).astype(jnp.float32)
    d_out_BTGRH = d_out_BTNH.reshape(B, T, G, R, H)
    # d(out)/d(score_j) = p_j (v_j - out); d(lse)/d(score_j) = p_j
    delta_BTN = jnp.sum(d_out_BTNH * out_BTNH, axis=-1) - d_lse_BTN

    def body(dq_BTGRH, start, kv):
        kb_BSGH, vb_BSGH = kv   # zero-padded keys past S lie after every query: masked like later keys
        K = kb_BSGH.shape[1]   # keys in this block
        scores, _ = grouped(q_BTNH, kb_BSGH, vb_BSGH)
        visible_TS = jnp.arange(T)[:, None] >= start + jnp.arange(K)[None, :]
        p_BTNS = jnp.exp(jnp.where(visible_TS[:, None], scores(0, K), -jnp.inf) - lse_BTN[..., None])
        ds_BTNS = p_BTNS * (jnp.einsum("btgrh,bsgh->btgrs", d_out_BTGRH, vb_BSGH.astype(jnp.float32)
                                       ).reshape(B, T, N, K) - delta_BTN[..., None]) * H ** -0.5
        p_BTGRS, ds_BTGRS = p_BTNS.reshape(B, T, G, R, K), ds_BTNS.reshape(B, T, G, R, K)
        dq_BTGRH = dq_BTGRH + jnp.einsum("btgrs,bsgh->btgrh", ds_BTGRS, kb_BSGH.astype(jnp.float32))
        return dq_BTGRH, (jnp.einsum("btgrs,btgrh->bsgh", ds_BTGRS, qf_BTGRH),
                          jnp.einsum("btgrs,btgrh->bsgh", p_BTGRS, d_out_BTGRH))

    dq_BTGRH, (dk_BSGH, dv_BSGH) = scan_chunks(body, jnp.zeros(qf_BTGRH.shape, jnp.float32), (k_BSGH, v_BSGH), block)
    return (dq_BTGRH.reshape(q_BTNH.shape).astype(q_BTNH.dtype), dk_BSGH.astype(k_BSGH.dtype),
            dv_BSGH.astype(v_BSGH.dtype))


causal_gqa.defvjp(_causal_fwd, _causal_bwd)
