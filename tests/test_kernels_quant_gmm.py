"""The Pallas grouped matmuls over quantized experts (kernels/quant_gmm.py: Mosaic for TPU,
kernels/quant_gmm_gpu.py: Triton for GPU), run in interpret mode on the CPU, against the exact dequantized reference (models/quantized.py's dequant_int4 /
dequant_fp8, float64 products), for every routing shape the block table produces."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eagle3_jax.kernels import quant_gmm, quant_gmm_gpu
from eagle3_jax.kernels import experts
from eagle3_jax.models.quantized import Fp8Stack, Int4Stack, QuantLayout, dequant_fp8, dequant_int4

RNG = np.random.default_rng(0)


def int4_stack(E, O, I):
    st = Int4Stack(E, O, I, ("expert", None, None), QuantLayout(experts="int4"), None)
    packed = jnp.asarray(RNG.integers(-2 ** 31, 2 ** 31 - 1, size=(E, O, I // 8), dtype=np.int64), jnp.int32)
    scale = jnp.asarray(RNG.uniform(0.01, 0.03, size=(E, O, I // 32)), jnp.bfloat16)
    return packed, scale, st


def fp8_stack(E, O, I):
    st = Fp8Stack(E, O, I, ("expert", None, None), QuantLayout(experts="fp8"), None)
    w = jnp.asarray(RNG.normal(size=(E, O, I)).astype(ml_dtypes.float8_e4m3fn))
    s = jnp.asarray(RNG.uniform(0.005, 0.02, size=(E, O // 128, I // 128)), jnp.float32)
    return w, s, st


def dequantized(values, scales, st):
    """The reference weights [E, O, I] in bfloat16 (each rounded once, as the kernels do), as float64."""
    if isinstance(st, Int4Stack):
        w = dequant_int4(values, scales, values.shape[-1] * 8, st.group, jnp.bfloat16)
    else:
        w = dequant_fp8(values, scales, st.block, jnp.bfloat16)
    return np.asarray(w.astype(jnp.float32), np.float64)


def blocks_oracle(x, e_J, used, w_EOI, rows):
    x = np.asarray(x.astype(jnp.float32), np.float64)
    y = np.zeros((x.shape[0], w_EOI.shape[1]))
    for j in range(int(used)):
        y[j * rows:(j + 1) * rows] = x[j * rows:(j + 1) * rows] @ w_EOI[int(e_J[j])].T
    return y


@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("e_J,used", [([0, 2, 2, 1, 0], 4), ([1, 1, 1], 3), ([0, 0], 0)])
def test_mosaic_gmm_matches_dequantized_reference(kind, e_J, used):
    """Blocks of several experts, one expert taking every block, and no block in use (all zeros)."""
    E, O, I, rows = 3, 256, 256, 8
    values, scales, st = (int4_stack if kind == "int4" else fp8_stack)(E, O, I)
    x = jnp.asarray(RNG.normal(size=(len(e_J) * rows, I)), jnp.bfloat16)
    e = jnp.asarray(e_J, jnp.int32)
    y = quant_gmm.matmul(x, e, jnp.int32(used), values, scales, st, rows, "cpu")   # interpreted
    want = blocks_oracle(x, e, used, dequantized(values, scales, st), rows)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_triton_gmm_matches_dequantized_reference(kind):
    """The GPU kernels' bodies, interpreted: padding blocks zero, several experts, chunks over I."""
    E, O, I, rows = 3, 128, 512, 16
    values, scales, st = (int4_stack if kind == "int4" else fp8_stack)(E, O, I)
    x = jnp.asarray(RNG.normal(size=(4 * rows, I)), jnp.bfloat16)
    e, used = jnp.asarray([2, 0, 2, 1], jnp.int32), 3
    if kind == "int4":
        y = quant_gmm_gpu.int4_gmm(quant_gmm.split_planes(x), e, jnp.int32(used), values, scales, rows=rows,
                                   interpret=True)
    else:
        y = quant_gmm_gpu.fp8_gmm(x, e, jnp.int32(used), values, scales, rows=rows, interpret=True)
    want = blocks_oracle(x, e, used, dequantized(values, scales, st), rows)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def dense_oracle(x_MD, idx_MK, weights_MK, gate, up, down, first):
    """Every token through each chosen local expert with the dequantized weights, float64."""
    wg, wu, wd = (dequantized(*t) for t in (gate, up, down))
    x = np.asarray(x_MD.astype(jnp.float32), np.float64)
    y = np.zeros_like(x)
    for m in range(x.shape[0]):
        for e, w in zip(np.asarray(idx_MK[m]) - first, np.asarray(weights_MK[m])):
            if 0 <= e < wg.shape[0]:
                g, u = wg[e] @ x[m], wu[e] @ x[m]
                y[m] += w * (wd[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def routing(M, E, K, kind):
    if kind == "all_one":    # every token picks the same K experts: each spans several blocks
        idx = np.tile(np.arange(K)[None] * 3 % E, (M, 1))
    else:
        idx = np.argsort(RNG.normal(size=(M, E)), axis=1)[:, :K]
    return jnp.asarray(idx, jnp.int32), jnp.asarray(RNG.uniform(0.1, 1.0, size=(M, K)), jnp.float32)


# (M, E, K, routing, first): decode-sized top-8 of 384 at tiny width, verify-sized, one expert set
# taking all tokens (several blocks each), and a device holding half the experts (the rest are
# non-local: sorted last, padding rows of weight 0).
@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("M,E,K,route,first", [(1, 384, 8, "random", 0), (7, 16, 4, "random", 0),
                                                (24, 8, 2, "all_one", 0), (9, 16, 4, "random", 8)])
def test_grouped_experts_match_dense_oracle(kind, M, E, K, route, first):
    D, F = (128, 128) if kind == "fp8" else (64, 32)
    make = int4_stack if kind == "int4" else fp8_stack
    local = E - first if first else E
    gate, up, down = make(local, F, D), make(local, F, D), make(local, D, F)
    x = jnp.asarray(RNG.normal(size=(M, D)), jnp.bfloat16)
    idx, w = routing(M, E, K, route)
    got = experts.experts_grouped_quantized(x, idx, w, gate, up, down, first, platform="cpu")
    want = dense_oracle(x, idx, w, gate, up, down, first)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    # and the blocked loop, the CPU default, agrees to bf16 rounding
    blocked = experts.experts_blocked_quantized(x, idx, w, gate, up, down, first)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(blocked.astype(jnp.float32)),
                               rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("mesh", [None, "data=1,expert=4,tensor=1"])
def test_int4_target_on_the_grouped_kernel_matches_the_blocked_loop(tiny_target_dir, tmp_path_factory, mesh):
    """A native INT4 checkpoint (packed by compressed-tensors) loaded with ``moe_kernel="grouped"``
    (interpreted on this CPU; inside shard_map with an expert mesh): logits equal the blocked loop's."""
    import eagle3_jax as e3
    from eagle3_jax.models.moe import MoE
    from tests import quant_fixtures

    qdir, _ = quant_fixtures.int4_pair(tiny_target_dir, tmp_path_factory.mktemp("int4_grouped"))
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 5))
    grouped = e3.load_target(qdir, mesh=mesh, moe_kernel="grouped")
    assert {layer.mlp.kernel for layer in grouped.model.layers if isinstance(layer.mlp, MoE)} == {"grouped"}
    blocked = e3.load_target(qdir, mesh=mesh, moe_kernel="blocked")
    got, want = (np.asarray(t.forward(ids).logits) for t in (grouped, blocked))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("block,tpu,gpu", [((128, 128), True, True), ((16, 16), False, True), ((128, 16), False, True)])
def test_fp8_kernel_takes_only_blocks_its_platform_can_tile(block, tpu, gpu):
    """Mosaic tiles a block's last dim by 128 lanes: narrower FP8 blocks run the blocked loop on
    TPU (supports False) and the Triton kernel on GPU, which only needs power-of-two tiles."""
    st = Fp8Stack(4, 256, 256, ("expert", None, None), QuantLayout(experts="fp8", fp8_block=block), None)
    assert quant_gmm.supports(st, 256, 256, "tpu") is tpu
    assert quant_gmm.supports(st, 256, 256, "gpu") is gpu
    assert quant_gmm.supports(st, 256, 256, "cpu") is True   # interpreted: no tiling constraint
