"""tools.plan on the tiny config: the bytes it counts agree with each other, with real sharded arrays
and with the compiled program's own argument sizes."""

import math
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import eagle3_jax as e3
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import shard_state
from tools.plan import report, serve

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/models/tiny_deepseek_v3.json")
MESH = "data=2,expert=2,tensor=2"
B, S, K, PROMPT = 4, 32, 2, 8


@pytest.fixture(scope="module")
def plan():
    settings = serve.PlanSettings(model=TINY, mesh=MESH, batch=B, max_len=S, num_draft_tokens=K, prompt_len=PROMPT,
                                 dtype="float32", compile_dtype="float32", expert_bits=(32, 4), programs=("decode",))
    return serve.plan(settings)


def test_sharded_leaves_split_evenly(plan):
    mesh = plan.mesh_shape
    for leaf in plan.target_params + plan.draft_params + plan.state:
        used = [a for entry in leaf.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        assert leaf.shards == math.prod(mesh[a] for a in used), leaf
        assert leaf.device_bytes * leaf.shards == leaf.total_bytes, leaf


def test_param_bytes_match_real_sharded_arrays(plan):
    """Per-device bytes of every parameter equal the buffer a real model, placed on the mesh the way
    the library places loaded weights (shard_state), holds on each device."""
    mesh = e3.make_mesh(MESH)
    _, state = nnx.split(Target(plan.target, jnp.float32, None, mesh=mesh))  # zeros: no random init
    real = {"target." + ".".join(map(str, p)): v.value for p, v in nnx.to_flat_state(shard_state(state, mesh))}
    assert set(real) == {leaf.path for leaf in plan.target_params}
    for leaf in plan.target_params:
        arr = real[leaf.path]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*leaf.spec)), arr.ndim), leaf.path
        assert {shard.data.nbytes for shard in arr.addressable_shards} == {leaf.device_bytes}, leaf.path


def test_experts_split_over_expert_and_tensor(plan):
    mesh = plan.mesh_shape
    experts = [leaf for leaf in plan.target_params if leaf.routed_expert]
    n_moe = sum(plan.target.is_moe_layer(i) for i in range(plan.target.num_hidden_layers))
    assert len(experts) == 3 * n_moe
    total = sum(leaf.total_bytes for leaf in experts)
    assert plan.routed_expert_bytes() == total // (mesh["expert"] * mesh["tensor"])
    assert plan.param_bytes() == sum(leaf.device_bytes for leaf in plan.target_params + plan.draft_params)


def test_int4_experts_are_packed_weights_plus_group_scales(plan):
    numel = sum(leaf.numel_device for leaf in plan.target_params if leaf.routed_expert)
    assert plan.scale_layout(4) == (2, 32)
    assert plan.routed_expert_bytes(4) == numel // 2 + numel // 32 * 2
    others = plan.param_bytes() - plan.routed_expert_bytes()
    assert plan.param_bytes(4) == others + plan.routed_expert_bytes(4)
    assert plan.param_bytes(32) == plan.param_bytes()


def test_cache_bytes(plan):
    cfg, d, mesh = plan.target, plan.draft, plan.mesh_shape
    L, C, P = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # attention's rows split over data x expert where that divides the batch (data-parallel attention)
    rows = mesh["data"] * mesh["expert"] if B % (mesh["data"] * mesh["expert"]) == 0 else mesh["data"]
    assert plan.state_bytes("tcache") == L * B * S * (C + P) * 4 // rows
    kv_split = mesh["tensor"] if d.num_key_value_heads % mesh["tensor"] == 0 else 1
    assert plan.state_bytes("dcache") == 2 * B * S * d.num_key_value_heads * d.head_dim * 4 // (rows * kv_split)


def test_compiled_arguments_are_params_plus_state(plan):
    """XLA's per-device argument size is exactly what the plan counts, less the input the loop never
    reads (the draft's t2d map), plus max_rounds, stop_free, the EOS ids, temperature, top-k, top-p,
    the draft's aux layer ids (4 bytes each) and the greedy flag (1 byte): one program serves greedy
    and sampling, and every wiring of the draft."""
    mem = plan.programs["decode"]
    counted = plan.param_bytes() + plan.state_bytes()
    unread = sum(leaf.device_bytes for leaf in plan.draft_params if leaf.path == "draft.t2d")
    assert unread > 0
    assert mem.argument == counted - unread + 6 * 4 + 4 * len(plan.aux_ids) + 1
    hi, lo = plan.totals("decode")
    assert hi == lo == counted + (mem.output - mem.alias) + mem.temp


def test_donated_loop_state_comes_back_in_place(plan):
    assert plan.programs["decode"].alias == plan.state_bytes()


