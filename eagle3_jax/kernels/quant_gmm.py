"""Grouped matmul over quantized expert stacks, dequantizing one weight tile at a time in the kernel.

The rows come in J blocks of ``rows`` rows, block j belonging to expert ``e_J[j]`` (the block table
of ``kernels/experts.py``); the first ``used`` blocks hold rows, the rest are padding that the kernel
skips (zeros, and their weight indices repeat the last used block's, so no weights are fetched).

  * INT4 (``packed`` int32 [E, O, I/8], ``scale`` [E, O, I/group]): rather than interleave the
    nibbles back into columns (a relayout of every word), the activations come split into the same
    eight planes, ``x_planes[k, a, w] = x[a, 8 w + k]``, and the kernel sums
    ``x_planes[k] @ ((word >> 4k & 15) - 8) * scale`` over k.
  * FP8 (``weight`` float8_e4m3fn [E, O, I], ``scale_inv`` float32 [E, O/bo, I/bi]): tiles of bo
    output rows and bi-column chunks, each chunk times its block's scale, read from SMEM.

Each dequantized weight is rounded once to the activations' dtype, as ``models/quantized.py``'s
reference does; products accumulate in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from eagle3_jax.errors import ConfigError

_NT = (((1,), (1,)), ((), ()))   # contract the last dims of both: x [r, i] . w [o, i] -> [r, o]
_TN = (((0,), (0,)), ((), ()))   # contract the first dims of both: s [g, o] . e [g, w] -> [o, w]
# The MXU's own precision for the weight matmuls, whatever jax_default_matmul_precision says: Mosaic
# refuses bf16 operands at a float32 contract precision ("highest", which the test suite sets).
_MXU = jax.lax.Precision.DEFAULT


def out_tile(O: int, prefer: tuple[int, ...] = (512, 256, 128)) -> int:
    """Output features per kernel tile: the largest preferred size dividing ``O``, else all of O."""
    return next((t for t in prefer if O % t == 0), O)


def split_planes(x_AI: jax.Array) -> jax.Array:
    """[A, I] -> [8, A, I/8]: plane k holds input columns k, k + 8, ... (nibble k of each word)."""
    A, I = x_AI.shape
    if I % 8:
        raise ConfigError(f"INT4 grouped matmul: input width {I} is not whole int32 words (8 columns); "
                          "expected a multiple of 8")
    return jnp.transpose(x_AI.reshape(A, I // 8, 8), (2, 0, 1))


def _clamped(j, used_ref):
    """Block j, or the last used block for padding blocks (so their inputs are not fetched again)."""
    return jnp.minimum(j, jnp.maximum(used_ref[0] - 1, 0))


def _int4_kernel(e_ref, used_ref, x_ref, w_ref, s_ref, o_ref):
    j = pl.program_id(0)

    @pl.when(j < used_ref[0])
    def _compute():
        words = w_ref[...]                                   # [tn, W] int32, as stored
        scale_GN = s_ref[...].astype(jnp.float32)            # [G, tn]: group-major, see int4_gmm
        G, W = scale_GN.shape[0], words.shape[-1]
        per_group = W // G
        # expand[g, w] = 1 where word w lies in group g: scale per word by a matmul, exact
        # (lax.div, not //: floor division of signed ints lowers through sign, which Mosaic's
        # lowering resolves against the default device, a CPU on a compile-only host)
        expand = (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (G, W), 1), jnp.int32(per_group))
                  == jax.lax.broadcasted_iota(jnp.int32, (G, W), 0)).astype(jnp.float32)
        scale_w = jax.lax.dot_general(scale_GN, expand, _TN, precision=jax.lax.Precision.HIGHEST,
                                      preferred_element_type=jnp.float32)   # [tn, W]
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        for k in range(8):
            q = (jax.lax.shift_right_logical(words, jnp.int32(4 * k)) & 15).astype(jnp.float32) - 8.0
            w = (q * scale_w).astype(x_ref.dtype)
            acc += jax.lax.dot_general(x_ref[k], w, _NT, precision=_MXU, preferred_element_type=jnp.float32)
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(j >= used_ref[0])
    def _padding():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows", "out_dtype", "interpret"))
def int4_gmm(x_planes, e_J, used, packed, scale, *, rows: int, out_dtype=jnp.float32, interpret: bool = False):
    """``y[a] = x[a] @ W[e(a)].T`` for INT4 stacks; ``x_planes`` from ``split_planes`` ([8, J*rows, I/8]),
    ``packed`` [E, O, I/8] int32, ``scale`` [E, O, I/group]. Returns [J*rows, O] in ``out_dtype``."""
    _, A, W = x_planes.shape
    E, O, Wp = packed.shape
    G = scale.shape[-1]
    if Wp != W or W % G or A % rows:
        raise ConfigError(f"INT4 grouped matmul: expected packed [E, O, {W}] words with whole groups and "
                          f"{rows}-row blocks; found packed {packed.shape}, scale {scale.shape}, {A} rows")
    tn = out_tile(O)
    J = A // rows
    # The kernel reads the scales group-major, [E, G, O]: for a narrow last dim (G = I/32) the TPU's
    # default HBM layout already puts O innermost, so this swap is free, where [E, O, G] blocks
    # made the compiler relayout every scale stack ahead of the decode loop.
    scale_EGO = jnp.swapaxes(scale, 1, 2)

    def x_map(j, n, e_ref, used_ref):
        return 0, _clamped(j, used_ref), 0

    def w_map(j, n, e_ref, used_ref):
        return e_ref[_clamped(j, used_ref)], n, 0

    def s_map(j, n, e_ref, used_ref):
        return e_ref[_clamped(j, used_ref)], 0, n

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(J, O // tn),
        in_specs=[pl.BlockSpec((8, rows, W), x_map),
                  pl.BlockSpec((None, tn, W), w_map),
                  pl.BlockSpec((None, G, tn), s_map)],
        out_specs=pl.BlockSpec((rows, tn), lambda j, n, e_ref, used_ref: (j, n)),
    )
    cost = pl.CostEstimate(flops=2 * A * O * 8 * W, transcendentals=0,
                           bytes_accessed=x_planes.size * x_planes.dtype.itemsize * (O // tn)
                           + J * O * (W * 4 + G * scale.dtype.itemsize) + A * O * jnp.dtype(out_dtype).itemsize)
    return pl.pallas_call(
        _int4_kernel,
        out_shape=jax.ShapeDtypeStruct((A, O), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=interpret,
    )(e_J.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x_planes, packed, scale_EGO)


def _fp8_kernel(e_ref, used_ref, x_ref, w_ref, s_ref, o_ref, acc_ref, *, block):
    j, n, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bo, bi = block
    tk = w_ref.shape[-1]

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j < used_ref[0])
    def _compute():
        acc = acc_ref[...]
        for c in range(tk // bi):     # tn == bo: one scale per bi-column chunk of the tile
            s = s_ref[n, k * (tk // bi) + c]
            w = (w_ref[:, c * bi:(c + 1) * bi].astype(jnp.float32) * s).astype(x_ref.dtype)
            acc += jax.lax.dot_general(x_ref[:, c * bi:(c + 1) * bi], w, _NT, precision=_MXU,
                                       preferred_element_type=jnp.float32)
        acc_ref[...] = acc

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows", "block", "out_dtype", "interpret", "tile_in"))
def fp8_gmm(x_AI, e_J, used, weight, scale_inv, *, rows: int, block=(128, 128), out_dtype=jnp.float32,
            interpret: bool = False, tile_in: int = 512):
    """``y[a] = x[a] @ W[e(a)].T`` for block-scaled FP8 stacks: ``weight`` [E, O, I] float8,
    ``scale_inv`` [E, ceil(O/bo), ceil(I/bi)] float32. Returns [J*rows, O] in ``out_dtype``."""
    A, I = x_AI.shape
    E, O, Iw = weight.shape
    bo, bi = block
    if Iw != I or O % bo or I % bi or A % rows:
        raise ConfigError(f"FP8 grouped matmul: expected weight [E, O, {I}] of whole {bo}x{bi} blocks and "
                          f"{rows}-row blocks; found weight {weight.shape}, {A} rows")
    tn = bo
    tk = next((t for t in range(min(tile_in, I) // bi * bi, 0, -bi) if I % t == 0), I)
    J = A // rows

    def x_map(j, n, k, e_ref, used_ref):
        return _clamped(j, used_ref), k

    def w_map(j, n, k, e_ref, used_ref):
        return e_ref[_clamped(j, used_ref)], n, k

    def s_map(j, n, k, e_ref, used_ref):
        return e_ref[_clamped(j, used_ref)], 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(J, O // tn, I // tk),
        in_specs=[pl.BlockSpec((rows, tk), x_map),
                  pl.BlockSpec((None, tn, tk), w_map),
                  pl.BlockSpec((None, *scale_inv.shape[1:]), s_map, memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((rows, tn), lambda j, n, k, e_ref, used_ref: (j, n)),
        scratch_shapes=[pltpu.VMEM((rows, tn), jnp.float32)],
    )
    cost = pl.CostEstimate(flops=2 * A * O * I, transcendentals=0,
                           bytes_accessed=x_AI.size * x_AI.dtype.itemsize * (O // tn) + J * O * I
                           + A * O * jnp.dtype(out_dtype).itemsize)
    return pl.pallas_call(
        functools.partial(_fp8_kernel, block=(bo, bi)),
        out_shape=jax.ShapeDtypeStruct((A, O), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(e_J.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x_AI, weight, scale_inv)


def kernel_platform(platform: str) -> str:
    """"tpu" (Mosaic), "gpu" (Triton) or "interpret" (the Mosaic kernels interpreted: CPU checks)."""
    if platform == "tpu":
        return "tpu"
    return "gpu" if platform in ("gpu", "cuda", "rocm") else "interpret"


def min_rows(platform: str) -> int:
    """Rows per expert block: whole 8-row sublanes on TPU; Triton's dot wants >= 16 per side."""
    from eagle3_jax.kernels import quant_gmm_gpu

    return quant_gmm_gpu.MIN_ROWS if kernel_platform(platform) == "gpu" else 8


