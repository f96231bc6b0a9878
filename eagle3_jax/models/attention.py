"""Attention over fixed-size caches: MLA for the target, GQA for the draft."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.config import TargetConfig
from eagle3_jax.models.cache import KVCache, MLACache
from eagle3_jax.models.layers import RMSNorm, apply_rope
from eagle3_jax.models.quantized import TILE_COLS, Fp8Linear, QuantLayout, linear_param, project


def masked_softmax(scores_BTNS: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    s = jnp.where(mask_BTS[:, :, None, :], scores_BTNS.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(s, axis=-1)


def absorb_keys(q_nope_BTNO: jax.Array, kv_b, nope: int, tile: int = TILE_COLS) -> jax.Array:
    """q_lat = W_kᵀ q_nope per head: [B, T, N, nope] x kv_b's key part [C, N, nope] -> [B, T, N, C].

    An FP8 ``kv_b`` is dequantized a tile of latent columns at a time; each tile fills its own
    slice of q_lat (the contraction is over ``nope``, within a tile), so the result is exact."""
    if not isinstance(kv_b, Fp8Linear):
        return jnp.einsum("btno,cno->btnc", q_nope_BTNO, kv_b[...][..., :nope])
    B, T, N, _ = q_nope_BTNO.shape
    C = kv_b.ours_shape[0]

    def absorb_tile(start, width, w_KNX, q_lat_BTNC):  # K: this tile's latent columns
        part_BTNK = jnp.einsum("btno,kno->btnk", q_nope_BTNO, w_KNX[..., :nope])
        return jax.lax.dynamic_update_slice_in_dim(q_lat_BTNC, part_BTNK.astype(q_lat_BTNC.dtype), start, axis=-1)

    dtype = jnp.result_type(q_nope_BTNO.dtype, kv_b.dtype)
    return kv_b.fold_in_tiles(absorb_tile, jnp.zeros((B, T, N, C), dtype), tile)


def expand_values(out_lat_BTNC: jax.Array, kv_b, nope: int, tile: int = TILE_COLS) -> jax.Array:
    """out = W_v out_lat per head: [B, T, N, C] x kv_b's value part [C, N, V] -> [B, T, N, V]
    (an FP8 ``kv_b`` a tile of latent columns at a time, partial products summed in float32)."""
    if not isinstance(kv_b, Fp8Linear):
        return jnp.einsum("btnc,cno->btno", out_lat_BTNC, kv_b[...][..., nope:])
    B, T, N, _ = out_lat_BTNC.shape
    V = kv_b.out_shape[-1] - nope

    def expand_tile(start, width, w_KNX, acc_BTNV):
        lat_BTNK = jax.lax.dynamic_slice_in_dim(out_lat_BTNC, start, width, axis=-1)
        return acc_BTNV + jnp.einsum("btnk,kno->btno", lat_BTNK, w_KNX[..., nope:],
                                     preferred_element_type=jnp.float32)

    out_BTNV = kv_b.fold_in_tiles(expand_tile, jnp.zeros((B, T, N, V), jnp.float32), tile)
    return out_BTNV.astype(jnp.result_type(out_lat_BTNC.dtype, kv_b.dtype))


KEY_BLOCK = 128
# The most scores one row's block step holds, T x N x kb (float32: 16 MiB a row). Decode blocks are
# far below it; it bounds prefill chunks, whose T x N asks for whole-capacity blocks (Kimi-K2.5,
# 32 rows x 256 positions x 64 heads over 1024 slots: 2 GiB a score array per chip, several live).
MAX_BLOCK_SCORES = 1 << 22


def key_block(capacity: int, tokens: int, heads: int, block: int = KEY_BLOCK) -> int:
    """Slots per step of ``attend_filled``'s loop: at least ``block`` and at least 4 * T * N (a
    power of two), at most the whole cache (one step then, taken without a loop), and no more than
    ``MAX_BLOCK_SCORES`` scores a row.

    A step reads its keys, about 2 * kb * C bytes a row (bf16), and reads and writes the running
    float32 sums, 8 * T * N * C bytes a row, which a compiled loop keeps in memory between steps:
    blocks of 4 * T * N slots or more keep that traffic no larger than the keys'. (Compiled for a
    TPU v5p at Kimi's shapes, 32 rows x 64 heads verifying 5 tokens: 128-slot steps moved 220 MB
    each, 4.7 MB of them keys.) Where the score cap binds (prefill chunks, T in the hundreds), a
    step does 4 * T * N * kb * C flops against those 8 * T * N * C bytes, kb / 2 flops a byte:
    compute-bound at the cap's blocks of 256 slots and more."""
    need = 1 << max(0, (4 * tokens * heads - 1).bit_length())
    cap = 1 << max(0, (MAX_BLOCK_SCORES // max(1, tokens * heads)).bit_length() - 1)
    return min(capacity, max(block, min(need, cap)))


def online_softmax_over_slots(scores_fn, weighted_fn, positions_BT, capacity: int, kb: int, out_dtype):
    """softmax(scores over visible slots) . values, reading ``kb`` slots per step, up to the
    largest position of the batch only (a query at position p sees slots 0..p).

    ``scores_fn(start, size)`` -> [B, T, N, size] float32 scaled scores of slots [start, start + size);
    ``weighted_fn(p_BTNS, start, size)`` -> [B, T, N, X] float32, p times those slots' values.
    A running max, normalizer and weighted sum are rescaled as each block raises the max (online
    softmax). The last block may start before ``j * kb`` (capacity not a multiple of kb); its
    slots already seen are masked, so no slot is counted twice. With kb == capacity: one plain
    masked softmax, no loop."""
    def masked(s_BTNS, start, size, seen_from):
        slots_S = start + jnp.arange(size)
        vis_BTS = (slots_S[None, None, :] <= positions_BT[:, :, None]) & (slots_S >= seen_from)[None, None, :]
        return jnp.where(vis_BTS[:, :, None, :], s_BTNS, -jnp.inf)

    if kb >= capacity:
        probs_BTNS = jax.nn.softmax(masked(scores_fn(0, capacity), 0, capacity, 0), axis=-1)
        return weighted_fn(probs_BTNS, 0, capacity).astype(out_dtype)

    # Slots any query of the batch can see; positions past the capacity see the whole cache.
    filled = jnp.clip(jnp.max(positions_BT) + 1, 1, capacity)
    n_blocks = (filled + kb - 1) // kb

    def step(j, carry):
        m_BTN, l_BTN, acc_BTN_ = carry
        start = jnp.minimum(j * kb, capacity - kb)
        s_BTNS = masked(scores_fn(start, kb), start, kb, j * kb)
        m_new_BTN = jnp.maximum(m_BTN, jnp.max(s_BTNS, axis=-1))
        # A query with nothing visible yet keeps max -inf; shift by 0 there so exp gives 0, not NaN.
        shift_BTN = jnp.where(jnp.isfinite(m_new_BTN), m_new_BTN, 0.0)
        p_BTNS = jnp.exp(s_BTNS - shift_BTN[..., None])
        keep_BTN = jnp.exp(m_BTN - shift_BTN)
        return (m_new_BTN, l_BTN * keep_BTN + p_BTNS.sum(-1),
                acc_BTN_ * keep_BTN[..., None] + weighted_fn(p_BTNS, start, kb))

    shape_BTN = positions_BT.shape + (jax.eval_shape(lambda: scores_fn(0, kb)).shape[2],)
    width = jax.eval_shape(lambda: weighted_fn(jnp.zeros(shape_BTN + (kb,), jnp.float32), 0, kb)).shape[-1]
    init = (jnp.full(shape_BTN, -jnp.inf, jnp.float32), jnp.zeros(shape_BTN, jnp.float32),
            jnp.zeros(shape_BTN + (width,), jnp.float32))
    _, l_BTN, acc_BTN_ = jax.lax.fori_loop(0, n_blocks, step, init)
    return (acc_BTN_ / l_BTN[..., None]).astype(out_dtype)


def attend_filled(q_lat_BTNC, q_rope_BTNP, cache: MLACache, layer: int, positions_BT, softmax_scale,
                  block: int = KEY_BLOCK) -> jax.Array:
    """Absorbed MLA attention over the *filled* slots of layer ``layer``: [B, T, N, C] out latents,
    cost following the longest filled row, not the capacity (``online_softmax_over_slots``). A
    whole-capacity softmax made a decode step at capacity 2048 read 8x the cache of capacity 256
    for the same prompts."""
    latent_LBSC, rope_LBSP = cache.latent_LBSC, cache.rope_LBSP
    _, B, S, C = latent_LBSC.shape
    P = rope_LBSP.shape[-1]
    T, N = q_lat_BTNC.shape[1], q_lat_BTNC.shape[2]
    q_lat_BTNC = q_lat_BTNC.astype(latent_LBSC.dtype)
    q_rope_BTNP = q_rope_BTNP.astype(rope_LBSP.dtype)

    def lat(start, size):   # only this layer's slots [start, start + size): no copy of the layer
        return jax.lax.dynamic_slice(latent_LBSC, (layer, 0, start, 0), (1, B, size, C))[0]

    def scores(start, size):
        rope_BSP = jax.lax.dynamic_slice(rope_LBSP, (layer, 0, start, 0), (1, B, size, P))[0]
        return (jnp.einsum("btnc,bsc->btns", q_lat_BTNC, lat(start, size), preferred_element_type=jnp.float32)
                + jnp.einsum("btnp,bsp->btns", q_rope_BTNP, rope_BSP, preferred_element_type=jnp.float32)
                ) * softmax_scale

    def weighted(p_BTNS, start, size):
        lat_BSC = lat(start, size)
        return jnp.einsum("btns,bsc->btnc", p_BTNS.astype(lat_BSC.dtype), lat_BSC, preferred_element_type=jnp.float32)

    return online_softmax_over_slots(scores, weighted, positions_BT, S, key_block(S, T, N, block),
                                     latent_LBSC.dtype)


def attend_filled_gqa(q_BTNH, cache: KVCache, positions_BT, softmax_scale, block: int | None = None) -> jax.Array:
    """The draft's grouped-query attention over the filled slots of its KV cache ([B, S, G, H]):
    [B, T, N, H] out, N = G * R query heads sharing each key/value head. Keys and values are read
    a block of slots at a time, so a layout change the dot wants costs one block, not the cache."""
    k_BSGH, v_BSGH = cache.k_BSGH, cache.v_BSGH
    B, S, G, H = k_BSGH.shape
    T, N = q_BTNH.shape[1], q_BTNH.shape[2]
    q_BTGRH = q_BTNH.reshape(B, T, G, N // G, H).astype(k_BSGH.dtype)

    def slots(kv_BSGH, start, size):
        return jax.lax.dynamic_slice_in_dim(kv_BSGH, start, size, axis=1)

    def scores(start, size):
        s = jnp.einsum("btgrh,bsgh->btgrs", q_BTGRH, slots(k_BSGH, start, size), preferred_element_type=jnp.float32)
        return s.reshape(B, T, N, size) * softmax_scale

    def weighted(p_BTNS, start, size):
        p = p_BTNS.reshape(B, T, G, N // G, size).astype(v_BSGH.dtype)
        out_BTGRH = jnp.einsum("btgrs,bsgh->btgrh", p, slots(v_BSGH, start, size), preferred_element_type=jnp.float32)
        return out_BTGRH.reshape(B, T, N, H)

    kb = key_block(S, T, N, KEY_BLOCK if block is None else block)
    return online_softmax_over_slots(scores, weighted, positions_BT, S, kb, v_BSGH.dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) in the weight-absorbed form.

    The cache holds the normalized latent c (C wide) and the rotated shared rope key (P wide).
    Scores are q_nope·(W_k c) + q_rope·k_rope = (W_kᵀ q_nope)·c + q_rope·k_rope, so keys and
    values are never expanded per head: the work per cached token is O(N·C), independent of H.
    """

    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs | None, quant: QuantLayout | None = None):
        D, N = cfg.hidden_size, cfg.num_attention_heads
        C, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.cfg = cfg

        def linear(shape, axes, in_ndim=1):
            return linear_param(rngs, shape, axes, dtype, quant, in_ndim)

        if cfg.q_lora_rank is None:
            self.q_proj = linear((D, N, cfg.qk_head_dim), ("embed", "heads", "head_dim"))
        else:
            Q = cfg.q_lora_rank
            self.q_a_proj = linear((D, Q), ("embed", "q_lora"))
            self.q_a_layernorm = RMSNorm(Q, cfg.latent_rms_norm_eps, dtype, axes=("q_lora",))
            self.q_b_proj = linear((Q, N, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"))
        self.kv_a_proj_with_mqa = linear((D, C + P), ("embed", "kv_lora"))
        self.kv_a_layernorm = RMSNorm(C, cfg.latent_rms_norm_eps, dtype, axes=("kv_lora",))
        self.kv_b_proj = linear((C, N, cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads", "head_dim"))
        self.o_proj = linear((N, cfg.v_head_dim, D), ("heads", "head_dim", "embed"), in_ndim=2)

    def __call__(self, x_BTD, positions_BT, cos_BTP, sin_BTP, cache: MLACache, layer: int, softmax_scale):
        """Attends over layer ``layer`` of the stacked cache after writing this call's tokens into it;
        returns (y, cache). Only the new slots are written, straight into the stacked buffer: slicing
        the layer out and setting it back made XLA copy a whole layer of cache per call."""
        cfg = self.cfg
        nope, C = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q_BTNH = project("btd,dnh->btnh", x_BTD, self.q_proj)
        else:
            qa_BTQ = self.q_a_layernorm(project("btd,dq->btq", x_BTD, self.q_a_proj))
            q_BTNH = project("btq,qnh->btnh", qa_BTQ, self.q_b_proj)
        q_nope_BTNO, q_rope_BTNP = q_BTNH[..., :nope], q_BTNH[..., nope:]
        q_rope_BTNP = apply_rope(q_rope_BTNP, cos_BTP[:, :, None], sin_BTP[:, :, None], cfg.rope_interleave)

        kv_BTX = project("btd,dx->btx", x_BTD, self.kv_a_proj_with_mqa)
        latent_BTC = self.kv_a_layernorm(kv_BTX[..., :C])
        k_rope_BTP = apply_rope(kv_BTX[..., C:], cos_BTP, sin_BTP, cfg.rope_interleave)

        cache = cache.write(layer, latent_BTC, k_rope_BTP, positions_BT)

        q_lat_BTNC = absorb_keys(q_nope_BTNO, self.kv_b_proj, nope)
        out_lat_BTNC = attend_filled(q_lat_BTNC, q_rope_BTNP, cache, layer, positions_BT, softmax_scale,
                                     KEY_BLOCK)
        out_BTNO = expand_values(out_lat_BTNC, self.kv_b_proj, nope)
        y_BTD = project("btno,nod->btd", out_BTNO, self.o_proj)
        return y_BTD, cache
