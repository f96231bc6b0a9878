"""Building blocks shared by the target and the draft: RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.config import RopeConfig
from eagle3_jax.models.params import param  # noqa: F401  (re-exported: models build parameters through it)
from eagle3_jax.models.quantized import QuantLayout, linear_param, project


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Normalize in float32, cast back, then scale: the order the reference implementations use,
    # which matters in bfloat16.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, axes=("embed",)):
        self.weight = param(None, (dim,), axes, dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


# ---------------------------------------------------------------------- rotary embeddings
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale, for plain RoPE or YaRN (interpolated and
    extrapolated frequencies blended by a ramp between beta_fast's and beta_slow's correction dims)."""
    base = rope.theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    pos_freqs = base ** exponents
    inv_extra = 1.0 / pos_freqs
    if rope.rope_type != "yarn":
        return inv_extra.astype(np.float32), 1.0
    factor = rope.factor
    original = rope.original_max_position_embeddings or max_position_embeddings
    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_inter = 1.0 / (factor * pos_freqs)
    inv = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv.astype(np.float32), float(attn_factor)


def yarn_softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """Attention softmax scale; YaRN with mscale_all_dim multiplies it by mscale² (DeepSeek-V3)."""
    scale = head_dim ** -0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attn_factor: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., dim/2] for integer positions."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attn_factor, jnp.sin(angles) * attn_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotates x [..., T, heads?, dim]; cos/sin broadcast as [..., T, 1, dim/2] by the caller.
    ``interleaved``: the pairs are (x0, x1), (x2, x3), ... (DeepSeek checkpoints). The output is
    laid out de-interleaved ([evens', odds']); queries and keys get the same permutation, so their
    dot products are unchanged."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    dtype = x.dtype
    x1 = x1.astype(jnp.float32)
    x2 = x2.astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)


# ---------------------------------------------------------------------- MLP
class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, width: int, dtype, rngs: nnx.Rngs | None, width_axis: str = "mlp",
                 quant: QuantLayout | None = None):
        self.gate = linear_param(rngs, (dim, width), ("embed", width_axis), dtype, quant)
        self.up = linear_param(rngs, (dim, width), ("embed", width_axis), dtype, quant)
        self.down = linear_param(rngs, (width, dim), (width_axis, "embed"), dtype, quant)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        g_BTF = project("btd,df->btf", x_BTD, self.gate)
        u_BTF = project("btd,df->btf", x_BTD, self.up)
        return project("btf,fd->btd", jax.nn.silu(g_BTF) * u_BTF, self.down)
