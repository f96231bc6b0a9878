"""Routed-expert kernels against a dense oracle, route recording, and the GPU default's program shape."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax import sharding
from eagle3_jax.config import TargetConfig
from eagle3_jax.kernels import experts
from eagle3_jax.models import moe
from tests.hf_fixtures import TINY
from tools.demo.routes import capture_routes


def dense_oracle(x_MD, idx_MK, weights_MK, wg, wu, wd, first):
    """Every token through every local expert, weighted by its routing weight (0 when not chosen)."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x_MD, wg, wu, wd))
    y = np.zeros_like(x)
    for m in range(x.shape[0]):
        for e, w in zip(np.asarray(idx_MK[m]) - first, np.asarray(weights_MK[m])):
            if 0 <= e < wg.shape[0]:
                g, u = x[m] @ wg[e], x[m] @ wu[e]
                y[m] += w * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return y


def inputs(M, E, K, D=16, F=8, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    idx_MK = jax.lax.top_k(jax.random.normal(k[0], (M, E)), K)[1].astype(jnp.int32)
    return (jax.random.normal(k[1], (M, D)), idx_MK, jax.random.uniform(k[2], (M, K)),
            jax.random.normal(k[3], (E, D, F)) / 4, jax.random.normal(k[4], (E, D, F)) / 4,
            jax.random.normal(k[0], (E, F, D)) / 3)


# (M, E, K): decode-sized (M*K <= E: about one block per assignment), a verify-sized batch whose
# blocks are padded (7 tokens: 4-row blocks of experts that got 1-3 rows), and bigger (several rows
# per block, several blocks per expert).
@pytest.mark.parametrize("M,E,K", [(2, 16, 4), (7, 16, 4), (16, 8, 2), (5, 8, 8), (40, 16, 4)])
@pytest.mark.parametrize("name", sorted(experts.EXPERT_KERNELS))
def test_kernel_matches_dense_oracle(name, M, E, K):
    x, idx, w, wg, wu, wd = inputs(M, E, K)
    kernel = experts.EXPERT_KERNELS[name]
    np.testing.assert_allclose(kernel(x, idx, w, wg, wu, wd, 0), dense_oracle(x, idx, w, wg, wu, wd, 0),
                               rtol=1e-4, atol=1e-4)
    # Half the experts as another device's: only local experts contribute.
    half = E // 2
    got = kernel(x, idx, w, wg[half:], wu[half:], wd[half:], half)
    np.testing.assert_allclose(got, dense_oracle(x, idx, w, wg[half:], wu[half:], wd[half:], half),
                               rtol=1e-4, atol=1e-4)


def test_blocked_kernel_when_every_token_picks_the_same_experts():
    """The most skewed routing: K experts get all M rows each, so each spans several blocks."""
    M, E, K = 24, 16, 4
    x, _, w, wg, wu, wd = inputs(M, E, K)
    idx = jnp.tile(jnp.array([[3, 9, 0, 14]], jnp.int32), (M, 1))
    np.testing.assert_allclose(experts.experts_blocked(x, idx, w, wg, wu, wd, 0),
                               dense_oracle(x, idx, w, wg, wu, wd, 0), rtol=1e-4, atol=1e-4)


def test_block_rows_follow_the_rows_of_a_hit_expert():
    # Decode: one row per expert hit; verifying 7 tokens over 16 experts (top-4): an expert that is
    # hit holds ~2 rows, so 4-row blocks (one trip per expert), not one trip per row.
    assert experts.block_rows(1, 4, 16) == 1
    assert experts.block_rows(7, 4, 16) == 4
    # Many tokens: the mean rows per expert (64 x 4 / 16 = 16), capped at 256.
    assert experts.block_rows(64, 4, 16) == 16
    assert experts.block_rows(100_000, 8, 384) == 256
    # Never wider than the tokens rounded up to a power of two.
    assert experts.block_rows(3, 8, 8) == 4


def test_padded_blocks_has_ragged_gradients():
    x, idx, w, wg, wu, wd = inputs(12, 8, 2)

    def loss(kernel):
        return lambda x, wg, wu, wd: (kernel(x, idx, w, wg, wu, wd, 0) ** 2).sum()

    want = jax.grad(loss(experts.experts_ragged), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    got = jax.grad(loss(experts.experts_padded_blocks), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_unknown_kernel_is_a_config_error():
    with pytest.raises(e3.ConfigError, match="unknown moe kernel 'nope'.*blocked"):
        moe.MoE(TargetConfig.from_hf_dict(TINY), jnp.float32, None, kernel="nope")


def test_default_kernel_per_backend():
    assert experts.pick(None, "cpu") == "blocked"
    assert experts.pick(None, "gpu") == experts.pick(None, "cuda") == experts.pick(None, "tpu") == "ragged"
    # quantized stacks: the Pallas grouped kernels on TPU and GPU (a float kernel's name means that
    # default), the blocked loop on CPU
    assert experts.pick(None, "tpu", True) == experts.pick("ragged", "cuda", True) == "grouped"
    assert experts.pick(None, "cpu", True) == "blocked"


def test_captured_routes_are_the_routes_of_that_call():
    cfg = TargetConfig.from_hf_dict(TINY)
    layer = moe.MoE(cfg, jnp.float32, nnx.Rngs(0))
    x_BTD = jax.random.normal(jax.random.key(1), (2, 3, cfg.hidden_size))

    def twice(layer, x_BTD):
        return layer(x_BTD) + layer(x_BTD[:1]).sum()

    out, routes = jax.jit(capture_routes(twice))(layer, x_BTD)
    want, _ = moe.route(x_BTD.reshape(6, -1), layer.gate[...], layer.e_score_correction_bias[...], cfg)
    assert [r.shape for r in routes] == [(6, cfg.num_experts_per_tok), (3, cfg.num_experts_per_tok)]
    np.testing.assert_array_equal(routes[0], want)
    np.testing.assert_allclose(out, twice(layer, x_BTD), rtol=1e-6)
    assert not layer.record_routes  # recording was only for that call


def test_gpu_default_moe_exports_without_a_loop_over_experts():
    """The MoE layer, exported for CUDA with the GPU default kernel, has no while loop.

    ``blocked`` would show up as a stablehlo.while (one trip per expert block); the grouped matmul
    must not. The same export with ``blocked`` is the positive control.
    """
    cfg = TargetConfig.from_hf_dict(TINY)

    def exported_text(kernel, T):
        layer = moe.MoE(cfg, jnp.float32, nnx.Rngs(0), kernel=kernel)
        graphdef, state = nnx.split(layer)

        def f(state, x_BTD):
            return nnx.merge(graphdef, state)(x_BTD)

        x = jax.ShapeDtypeStruct((4, T, cfg.hidden_size), jnp.float32)
        exp = jax.export.export(jax.jit(f), platforms=("cuda",))(state, x)
        return exp.mlir_module()

    gpu = experts.pick(None, "gpu")
    for T in (1, 16):  # decode step and a prefill chunk
        text = exported_text(gpu, T)
        assert "ragged_dot" in text or "ragged" in text.lower(), "expected a grouped matmul"
        assert not re.search(r"stablehlo\.while", text), f"loop in the GPU MoE program (T={T})"
    assert re.search(r"stablehlo\.while", exported_text("blocked", 16)), "control: blocked loops"


@pytest.mark.parametrize("experts", ["int4", "fp8"])
def test_tpu_quantized_moe_is_three_kernels_reading_the_stored_stacks(experts):
    """The quantized MoE layer lowered for TPU (explicit platform, on this CPU host) with its TPU
    default: Mosaic kernels, no while loop over expert blocks, and the stacks passed to the
    kernels as stored (no convert, transpose or copy of a [E, out, in] stack anywhere)."""
    from eagle3_jax.models.quantized import QuantLayout

    cfg = TargetConfig.from_hf_dict({**TINY, "hidden_size": 128, "moe_intermediate_size": 128})
    layer = moe.MoE(cfg, jnp.bfloat16, nnx.Rngs(0), quant=QuantLayout(experts=experts), platform="tpu")
    assert layer.kernel == "grouped"
    graphdef, state = nnx.split(layer)

    def f(state, x_BTD):
        return nnx.merge(graphdef, state)(x_BTD)

    x = jax.ShapeDtypeStruct((4, 5, cfg.hidden_size), jnp.bfloat16)
    text = jax.export.export(jax.jit(f), platforms=("tpu",))(state, x).mlir_module()
    assert "tpu_custom_call" in text, "expected the Mosaic grouped-matmul kernels"
    assert not re.search(r"stablehlo\.while", text), "loop in the TPU quantized MoE program"
    E = cfg.n_routed_experts
    stack = r"tensor<%dx\d+x\d+x(i32|f8E4M3FN)>" % E
    for op in ("stablehlo.convert", "stablehlo.transpose", "stablehlo.bitcast_convert", "stablehlo.reshape"):
        bad = [ln for ln in text.splitlines() if op in ln and re.search(r"\(" + stack, ln)]
        assert not bad, f"{op} of a stored expert stack: {bad[:1]}"
    # control: the blocked loop, the CPU default, loops over expert blocks
    blocked = moe.MoE(cfg, jnp.bfloat16, nnx.Rngs(0), quant=QuantLayout(experts=experts), kernel="blocked",
                      platform="tpu")
    g2, s2 = nnx.split(blocked)
    text2 = jax.export.export(jax.jit(lambda st, x: nnx.merge(g2, st)(x)), platforms=("tpu",))(s2, x).mlir_module()
    assert re.search(r"stablehlo\.while", text2)


@pytest.mark.parametrize("experts", ["int4", "fp8"])
def test_cuda_quantized_moe_exports_without_a_loop_over_experts(experts):
    """The quantized MoE layer exported for CUDA with its GPU default: Triton kernels (lowered on
    this CPU host), no while loop whose trips follow the expert blocks."""
    from eagle3_jax.models.quantized import QuantLayout

    cfg = TargetConfig.from_hf_dict({**TINY, "hidden_size": 512, "moe_intermediate_size": 512})
    layer = moe.MoE(cfg, jnp.bfloat16, nnx.Rngs(0), quant=QuantLayout(experts=experts), platform="cuda")
    assert layer.kernel == "grouped"
    graphdef, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((4, 5, cfg.hidden_size), jnp.bfloat16)
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)), platforms=("cuda",),
                             disabled_checks=triton)(state, x).mlir_module()
    assert "xla.gpu.triton" in text, "expected the Triton grouped-matmul kernels"
    assert not re.search(r"stablehlo\.while", text), "loop in the GPU quantized MoE program"