def supports(stack, out: int, cols: int, platform: str) -> bool:
    """Whether the kernels for ``platform`` take the ``Int4Stack`` / ``Fp8Stack`` of ``out`` x ``cols``
    matrices: INT4 groups of whole words; FP8 whole blocks, on GPU of powers of two (Triton's dot),
    on TPU of whole 128-lane tiles."""
    from eagle3_jax.kernels import quant_gmm_gpu

    gpu = kernel_platform(platform) == "gpu"
    if hasattr(stack, "group"):
        if stack.group % 8 or cols % stack.group:
            return False
        return not gpu or quant_gmm_gpu.int4_tiles(out, cols // 8, cols // stack.group) is not None
    bo, bi = stack.block
    pow2 = not (bo & (bo - 1) or bi & (bi - 1))
    # Mosaic tiles the last dim of every block by 128 lanes: output tiles are bo wide, input chunks bi.
    lanes = bo % 128 == 0 and bi % 128 == 0
    return cols % bi == 0 and out % bo == 0 and (pow2 or not gpu) and (lanes or kernel_platform(platform) != "tpu")


def matmul(x_AI: jax.Array, e_J, used, values, scales, stack, rows: int, platform: str) -> jax.Array:
    """One grouped matmul ``x_AI @ W[e].T`` over a quantized stack, float32 result [A, O]."""
    from eagle3_jax.kernels import quant_gmm_gpu

    where = kernel_platform(platform)
    if where == "gpu":
        if hasattr(stack, "group"):
            return quant_gmm_gpu.int4_gmm(split_planes(x_AI), e_J, used, values, scales, rows=rows)
        return quant_gmm_gpu.fp8_gmm(x_AI, e_J, used, values, scales, rows=rows, block=tuple(stack.block))
    interpret = where == "interpret"
    if hasattr(stack, "group"):
        return int4_gmm(split_planes(x_AI), e_J, used, values, scales, rows=rows, interpret=interpret)
    return fp8_gmm(x_AI, e_J, used, values, scales, rows=rows, block=tuple(stack.block), interpret=interpret)


def expert_ffn(x_AD: jax.Array, e_J, used, gate, up, down, rows: int, platform: str = "tpu") -> jax.Array:
    """SwiGLU experts ``down(silu(gate x) * up x)`` over rows in expert blocks, each weight a
    (values, scales, container) triple [E, out, in]; [A, D] in x's dtype, rows past ``used`` 0."""
    g_AF = matmul(x_AD, e_J, used, *gate, rows, platform)
    u_AF = matmul(x_AD, e_J, used, *up, rows, platform)
    h_AF = (jax.nn.silu(g_AF) * u_AF).astype(x_AD.dtype)
    return matmul(h_AF, e_J, used, *down, rows, platform).astype(x_AD.dtype)
