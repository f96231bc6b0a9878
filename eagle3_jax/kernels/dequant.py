"""How quantized weights are read inside a compiled loop without a whole widened or dequantized copy:
XLA:CPU widens a whole float8 array ahead of the loop that slices it (so it is sliced as bytes:
``as_bytes``, ``take_expert``), and a dequantized matrix gets hoisted out of the decode loop (so a
matmul dequantizes one tile of columns at a time inside its own loop: ``quantized_matmul``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE_COLS = 512


def as_bytes(w, index) -> jax.Array:
    """Float8 ``w`` viewed as uint8, for slicing at the loop-dependent ``index`` just after. XLA:CPU
    runs the view as a copy, which would be hoisted out of the loop; tying it to ``index`` through
    an optimization barrier keeps it inside, fused into the slice."""
    if not isinstance(index, int):
        w, _ = jax.lax.optimization_barrier((w, index))
    return jax.lax.bitcast_convert_type(w, jnp.uint8)


def take_expert(stack_E_, e) -> jax.Array:
    """``stack[e]`` for a quantized stack; float8 indexed as bytes (module docstring)."""
    if jnp.dtype(stack_E_.dtype).itemsize == 1 and jnp.issubdtype(stack_E_.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(as_bytes(stack_E_, e)[e], stack_E_.dtype)
    return stack_E_[e]


def tile_width(n: int, unit: int, tile: int) -> int | None:
    """The widest multiple of ``unit`` that divides ``n`` and is at most ``tile`` (None if none)."""
    return max((w for w in range(unit, min(tile, n) + 1, unit) if n % w == 0), default=None)


def quantized_matmul(x_bI: jax.Array, values, scales, stack, tile: int = TILE_COLS) -> jax.Array:
    """``x [b, I] @ W.T`` for one quantized ``W [O, I]`` (``stack``: its container), dequantizing
    ``tile`` input columns at a time; partial products accumulate in float32."""
    I = x_bI.shape[-1]
    width = tile_width(I, stack.col_unit, tile)
    if width is None:  # columns not a multiple of whole groups / blocks: one piece
        return jnp.einsum("bi,oi->bo", x_bI, stack.dequant_one(values, scales, x_bI.dtype))

    def body(i, acc_bO):
        start = i * width
        x_bT = jax.lax.dynamic_slice_in_dim(x_bI, start, width, axis=-1)
        return acc_bO + stack.tile_product(x_bT, values, scales, start, width)

    acc_bO = jnp.zeros((x_bI.shape[0], values.shape[-2]), jnp.float32)
    return jax.lax.fori_loop(0, I // width, body, acc_bO).astype(x_bI.dtype)