# ---------------------------------------------------------------------- the sharding table
def test_mesh_axes_by_logical_name():
    mesh = e3.make_mesh("data=2,expert=2,tensor=2")
    assert sharding.mesh_axis("batch") == sharding.DATA_AXIS
    assert sharding.mesh_axis("expert") == sharding.EXPERT_AXIS
    assert sharding.axis_size(mesh, "batch") == 2 and sharding.axis_size(None, "batch") == 1
    assert sharding.axis_size(mesh, "seq") == 1
    with pytest.raises(e3.ConfigError, match="'nope' has no rule"):
        sharding.mesh_axis("nope")


def test_two_logical_axes_on_one_mesh_axis_is_an_error():
    with pytest.raises(e3.ConfigError, match=r"'heads' and 'vocab'.*mesh axis 'tensor'"):
        sharding.logical_to_spec(("heads", "vocab"))


def test_uneven_dimension_replicates_and_logs_once(caplog):
    mesh = e3.make_mesh("data=1,expert=1,tensor=8")
    with caplog.at_level(logging.WARNING, logger="eagle3_jax"):
        s1 = sharding.sharding_for(mesh, ("embed", "heads"), (16, 12))
        s2 = sharding.sharding_for(mesh, ("embed", "heads"), (16, 12))
    assert s1.spec == s2.spec == jax.sharding.PartitionSpec(None, None)
    msgs = [r.getMessage() for r in caplog.records if "'heads' of size 12" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "mesh axis 'tensor' of size 8" in msgs[0] and "'data': 1" in msgs[0]
    assert sharding.sharding_for(mesh, ("embed", "heads"), (16, 24)).spec == jax.sharding.PartitionSpec(None, "tensor")


@pytest.mark.parametrize("tensor,takes", [(1, True), (4, False)])
def test_grouped_kernel_is_checked_on_the_shard_each_device_holds(tensor, takes):
    """Expert width 1024 split over tensor=4 leaves 256 inputs of down per device: 32 INT4 words,
    fewer than the Triton kernel's smallest word tile (16 groups of 4 words), though the full
    width's 128 words tile. The shard decides: such a layer runs the blocked loop."""
    from eagle3_jax.models.quantized import QuantLayout

    cfg = TargetConfig.from_hf_dict(dict(TINY, hidden_size=512, moe_intermediate_size=1024, n_routed_experts=8))
    mesh = sharding.make_mesh(f"data=1,expert={8 // tensor},tensor={tensor}")
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, jnp.bfloat16, nnx.Rngs(0), mesh=mesh, kernel="grouped",
                                           quant=QuantLayout(experts="int4"), platform="gpu"))
    assert layer.kernel == ("grouped" if takes else "blocked")
