"""The target's multi-head latent attention over its fixed-size cache (the core: attention_core.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.config import TargetConfig
from eagle3_jax.models import attention_core as core
from eagle3_jax.models.cache import MLACache
from eagle3_jax.models.layers import RMSNorm, apply_rope
from eagle3_jax.models.quantized import TILE_COLS, Fp8Linear, QuantLayout, linear_param, project


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


def attend_filled(q_lat_BTNC, q_rope_BTNP, cache: MLACache, layer: int, positions_BT, softmax_scale,
                  block: int | None = None) -> jax.Array:
    """Absorbed MLA attention over the *filled* slots of layer ``layer``: [B, T, N, C] out latents,
    in the core's blockwise form (cost following the longest filled row, not the capacity)."""
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

    out_BTNC, _ = core.blockwise(scores, weighted, positions_BT, S, core.key_block(S, T, N, block))
    return out_BTNC.astype(latent_LBSC.dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) in the weight-absorbed form. The cache holds the
    normalized latent c (C wide) and the rotated shared rope key (P wide). Scores are
    q_nope·(W_k c) + q_rope·k_rope = (W_kᵀ q_nope)·c + q_rope·k_rope, so keys and values are never
    expanded per head: the work per cached token is O(N·C), independent of H."""

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
        """Attends over layer ``layer`` of the stacked cache after writing this call's tokens straight
        into it (no copy of the layer); returns (y, cache)."""
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
        out_lat_BTNC = attend_filled(q_lat_BTNC, q_rope_BTNP, cache, layer, positions_BT, softmax_scale)
        out_BTNO = expand_values(out_lat_BTNC, self.kv_b_proj, nope)
        y_BTD = project("btno,nod->btd", out_BTNO, self.o_proj)
        return y_BTD, cache
