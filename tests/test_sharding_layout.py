"""The jitted generation program lays out parameters, caches and loop state as sharding.py's table says.

Inspected on the compiled program's own input and output shardings (what XLA will place on each
device), on a (data=2, expert=2, tensor=2) mesh where every mesh axis has more than one device, so
an array left replicated where the table shards it shows up as a missing mesh axis.
"""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.sharding import LOGICAL_AXIS_RULES, logical_to_spec
from eagle3_jax.speculative.generate import DecodeProgram, generate_loop
from eagle3_jax.speculative.session import SamplingSettings
from tests import spec_fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,expert=2,tensor=2"
B, T, CAPACITY, K = 4, 8, 32, 2


def _dims(spec, ndim):
    """A PartitionSpec as a tuple of per-dimension mesh-axis sets."""
    out = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        out.append(frozenset() if entry is None else frozenset(entry if isinstance(entry, tuple) else (entry,)))
    return tuple(out)


@pytest.fixture(scope="module")
def compiled():
    cfg = e3.TargetConfig.from_path(REPO / "configs/models/tiny_deepseek_v3.json")
    mesh = e3.make_mesh(MESH)
    target = e3.build_target(cfg, mesh=mesh)
    draft = e3.build_draft(spec_fixtures.tiny_draft_config(cfg), target)
    with jax.set_mesh(mesh):
        sp = SamplingSettings().traced(8)
        ids = jnp.zeros((B, T), jnp.int32)
        lengths = jnp.full((B,), T, jnp.int32)
        program = generate_loop.lower(
            target.graphdef, target.state, draft.graphdef, draft.state, jnp.asarray(draft.aux_layer_ids), ids,
            lengths, jax.random.key(0), sp, program=DecodeProgram(batch_size=B, max_len=CAPACITY,
                                                                  num_draft_tokens=K)).compile()
    return mesh, target, draft, program


def _param_table(prefix, graph_state, shardings):
    """[(path, axes, shape, compiled sharding)] for every parameter of one model the program reads
    (XLA drops inputs it never reads, such as the draft's t2d map; their sharding is None)."""
    got = {".".join(map(str, p)): v.value for p, v in nnx.to_flat_state(shardings)}
    table = [(prefix + ".".join(map(str, p)), getattr(v, "axes", None), v.value.shape, got[".".join(map(str, p))])
             for p, v in nnx.to_flat_state(graph_state)]
    return [row for row in table if row[3] is not None]


def _params(compiled):
    mesh, target, draft, program = compiled
    (tshard, dshard, *_), _ = program.input_shardings  # static graphdefs are not inputs
    return mesh, _param_table("target.", target.state, tshard) + _param_table("draft.", draft.state, dshard)


def test_every_parameter_is_sharded_as_the_table_says(compiled):
    mesh, params = _params(compiled)
    replicated = []
    for path, axes, shape, sharding in params:
        if axes is None:
            continue
        got = _dims(sharding.spec, len(shape))
        for dim, (logical, size) in enumerate(zip(axes, shape)):
            want = LOGICAL_AXIS_RULES.get(logical) if logical else None
            if dim >= len(logical_to_spec(axes)) or logical_to_spec(axes)[dim] != want:
                want = None  # the mesh axis already shards an earlier dimension of this array
            if want is not None and mesh.shape[want] > 1 and size % mesh.shape[want] == 0:
                if want not in got[dim]:
                    replicated.append(f"{path} dim {dim} ({logical}, {size}) should be on '{want}', is {sharding.spec}")
    assert not replicated, "parameters left replicated where the table shards them:\n" + "\n".join(replicated)