def test_report_has_one_row_per_expert_width(plan):
    text = report.format_plan(plan, hbm=serve.parse_bytes("1GB"))
    rows = [line for line in text.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 3 and "int4 experts" in rows[2] and "decode yes" in rows[1]


def test_parse_bytes():
    assert serve.parse_bytes("141GB") == 141 * 10**9
    assert serve.parse_bytes("96GiB") == 96 * 2**30
    assert serve.parse_bytes("80e9") == 80 * 10**9
    assert serve.parse_bytes("1000") == 1000
    with pytest.raises(e3.ConfigError):
        serve.parse_bytes("lots")


def test_drafts_chosen_by_target_shape():
    kimi = e3.TargetConfig.from_path(REPO / "configs/models/kimi_k25.json")
    draft, source = serve.choose_draft(kimi)
    assert source.endswith("kimi_k25_eagle3.json") and draft.aux_layer_ids == (2, 30, 58)
    ds, source = serve.choose_draft(e3.TargetConfig.from_path(REPO / "configs/models/deepseek_v3.json"))
    assert source.endswith("deepseek_v3_eagle3.json") and (ds.num_key_value_heads, ds.head_dim) == (8, 128)
    tiny, source = serve.choose_draft(e3.TargetConfig.from_path(TINY))
    assert source.startswith("derived") and tiny.hidden_size == 64


def test_bad_mesh_is_refused():
    with pytest.raises(e3.ConfigError, match="do not split"):
        serve.plan(serve.PlanSettings(model=TINY, mesh="data=1,expert=3,tensor=1", programs=()))


def test_cli_accounting_only():
    """The command line creates its own fake devices and prints the table (no compile: fast)."""
    out = subprocess.run(
        [sys.executable, "-m", "tools.plan", "--model", TINY, "--mesh", MESH, "--batch", "4", "--max-len", "32",
         "--prompt-len", "8", "--programs", "", "--expert-bits", "16,4", "--hbm", "1GB"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "(8 devices)" in out.stdout and "int4 experts" in out.stdout
    assert np.sum([line.startswith("|") for line in out.stdout.splitlines()]) == 4


def _train_split_bytes(leaf) -> int:
    """Per-device bytes of a draft weight under training's split, derived here from the serving
    table's spec on this test's mesh (every axis 2): the largest dimension the table leaves whole is
    split 4 ways over data and expert where 4 divides it, else 2 ways where 2 does."""
    spec = tuple(leaf.spec) + (None,) * (len(leaf.shape) - len(leaf.spec))
    used = {a for s in spec if s for a in (s if isinstance(s, tuple) else (s,))}
    free = [a for a in ("data", "expert") if a not in used]
    shard = list(leaf.shard_shape)
    for n in ([2 ** len(free)] if len(free) > 1 else []) + ([2] if free else []):
        whole = [i for i, s in enumerate(spec) if s is None and leaf.shape[i] % n == 0]
        if whole:
            i = max(whole, key=lambda i: leaf.shape[i])
            shard[i] //= n
            break
    return math.prod(shard) * leaf.itemsize


def test_train_step_plan_offline():
    """The Trainer's jitted step, planned from disk-fed states: AdamW holds two moments per draft
    parameter, and the donated parameters and moments come back in place."""
    p = serve.plan(serve.PlanSettings(model=TINY, mesh=MESH, batch=B, max_len=S, prompt_len=PROMPT, dtype="float32",
                                    compile_dtype="float32", programs=(), train=True, train_batch=2, train_len=16,
                                    ttt_steps=2, hidden_source="offline"))
    t = p.train
    trainable = [leaf for leaf in p.draft_params if leaf.path not in ("draft.d2t", "draft.t2d")]
    weights = sum(_train_split_bytes(leaf) for leaf in trainable)
    # split further than serving's table: data and expert (2 x 2 here) take a dimension it leaves whole
    assert weights < sum(leaf.device_bytes for leaf in trainable)
    assert t.frozen_target == 0 and t.head == 2 * p.target.vocab_size * p.target.hidden_size * 4
    assert 2 * weights <= t.optimizer <= 2 * weights + 64
    assert t.program.alias == weights + t.optimizer
    assert t.program.temp > 0 and t.totals(p.temp_ratio)[0] > t.draft_params + t.optimizer
    # --json carries the same step (a row-length sweep is a loop over --train-len reading it).
    j = report.json_train(p, hbm=10**9)
    assert (j["train_len"], j["hidden_source"], j["optimizer_bytes"]) == (16, "offline", t.optimizer)
    assert j["peak_bytes"] == t.totals(1.0)[0] and j["fits"] is True
