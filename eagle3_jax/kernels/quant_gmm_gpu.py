"""The grouped quantized matmuls of ``quant_gmm.py`` as Pallas Triton kernels, for GPU.

Same arguments and results as ``quant_gmm.int4_gmm`` / ``fp8_gmm`` (see that module for the
block table and the nibble planes). Triton has no scalar prefetch, so each program reads its
block's expert id from ``e_J`` itself and loads that expert's tiles by address; tile shapes are
powers of two and every matmul operand at least 16 on a side (Triton's dot), hence the stricter
``supports``. The stored words / float8 values are loaded as stored and dequantized in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from eagle3_jax.errors import ConfigError

MIN_ROWS = 16   # Triton's dot needs every side >= 16


def _pow2_tile(n: int, prefer: int, least: int) -> int | None:
    t = prefer
    while t >= least:
        if n % t == 0:
            return t
        t //= 2
    return None


def int4_tiles(O: int, W: int, G: int) -> tuple[int, int] | None:
    """(output rows, words) per tile; the words of a tile hold whole groups, and the group scales
    of a tile ([tn, tw / words-per-group]) are a dot operand, so at least 16 of them."""
    per_group = W // G
    tn = _pow2_tile(O, 64, 16)
    tw = _pow2_tile(W, 16 * per_group * 4, 16 * per_group)
    return None if tn is None or tw is None else (tn, tw)


def _blocks(e_ref, used_ref, x_ref, w_ref, s_ref, o_ref, *, tile):
    """One program: ``tile(e, j, n, x_ref, w_ref, s_ref)``, block j's float32 outputs of tile n
    from its expert e's weights, or zeros for a padding block."""
    j, n = pl.program_id(0), pl.program_id(1)
    used = used_ref[0]

    @pl.when(j < used)
    def _compute():
        o_ref[...] = tile(e_ref[j], j, n, x_ref, w_ref, s_ref).astype(o_ref.dtype)

    @pl.when(j >= used)
    def _padding():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _call(tile, x, e_J, used, w, s, rows: int, tn: int, out_dtype, interpret: bool):
    """The grid of (block of ``rows`` rows, ``tn`` output features) over ``x`` [..., A, in]."""
    A, O = x.shape[-2], w.shape[1]
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_blocks, tile=tile),
        out_shape=jax.ShapeDtypeStruct((A, O), out_dtype),
        grid=(A // rows, O // tn),
        in_specs=[whole] * 5,
        out_specs=pl.BlockSpec((rows, tn), lambda j, n: (j, n)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(e_J.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x, w, s)


def _int4_tile(e, j, n, x_ref, w_ref, s_ref, *, rows, tn, tw, per_group):
    tg = tw // per_group
    # expand[g, w] = 1 where word w of the tile lies in group g: scales per word by a dot (exact)
    expand = (jax.lax.broadcasted_iota(jnp.int32, (tg, tw), 1) // per_group
              == jax.lax.broadcasted_iota(jnp.int32, (tg, tw), 0)).astype(jnp.bfloat16)

    def chunk(c, acc):
        words = w_ref[e, pl.ds(n * tn, tn), pl.ds(c * tw, tw)]                    # [tn, tw] int32
        scale = s_ref[e, pl.ds(n * tn, tn), pl.ds(c * tg, tg)].astype(jnp.bfloat16)
        scale_w = pl.dot(scale, expand)                                            # [tn, tw] f32
        for k in range(8):
            q = ((words >> (4 * k)) & 15).astype(jnp.float32) - 8.0
            w = (q * scale_w).astype(x_ref.dtype)
            xk = x_ref[k, pl.ds(j * rows, rows), pl.ds(c * tw, tw)]
            acc += pl.dot(xk, w, trans_b=True)
        return acc

    W = w_ref.shape[-1]
    return jax.lax.fori_loop(0, W // tw, chunk, jnp.zeros((rows, tn), jnp.float32))


@functools.partial(jax.jit, static_argnames=("rows", "out_dtype", "interpret"))
def int4_gmm(x_planes, e_J, used, packed, scale, *, rows: int, out_dtype=jnp.float32, interpret: bool = False):
    """``quant_gmm.int4_gmm`` for GPU: [8, J*rows, I/8] planes, [E, O, I/8] words -> [J*rows, O]."""
    _, A, W = x_planes.shape
    E, O, _ = packed.shape
    G = scale.shape[-1]
    tiles = int4_tiles(O, W, G) if W % G == 0 else None
    if tiles is None or A % rows or rows < MIN_ROWS:
        raise ConfigError(f"GPU INT4 grouped matmul: packed {packed.shape}, scale {scale.shape}, {A} rows in "
                          f"blocks of {rows}: expected power-of-two tiles of >= 16 outputs and >= 16 groups, "
                          f"and blocks of >= {MIN_ROWS} rows")
    tn, tw = tiles
    tile = functools.partial(_int4_tile, rows=rows, tn=tn, tw=tw, per_group=W // G)
    return _call(tile, x_planes, e_J, used, packed, scale, rows, tn, out_dtype, interpret)


def _fp8_tile(e, j, n, x_ref, w_ref, s_ref, *, rows, bo, bi):
    def chunk(c, acc):   # one bo x bi block: one scale
        w = w_ref[e, pl.ds(n * bo, bo), pl.ds(c * bi, bi)].astype(jnp.float32) * s_ref[e, n, c]
        xc = x_ref[pl.ds(j * rows, rows), pl.ds(c * bi, bi)]
        return acc + pl.dot(xc, w.astype(x_ref.dtype), trans_b=True)

    I = w_ref.shape[-1]
    return jax.lax.fori_loop(0, I // bi, chunk, jnp.zeros((rows, bo), jnp.float32))


@functools.partial(jax.jit, static_argnames=("rows", "block", "out_dtype", "interpret"))
def fp8_gmm(x_AI, e_J, used, weight, scale_inv, *, rows: int, block=(128, 128), out_dtype=jnp.float32,
            interpret: bool = False):
    """``quant_gmm.fp8_gmm`` for GPU: one program per (block of rows, bo output rows)."""
    A, I = x_AI.shape
    E, O, _ = weight.shape
    bo, bi = block
    if O % bo or I % bi or A % rows or rows < MIN_ROWS or bo & (bo - 1) or bi & (bi - 1):
        raise ConfigError(f"GPU FP8 grouped matmul: weight {weight.shape}, block {block}, {A} rows in blocks "
                          f"of {rows}: expected whole power-of-two blocks and blocks of >= {MIN_ROWS} rows")
    tile = functools.partial(_fp8_tile, rows=rows, bo=bo, bi=bi)
    return _call(tile, x_AI, e_J, used, weight, scale_inv, rows, bo, out_dtype, interpret)
