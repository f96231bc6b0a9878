"""Multi-head latent attention for a DFlash draft (``dflash_config.attention_mode: mla``, SpecForge's
``Qwen3DFlashMLAAttention``): the DeepSeek-V3 parameterization in place of the GQA projections,
the rest of the layer, the context injection and the masks unchanged.

    q        = q_b_proj(q_a_layernorm(q_a_proj(xn)))  (or q_proj(xn)),  split [nope Z | rope P]
    c, k_r   = kv_a_proj_with_mqa(y) split [C | P];  c = kv_a_layernorm(c)   y: context states or xn
    k, v     = kv_b_proj(c) split per head [Z | Y];  k_r rotated, shared by every head
    out      = o_proj(attend(q, [k | k_r], v) * sigmoid(g_proj(xn)))   (the gate only if configured)

scale (Z + P)^-1/2, no YaRN mscale on it. RoPE covers only the P rope columns, at the draft's
positions, pairs interleaved (the DeepSeek convention) unless ``mla_rope_interleaved`` is false.

It runs in the target's absorbed form (``models.attention``): keys are the latent and the rotated
rope key, one "head" of C + P shared by all queries (absorbed through kv_b's key part), values the
latent, expanded through kv_b's value part after the softmax. So the cache holds 2C + P numbers a
position and layer, not N (Z + P + Y), and training and serving share one form. kv_b's key bias
adds q·b_k to every key of a query alike (the softmax ignores it, so it is not applied); its value
bias is added after the softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.dflash.config import DFlashConfig
from eagle3_jax.models.attention import absorb_keys, expand_values
from eagle3_jax.models.layers import RMSNorm, apply_rope, param


def linear(spec, x, w, b):
    """``einsum(spec, x, w)`` plus the bias ``b`` where there is one."""
    y = jnp.einsum(spec, x, w[...])
    return y if b is None else y + b[...]


class DFlashMLAttention(nnx.Module):
    """Same interface as the GQA layer (``keys``, ``__call__`` with an ``attend``): ``keys`` gives
    [B, T, 1, C + P] keys and [B, T, 1, C] values, and the queries ``attend`` receives are the
    absorbed [B, T, N, C + P] ones, scored at :attr:`softmax_scale`."""

    def __init__(self, cfg: DFlashConfig, dtype, rngs):
        m = cfg.mla
        D, N, C, P, Z, Y = (cfg.hidden_size, cfg.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim,
                            m.qk_nope_head_dim, m.v_head_dim)
        self.nope, self.latent, self.interleaved = Z, C, m.rope_interleaved
        self.softmax_scale = float(m.qk_head_dim) ** -0.5
        bias = cfg.attention_bias

        def bias_of(shape, axes):
            return param(None, shape, axes, dtype) if bias else None

        if m.q_lora_rank is None:
            self.q_proj = param(rngs, (D, N, Z + P), ("embed", "heads", "head_dim"), dtype)
            self.q_bias = bias_of((N, Z + P), ("heads", "head_dim"))
        else:
            Q = m.q_lora_rank
            self.q_a_proj = param(rngs, (D, Q), ("embed", "q_lora"), dtype)
            self.q_a_bias = bias_of((Q,), ("q_lora",))
            self.q_a_layernorm = RMSNorm(Q, cfg.rms_norm_eps, dtype, axes=("q_lora",))
            self.q_b_proj = param(rngs, (Q, N, Z + P), ("q_lora", "heads", "head_dim"), dtype)
            self.q_b_bias = bias_of((N, Z + P), ("heads", "head_dim"))
        self.kv_a_proj_with_mqa = param(rngs, (D, C + P), ("embed", "kv_lora"), dtype)
        self.kv_a_bias = bias_of((C + P,), ("kv_lora",))
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps, dtype, axes=("kv_lora",))
        self.kv_b_proj = param(rngs, (C, N, Z + Y), ("kv_lora", "heads", "head_dim"), dtype)
        self.kv_b_bias = bias_of((N, Z + Y), ("heads", "head_dim"))
        self.g_proj = param(rngs, (D, N, Y), ("embed", "heads", "head_dim"), dtype) if m.output_gate else None
        self.o_proj = param(rngs, (N, Y, D), ("heads", "head_dim", "embed"), dtype)
        self.o_bias = bias_of((D,), ("embed",))

    def _queries(self, xn_BTD):
        if hasattr(self, "q_proj"):
            return linear("btd,dnh->btnh", xn_BTD, self.q_proj, self.q_bias)
        qa_BTQ = self.q_a_layernorm(linear("btd,dq->btq", xn_BTD, self.q_a_proj, self.q_a_bias))
        return linear("btq,qnh->btnh", qa_BTQ, self.q_b_proj, self.q_b_bias)

    def keys(self, x_BTD, cos_BTP, sin_BTP):
        """Keys [latent | rotated rope key] and values (the latent) of ``x_BTD``, one shared head."""
        kv_BT_ = linear("btd,dx->btx", x_BTD, self.kv_a_proj_with_mqa, self.kv_a_bias)
        lat_BTC = self.kv_a_layernorm(kv_BT_[..., :self.latent])
        rope_BTP = apply_rope(kv_BT_[..., self.latent:], cos_BTP, sin_BTP, self.interleaved)
        return jnp.concatenate([lat_BTC, rope_BTP], axis=-1)[:, :, None], lat_BTC[:, :, None]

    def __call__(self, xn_BTD, cos_BTP, sin_BTP, attend):
        q_BTNH = self._queries(xn_BTD)
        q_rope_BTNP = apply_rope(q_BTNH[..., self.nope:], cos_BTP[:, :, None], sin_BTP[:, :, None], self.interleaved)
        q_lat_BTNC = absorb_keys(q_BTNH[..., :self.nope], self.kv_b_proj, self.nope)
        keys_BT1_, lat_BT1C = self.keys(xn_BTD, cos_BTP, sin_BTP)
        q_BTN_ = jnp.concatenate([q_lat_BTNC.astype(q_rope_BTNP.dtype), q_rope_BTNP], axis=-1)
        out_BTNC = attend(q_BTN_, keys_BT1_, lat_BT1C).astype(lat_BT1C.dtype)
        out_BTNY = expand_values(out_BTNC, self.kv_b_proj, self.nope)
        if self.kv_b_bias is not None:
            out_BTNY = out_BTNY + self.kv_b_bias[...][:, self.nope:]
        if self.g_proj is not None:
            out_BTNY = out_BTNY * jax.nn.sigmoid(jnp.einsum("btd,dny->btny", xn_BTD, self.g_proj[...]))
        return linear("btny,nyd->btd", out_BTNY, self.o_proj, self.o_bias)
