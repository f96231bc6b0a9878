"""Attention over fixed-size caches: MLA for the target, GQA for the draft."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.config import TargetConfig
from eagle3_jax.models.cache import MLACache
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


def key_block(capacity: int, block: int = KEY_BLOCK) -> int:
    """Slots per step of ``attend_filled``'s loop: ``block``, or the whole cache when that is
    no larger (one step then, taken without a loop)."""
    return min(block, capacity)


def attend_filled(q_lat_BTNC, q_rope_BTNP, cache: MLACache, layer: int, positions_BT, softmax_scale,
                  block: int = KEY_BLOCK) -> jax.Array:
    """Absorbed MLA attention over the *filled* slots of layer ``layer``: [B, T, N, C] out latents.

    A query at position p sees slots 0..p, so no query of the batch sees a slot past the largest
    position; the loop reads key blocks of ``block`` slots up to that one only, with a running
    (online) softmax: max, normalizer and weighted latent sum, rescaled as each block raises the
    max. Cost follows the longest filled row, not the cache capacity. (A whole-capacity softmax
    made a decode step at capacity 2048 read 8x the cache of capacity 256 for the same prompts.)
    The last block may start earlier than ``k * block`` (capacity not a multiple of ``block``);
    its slots already seen are masked, so no slot is counted twice.
    """
    latent_LBSC, rope_LBSP = cache.latent_LBSC, cache.rope_LBSP
    _, B, S, C = latent_LBSC.shape
    P = rope_LBSP.shape[-1]
    T, N = q_lat_BTNC.shape[1], q_lat_BTNC.shape[2]
    kb = key_block(S, block)
    q_lat_BTNC = q_lat_BTNC.astype(latent_LBSC.dtype)
    q_rope_BTNP = q_rope_BTNP.astype(rope_LBSP.dtype)

    def scores(lat_BSC, rope_BSP, slots_S, seen_from):
        s_BTNS = (jnp.einsum("btnc,bsc->btns", q_lat_BTNC, lat_BSC, preferred_element_type=jnp.float32)
                  + jnp.einsum("btnp,bsp->btns", q_rope_BTNP, rope_BSP, preferred_element_type=jnp.float32)
                  ) * softmax_scale
        vis_BTS = (slots_S[None, None, :] <= positions_BT[:, :, None]) & (slots_S >= seen_from)[None, None, :]
        return jnp.where(vis_BTS[:, :, None, :], s_BTNS, -jnp.inf)

    if kb == S:  # one block: the plain masked softmax
        s_BTNS = scores(latent_LBSC[layer], rope_LBSP[layer], jnp.arange(S), 0)
        probs_BTNS = jax.nn.softmax(s_BTNS, axis=-1)
        return jnp.einsum("btns,bsc->btnc", probs_BTNS.astype(latent_LBSC.dtype), latent_LBSC[layer])

    # Slots any query of the batch can see; positions past the capacity see the whole cache.
    filled = jnp.clip(jnp.max(positions_BT) + 1, 1, S)
    n_blocks = (filled + kb - 1) // kb

    def step(j, carry):
        m_BTN, l_BTN, acc_BTNC = carry
        start = jnp.minimum(j * kb, S - kb)
        lat_BSC = jax.lax.dynamic_slice(latent_LBSC, (layer, 0, start, 0), (1, B, kb, C))[0]
        rope_BSP = jax.lax.dynamic_slice(rope_LBSP, (layer, 0, start, 0), (1, B, kb, P))[0]
        s_BTNS = scores(lat_BSC, rope_BSP, start + jnp.arange(kb), j * kb)
        m_new_BTN = jnp.maximum(m_BTN, jnp.max(s_BTNS, axis=-1))
        # A query with nothing visible yet keeps max -inf; shift by 0 there so exp gives 0, not NaN.
        shift_BTN = jnp.where(jnp.isfinite(m_new_BTN), m_new_BTN, 0.0)
        p_BTNS = jnp.exp(s_BTNS - shift_BTN[..., None])
        keep_BTN = jnp.exp(m_BTN - shift_BTN)
        l_BTN = l_BTN * keep_BTN + p_BTNS.sum(-1)
        acc_BTNC = acc_BTNC * keep_BTN[..., None] + jnp.einsum(
            "btns,bsc->btnc", p_BTNS.astype(lat_BSC.dtype), lat_BSC, preferred_element_type=jnp.float32)
        return m_new_BTN, l_BTN, acc_BTNC

    init = (jnp.full((B, T, N), -jnp.inf, jnp.float32), jnp.zeros((B, T, N), jnp.float32),
            jnp.zeros((B, T, N, C), jnp.float32))
    _, l_BTN, acc_BTNC = jax.lax.fori_loop(0, n_blocks, step, init)
    return (acc_BTNC / l_BTN[..., None]).astype(latent_LBSC.dtype)


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