def test_experts_on_expert_heads_and_mlp_on_tensor(compiled):
    mesh, params = _params(compiled)
    by_name = {path: (axes, _dims(s.spec, len(shape))) for path, axes, shape, s in params}
    experts = [p for p, (axes, _) in by_name.items() if axes and axes[0] == "expert"]
    assert experts, "the tiny target has MoE layers; no expert weights found"
    for p in experts:
        axes, dims = by_name[p]
        assert dims[0] == {"expert"}, f"{p}: routed experts must be split over 'expert', got {dims}"
        assert dims[axes.index("moe_mlp")] == {"tensor"}, f"{p}: expert width must be split over 'tensor', got {dims}"
    head_params = [p for p, (axes, _) in by_name.items() if axes and "heads" in axes]
    assert any(p.startswith("target.layers.") and "self_attn" in p for p in head_params)
    assert any(p.startswith("draft.self_attn.") for p in head_params), "the draft's attention has head-sharded weights"
    for p in head_params:
        axes, dims = by_name[p]
        assert dims[axes.index("heads")] == {"tensor"}, f"{p}: attention heads must be split over 'tensor', got {dims}"
    mlp_params = [p for p, (axes, _) in by_name.items() if axes and "mlp" in axes]
    assert mlp_params
    for p in mlp_params:
        axes, dims = by_name[p]
        assert dims[axes.index("mlp")] == {"tensor"}, f"{p}: MLP width must be split over 'tensor', got {dims}"
    for p, vocab in (("target.embed_tokens", "vocab"), ("target.lm_head", "vocab"), ("draft.lm_head", "draft_vocab")):
        axes, dims = by_name[p]
        assert dims[axes.index(vocab)] == {"tensor"}, f"{p}: vocab must be split over 'tensor', got {dims}"


def test_expert_weights_really_split_across_devices(compiled):
    mesh, target, _, _ = compiled
    w = target.state["layers"][1]["mlp"]["w_gate"].value
    # one distinct block per (expert, tensor) pair, each device holding one block
    blocks = {tuple((s.start, s.stop) for s in shard.index) for shard in w.addressable_shards}
    assert len(blocks) == mesh.shape["expert"] * mesh.shape["tensor"]
    assert w.addressable_shards[0].data.nbytes * len(blocks) == w.nbytes


def _out_dims(compiled):
    """Loop-state field -> per-dimension mesh axes of the compiled program's output, and its shape."""
    _, _, _, program = compiled
    name = lambda path: jax.tree_util.keystr(path).lstrip(".")  # noqa: E731
    shapes = {name(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(program.out_info)}
    dims = {name(p): _dims(s.spec, len(shapes[name(p)]))
            for p, s in jax.tree_util.tree_leaves_with_path(program.output_shardings)}
    return dims, shapes


def test_caches_sharded_on_data_expert_and_tensor(compiled):
    # Data-parallel attention: the caches' rows split over data and expert together (B = 4 = 2 x 2).
    dims, shapes = _out_dims(compiled)
    for name in ("tcache.latent_LBSC", "tcache.rope_LBSP"):
        assert dims[name][1] == {"data", "expert"}, f"{name} [L, B, S, C]: rows must be on data x expert, got {dims[name]}"
    for name in ("dcache.k_BSGH", "dcache.v_BSGH"):
        assert dims[name][0] == {"data", "expert"}, f"{name} [B, S, G, H]: rows must be on data x expert, got {dims[name]}"
        assert dims[name][2] == {"tensor"}, f"{name} [B, S, G, H]: kv heads must be on 'tensor', got {dims[name]}"
    # the draft's logits follow its attention's rows (data, with expert where the compiler keeps it)
    assert "data" in dims["dlogits_BW"][0] and dims["dlogits_BW"][1] == {"tensor"}, dims["dlogits_BW"]


def test_emitted_tokens_on_data(compiled):
    dims, _ = _out_dims(compiled)
    assert dims["tokens_BN"][0] == {"data"}, f"tokens_BN: rows must be on 'data', got {dims['tokens_BN']}"


def test_no_row_state_left_replicated(compiled):
    """Every output with a row dimension has it split over 'data'."""
    dims, shapes = _out_dims(compiled)
    bad = []
    for k, d in dims.items():
        row_dim = 1 if k.startswith("tcache.") else 0  # the target cache is [layers, rows, ...]
        if len(shapes[k]) > row_dim and shapes[k][row_dim] == B and "data" not in d[row_dim]:
            bad.append(f"{k} {shapes[k]}: {d}")
    assert not bad, "per-row loop state replicated over 'data':\n" + "\n".join(bad)
