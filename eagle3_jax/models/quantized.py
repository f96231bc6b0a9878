"""Quantized weights held as they are stored, in the checkpoint's own ``[out, in]`` orientation (the
words read from disk are the words held on the devices and written back, bit for bit); why, and how
they are multiplied a tile at a time: docs/architecture.md, "Quantized weights".

``Int4Stack``  ``packed`` int32 ``[E, out, ceil(in/8)]``, ``scale`` ``[E, out, ceil(in/group)]``:
    ``w[e, o, i] = (nibble(e, o, i) - 8) * scale[e, o, i // group]``.
``Fp8Stack`` / ``Fp8Linear``  ``weight`` float8_e4m3fn ``[(E,) out, in]``, ``scale_inv`` float32
    ``[(E,) ceil(out/bo), ceil(in/bi)]``: ``w = weight * scale_inv[o // bo, i // bi]``.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.kernels.dequant import TILE_COLS, as_bytes, tile_width
from eagle3_jax.models.params import param
from eagle3_jax.models.quant_format import (  # noqa: F401 (QuantLayout re-exported: models name it from here)
    INT4_OFFSET, INT4_PER_WORD, QuantLayout, int4_nibbles, int4_plane)
from eagle3_jax.sharding import mesh_axis


# ---------------------------------------------------------------------- dequantization (jnp)
def dequant_int4(packed_OW: jax.Array, scale_OG: jax.Array, cols: int, group: int, dtype) -> jax.Array:
    """int32 words [..., out, W] + scales [..., out, G] -> [..., out, cols] in ``dtype``
    (``cols`` may be less than 8 * W); each product rounded once to ``dtype``."""
    # In the scales' own dtype when that is the result dtype: q * s is still rounded once, and no
    # float32 copy of the scales exists (XLA:CPU would make one for the whole stack).
    compute = scale_OG.dtype if jnp.dtype(dtype) == scale_OG.dtype else jnp.float32
    nibbles = int4_nibbles(jax.lax.bitcast_convert_type(packed_OW, jnp.uint32), jnp)
    q = nibbles.reshape(*packed_OW.shape[:-1], -1)[..., :cols].astype(compute) - INT4_OFFSET
    scale = scale_OG.astype(compute)
    if cols % group == 0:
        # [.., out, G, group] x [.., out, G, 1]: a broadcast, not a repeat (which XLA:CPU gathers)
        w = (q.reshape(*q.shape[:-1], -1, group) * scale[..., None]).reshape(q.shape)
    else:
        w = q * jnp.repeat(scale, group, axis=-1)[..., :cols]
    return w.astype(dtype)


def dequant_fp8(w_OI: jax.Array, scale_RC: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """float8 [..., out, in] x float32 tile scales [..., ceil(out/bo), ceil(in/bi)] -> ``dtype``."""
    rows, cols = w_OI.shape[-2:]
    bo, bi = block
    w = w_OI.astype(jnp.float32)
    s = scale_RC.astype(jnp.float32)
    if rows % bo == 0 and cols % bi == 0:
        # whole tiles: [.., R, bo, C, bi] x [.., R, 1, C, 1]
        lead = w.shape[:-2]
        tiles = w.reshape(*lead, rows // bo, bo, cols // bi, bi) * s[..., :, None, :, None]
        return tiles.reshape(w.shape).astype(dtype)
    s = jnp.repeat(jnp.repeat(s, bo, axis=-2), bi, axis=-1)[..., :rows, :cols]
    return (w * s).astype(dtype)


def dequant_fp8_slice(w_OI, scale_RC, block, start, size: int, axis: int, dtype) -> jax.Array:
    """Rows (axis -2) or columns (axis -1) [start, start + size) of a block-scaled FP8 matrix,
    dequantized (start, size: whole blocks); sliced as bytes (``kernels/dequant.as_bytes``)."""
    unit = block[axis]
    raw = as_bytes(w_OI, start)
    w = jax.lax.bitcast_convert_type(jax.lax.dynamic_slice_in_dim(raw, start, size, axis=axis), w_OI.dtype)
    s = jax.lax.dynamic_slice_in_dim(scale_RC, start // unit, size // unit, axis=axis)
    return dequant_fp8(w, s, block, dtype)


# ---------------------------------------------------------------------- containers
def _qparam(value, axes) -> nnx.Param:
    return nnx.Param(value, axes=tuple(axes))


class Int4Stack(nnx.Module):
    """E experts' ``[out, in]`` matrices as INT4 words + group scales (see module doc)."""

    def __init__(self, E: int, out: int, cols: int, axes: Sequence[str | None], layout: QuantLayout,
                 rngs: nnx.Rngs | None):
        g = layout.int4_group
        words, groups = math.ceil(cols / 8), math.ceil(cols / g)
        scale_dtype = jnp.dtype(layout.int4_scale_dtype)
        if rngs is None:
            packed = jnp.zeros((E, out, words), jnp.int32)
            scale = jnp.zeros((E, out, groups), scale_dtype)
        else:
            bits = jax.random.bits(rngs.params(), (E, out, words), jnp.uint32)
            packed = jax.lax.bitcast_convert_type(bits, jnp.int32)
            # |q| <= 8, so a scale of 0.02 / 4 gives weights of about the float init's size.
            scale = (0.005 * (0.5 + jax.random.uniform(rngs.params(), (E, out, groups)))).astype(scale_dtype)
        self.packed = _qparam(packed, axes)
        self.scale = _qparam(scale, axes)
        self.cols = cols
        self.group = g

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        return self.packed[...], self.scale[...]

    def dequant_one(self, packed_OW, scale_OG, dtype) -> jax.Array:
        # Under tensor sharding a device holds a slice of the packed axis; its columns are whole words.
        return dequant_int4(packed_OW, scale_OG, min(self.cols, packed_OW.shape[-1] * 8), self.group, dtype)

    @property
    def col_unit(self) -> int:
        """Input columns of the smallest tile that holds whole words and whole groups."""
        return math.lcm(8, self.group)

    def tile_product(self, x_bT, packed_OW, scale_OG, start, width: int) -> jax.Array:
        """float32 ``x_bT @ W[:, start:start + width].T`` for one expert, by nibble plane: plane k,
        ``(words >> 4k) & 0xF`` in the words' own [O, W] layout, meets activation columns k::8.
        Interleaving the planes back into columns is a minor-dimension reshape that made the TPU
        compiler relayout every packed stack ahead of the decode loop. Weights are rounded as in
        ``dequant_int4``; only the float32 summation order differs."""
        g, W, dtype = self.group, width // INT4_PER_WORD, x_bT.dtype
        words_OW = jax.lax.dynamic_slice_in_dim(packed_OW, start // INT4_PER_WORD, W, axis=-1)
        s_OG = jax.lax.dynamic_slice_in_dim(scale_OG, start // g, width // g, axis=-1)
        if g % INT4_PER_WORD:  # a group that splits words: the plain interleaved tile
            w_OT = dequant_int4(words_OW, s_OG, width, g, dtype)
            return jnp.einsum("bt,ot->bo", x_bT, w_OT, preferred_element_type=jnp.float32)
        compute = s_OG.dtype if jnp.dtype(dtype) == s_OG.dtype else jnp.float32
        # One scale per word, spread by an exact 0/1 matmul rather than a minor-dimension reshape.
        spread_GW = (jnp.arange(W)[None, :] // (g // 8) == jnp.arange(s_OG.shape[-1])[:, None]).astype(s_OG.dtype)
        s_OW = jnp.einsum("og,gw->ow", s_OG, spread_GW, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32).astype(compute)
        words = jax.lax.bitcast_convert_type(words_OW, jnp.uint32)
        planes_K = jnp.arange(INT4_PER_WORD, dtype=jnp.uint32)[:, None, None]
        q_KOW = int4_plane(words[None], planes_K, jnp).astype(compute) - INT4_OFFSET
        w_KOW = (q_KOW * s_OW[None]).astype(dtype)
        x_KbW = jnp.moveaxis(x_bT.reshape(x_bT.shape[0], W, INT4_PER_WORD), -1, 0)
        return jnp.einsum("kbw,kow->bo", x_KbW, w_KOW, preferred_element_type=jnp.float32)


class Fp8Stack(nnx.Module):
    """E experts' ``[out, in]`` matrices as float8_e4m3fn + 2-D block scales."""

    def __init__(self, E: int, out: int, cols: int, axes: Sequence[str | None], layout: QuantLayout,
                 rngs: nnx.Rngs | None):
        self.weight, self.scale_inv = _fp8_pair((E,), out, cols, axes, layout, rngs)
        self.block = tuple(layout.fp8_block)

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        return self.weight[...], self.scale_inv[...]

    def dequant_one(self, w_OI, scale_RC, dtype) -> jax.Array:
        return dequant_fp8(w_OI, scale_RC, self.block, dtype)

    @property
    def col_unit(self) -> int:
        return self.block[1]

    def tile_product(self, x_bT, w_OI, scale_RC, start, width: int) -> jax.Array:
        """float32 ``x_bT @ W[:, start:start + width].T`` for one expert."""
        w_OT = dequant_fp8_slice(w_OI, scale_RC, self.block, start, width, -1, x_bT.dtype)
        return jnp.einsum("bt,ot->bo", x_bT, w_OT, preferred_element_type=jnp.float32)


class Fp8Linear(nnx.Module):
    """One dense ``[out, in]`` FP8 matrix standing in for a float parameter of shape ``ours_shape``
    (the ``in_ndim`` leading dims are the input, the rest the output). ``project`` (the plain
    ``x @ W``) and ``fold_in_tiles`` (anything else, e.g. MLA's absorbed ``kv_b``) dequantize a tile
    at a time inside a ``fori_loop``: XLA hoists a whole dequantized matrix out of the decode loop.
    """

    def __init__(self, ours_shape: Sequence[int], in_ndim: int, axes: Sequence[str | None],
                 layout: QuantLayout, dtype, rngs: nnx.Rngs | None):
        ours_shape = tuple(int(s) for s in ours_shape)
        cols, out = math.prod(ours_shape[:in_ndim]), math.prod(ours_shape[in_ndim:])
        # [out, in] gets the names of the first output and first input dims of our layout.
        self.axes_OI = (axes[in_ndim], axes[0])
        self.weight, self.scale_inv = _fp8_pair((), out, cols, self.axes_OI, layout, rngs)
        self.block = tuple(layout.fp8_block)
        self.ours_shape = ours_shape
        self.in_ndim = in_ndim
        self.dtype = dtype

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.ours_shape[self.in_ndim:]

    def dequantized(self) -> jax.Array:
        """The whole matrix in our layout (for checks; the model's call sites use the tiled paths)."""
        w_OI = dequant_fp8(self.weight[...], self.scale_inv[...], self.block, self.dtype)
        return w_OI.T.reshape(self.ours_shape)

    def fold_in_tiles(self, body, init, tile: int = TILE_COLS):
        """``carry = body(start, width, w_T_, carry)`` for consecutive tiles of ``width`` input rows
        of our layout (input columns of the stored matrix), ``w_T_``: ``[width, *out_shape]`` in the
        model dtype, inside a ``fori_loop``. An input that is not whole blocks is one tile."""
        w_OI, scale_RC = self.weight[...], self.scale_inv[...]
        I = w_OI.shape[-1]
        width = tile_width(I, self.block[1], tile)
        if width is None:
            return body(0, I, self.dequantized().reshape(I, *self.out_shape), init)

        def step(i, carry):
            start = i * width
            w_OT = dequant_fp8_slice(w_OI, scale_RC, self.block, start, width, -1, self.dtype)
            return body(start, width, w_OT.T.reshape(width, *self.out_shape), carry)

        return jax.lax.fori_loop(0, I // width, step, init)

    def project(self, x: jax.Array, tile: int = TILE_COLS) -> jax.Array:
        """``x [..., *in_shape] -> [..., *out_shape]``, accumulated in float32 over tiles of input
        columns, or of output rows where the table splits only the input axis (``o_proj``, ``down``
        under tensor parallelism: slicing a split axis would gather it)."""
        lead = x.shape[:x.ndim - self.in_ndim]
        x_LI = x.reshape(*lead, -1)
        O = math.prod(self.out_shape)
        acc_LO = jnp.zeros((*lead, O), jnp.float32)
        height = tile_width(O, self.block[0], tile)
        if height is not None and _is_split(self.axes_OI[1]) and not _is_split(self.axes_OI[0]):
            w_OI, scale_RC = self.weight[...], self.scale_inv[...]

            def rows(i, y_LO):
                start = i * height
                w_HI = dequant_fp8_slice(w_OI, scale_RC, self.block, start, height, -2, self.dtype)
                y_LH = jnp.einsum("...i,hi->...h", x_LI, w_HI, preferred_element_type=jnp.float32)
                return jax.lax.dynamic_update_slice_in_dim(y_LO, y_LH, start, axis=-1)

            y_LO = jax.lax.fori_loop(0, O // height, rows, acc_LO)
        else:
            def cols(start, width, w_K_, a_LO):  # K: this tile's input columns
                x_LK = jax.lax.dynamic_slice_in_dim(x_LI, start, width, axis=-1)
                return a_LO + jnp.einsum("...k,ko->...o", x_LK, w_K_.reshape(width, O),
                                         preferred_element_type=jnp.float32)

            y_LO = self.fold_in_tiles(cols, acc_LO, tile)
        return y_LO.astype(jnp.result_type(x.dtype, self.dtype)).reshape(*lead, *self.out_shape)


def _is_split(logical: str | None) -> bool:
    return logical is not None and mesh_axis(logical) is not None


def project(spec: str, x: jax.Array, w) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a float parameter; the tiled ``Fp8Linear.project`` for an FP8
    one, whose ``spec`` must be that plain projection (x's trailing input dims, then w's output dims)."""
    if not isinstance(w, Fp8Linear):
        return jnp.einsum(spec, x, w[...])
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    n = w.in_ndim
    if lhs[-n:] != rhs[:n] or out != lhs[:-n] + rhs[n:]:
        raise ValueError(f"project: '{spec}' is not a plain projection over {n} input dim(s); "
                         "use Fp8Linear.fold_in_tiles for other contractions")
    return w.project(x)


def _fp8_pair(lead, out, cols, axes, layout: QuantLayout, rngs):
    bo, bi = layout.fp8_block
    shape, sshape = lead + (out, cols), lead + (math.ceil(out / bo), math.ceil(cols / bi))
    sdtype = jnp.dtype(layout.fp8_scale_dtype)
    if rngs is None:
        w, s = jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(sshape, sdtype)
    else:
        w = jax.random.normal(rngs.params(), shape, jnp.float32).astype(jnp.float8_e4m3fn)
        s = (0.02 * (0.5 + jax.random.uniform(rngs.params(), sshape))).astype(sdtype)
    return _qparam(w, axes), _qparam(s, axes)


def expert_stack(E: int, out: int, cols: int, axes: Sequence[str | None], layout: QuantLayout,
                 rngs: nnx.Rngs | None):
    """The quantized container for one routed-expert stack (axes name [E, out, in])."""
    cls = Int4Stack if layout.experts == "int4" else Fp8Stack
    return cls(E, out, cols, axes, layout, rngs)


def linear_param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype,
                 layout: QuantLayout | None, in_ndim: int = 1):
    """A dense projection: an ``Fp8Linear`` when the layout quantizes linears, else a float Param."""
    if layout is not None and layout.linears == "fp8":
        return Fp8Linear(shape, in_ndim, axes, layout, dtype, rngs)
    return param(rngs, shape, axes, dtype)

