"""The roofline planner (tools/plan/roofline.py, uncounted.py, rounds.py, speedup.py): HLO reading,
the routing model, interpolation, acceptance, and on the TPU compiler (tiny config, INT4 experts)
the speedup table end to end with its per-layer extrapolation checked against a deeper compile."""

import dataclasses
import json
import math
import pathlib

import jax
import pytest

from eagle3_jax.models.attention_core import key_block
from eagle3_jax.backends import libtpu_installed
from tools.plan import rounds, speedup, uncounted
from tools.plan.roofline import CHIPS, UNIFORM, ZIPF, Routing, experts_touched, hlo_costs, roofline_seconds

REPO = pathlib.Path(__file__).resolve().parents[1]

HLO = """
ENTRY %main {
  %p = bf16[16,64]{1,0} parameter(0)
  %psum.1 = bf16[16,64]{1,0:T(8,128)(2,1)} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ag = (bf16[4,64]{1,0}, bf16[16,64]{1,0}) all-gather-start(%x), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = bf16[16,64]{1,0} all-gather-done(%ag)
  %int4_gmm.9 = f32[64,32]{1,0:T(8,128)} custom-call(%a, %b), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"300"}}}
  %fp8_gmm.2 = f32[64,32]{1,0} custom-call(%a, %b), custom_call_target="tpu_custom_call", backend_config={\\"cost_estimate\\":{\\"flops\\":\\"24\\",\\"bytes_accessed\\":\\"6\\"}}
  %while.3 = (s32[], f32[4]) while(%t), condition=%c, body=%b
  ROOT %r = bf16[16,64]{1,0} add(%psum.1, %agd)
}
"""


def test_hlo_costs_reads_collectives_kernels_and_loops():
    c = hlo_costs(HLO)
    size = 16 * 64 * 2
    # all-reduce over 8: 2 * 7/8 of its bytes; async all-gather over groups of 4: 3/4 of its result
    assert c.collective_bytes == pytest.approx(2 * 7 / 8 * size + 3 / 4 * size)
    assert c.collectives == 2
    assert (c.kernels, c.kernel_flops, c.kernel_bytes) == (2, 1024.0, 306.0)
    assert c.while_loops == 1


def test_roofline_is_the_larger_of_memory_and_compute_plus_links():
    chip = CHIPS["v5p"]
    assert roofline_seconds(chip.hbm_bytes_per_s, 0, 0, chip) == pytest.approx(1.0)
    assert roofline_seconds(1.0, 2 * chip.flops_per_s, chip.ici_bytes_per_s, chip) == pytest.approx(3.0)


def test_uniform_routing_matches_the_closed_form():
    touched, rows = experts_touched(160, 384, 8, 16, UNIFORM)
    assert touched == pytest.approx(24 * (1 - (1 - 8 / 384) ** 160))
    assert rows == pytest.approx(160 * 8 / 16)
    assert experts_touched(10 ** 6, 384, 8, 16)[0] == pytest.approx(24)


def test_skewed_routing_picks_k_per_token_and_loads_one_chip_more():
    p = ZIPF.pick_probabilities(384, 8)
    assert sum(p) == pytest.approx(8, rel=1e-6) and max(p) <= 1.0 and p == sorted(p, reverse=True)
    for tokens in (1, 8, 160, 4096):
        t_u, r_u = experts_touched(tokens, 384, 8, 16, UNIFORM)
        t_z, r_z = experts_touched(tokens, 384, 8, 16, ZIPF)
        assert r_z > r_u   # the chip holding the hottest experts computes more rows
    # ... and, once tokens are many, reads fewer distinct experts than uniform routing spreads over
    assert experts_touched(160, 384, 8, 16, ZIPF)[0] < experts_touched(160, 384, 8, 16, UNIFORM)[0]
    assert Routing("flat", 0.0).pick_probabilities(4, 2) == [0.5] * 4


def test_geometric_acceptance_reproduces_the_published_tau():
    for tau3 in (2.69, 3.34):
        acc = speedup.geometric("x", "y", tau3)
        assert acc.tau(3) == pytest.approx(tau3, abs=1e-6)
        assert acc.tau(0) == 1.0 and acc.tau(6) > acc.tau(3)
    demo = [a for a in speedup.acceptances() if a.name == "demo pair"][0]
    assert demo.tau(2) == pytest.approx(1 + 0.82 + 0.70)


def test_interpolation_is_exact_on_affine_costs():
    def cost(b, k):
        return rounds.Counted(flops=3.0 * b * (k + 1) + 7, bytes=5.0 * b + 11 * k + 2, collective_bytes=b,
                              argument_bytes=1.0)
    table = {(b, k): cost(b, k) for b in (1, 32, 128) for k in (0, 1, 6)}
    for b, k in [(8, 3), (64, 5), (32, 2), (8, 0)]:
        got, want = rounds.interpolate(table, b, k), cost(b, k)
        assert got.bytes == pytest.approx(want.bytes) and got.collective_bytes == pytest.approx(want.collective_bytes)
    # flops are bilinear (b x K): exact along each compiled line, bounded between them
    assert rounds.interpolate(table, 32, 3).flops == pytest.approx(cost(32, 3).flops)


def test_speedup_compiles_every_listed_batch_unless_told():
    assert speedup.grid_from("1,8,32,128", 2048, 8192, None).compile_batches == (1, 8, 32, 128)
    assert speedup.grid_from("1,8,32,128", 2048, 8192, "1,128").compile_batches == (1, 128)


def test_attention_trips_after_the_first_are_added():
    rows, tokens, heads, cap = 4, 5, 8, 4096
    kb = key_block(cap, tokens, heads)
    assert kb < cap
    b, f = uncounted.attention_extra(rows, tokens, heads, cap, 3 * kb + 1, slot_bytes=10, width=16, flops_per_slot=3)
    step = rows * kb * 10 + 2 * 4 * rows * tokens * heads * 18
    assert b == 3 * step and f == 3 * 2 * rows * tokens * heads * kb * 3
    assert uncounted.attention_extra(rows, tokens, heads, kb, kb, 10, 16, 3) == (0.0, 0.0)   # no loop


TINY = json.loads((REPO / "configs/models/tiny_deepseek_v3.json").read_text())


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_installed(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_speedup_table_on_the_tpu_compiler(tmp_path):
    """Tiny DeepSeek-V3 shape with INT4 experts on v5p:2x2x2: the table is complete, rounds cost
    more as K grows, the K table names a K per batch, and the per-layer extrapolation from the 2-
    and 3-layer cuts lands within 5 % of the 4-layer compile."""
    from tests.quant_fixtures import int4_config
    from tools.plan import serve

    model = tmp_path / "tiny_int4.json"
    model.write_text(json.dumps(dict(TINY, quantization_config=int4_config())))
    settings = serve.PlanSettings(model=str(model), mesh="data=1,expert=8,tensor=1", platform="tpu",
                                  topology="v5p:2x2x2")
    grid = rounds.GridSettings(batches=(2, 4), ks=(0, 1, 2), compile_batches=(4,), compile_ks=(0, 2),
                               step_batches=(), context=300, capacity=512)
    with jax.default_matmul_precision("default"):
        full = rounds.full_depth(settings, grid, log=lambda m: None)
        deep = rounds.compile_cut(settings, 4, [(4, 2)], grid, log=lambda m: None)[4, 2][1]
    lines, obj = speedup.report(str(model), settings, grid, full, CHIPS["v5p"], 1, None)
    assert obj["schema"] == speedup.SCHEMA and set(obj["k_by_batch"]) == {"2", "4"}
    assert all(k in grid.ks for k in obj["k_by_batch"].values())
    table = obj["tables"][0]
    t = {(r["batch"], r["k"]): r["seconds"] for r in table["rounds"]}
    assert all(t[b, 0] < t[b, 1] < t[b, 2] for b in grid.batches)
    assert all(x > 0 and math.isfinite(x) for x in t.values())
    assert any("predicted speedup" in line for line in lines)
    assert all(p["hlo"]["kernels"] > 0 for p in obj["compiled"]["programs"])   # INT4 expert kernels found
    # per-layer extrapolation from the 2- and 3-layer cuts against the 4-layer compile
    est = full["cells"][4, 2]
    assert est.flops == pytest.approx(deep.flops, rel=0.05) and est.bytes == pytest.approx(deep.bytes, rel=0.05)


def synthetic_full():
    """Full-depth counted costs shaped like a memory-bound MoE decode: weights read once a round,
    draft weights once per draft pass, a per-row cache read; one MoE layer of 64 experts."""
    def cell(b, k):
        return rounds.Counted(flops=2e9 * b * (k + 1), bytes=10e9 + 0.3e9 * k + 0.02e9 * b * (1 + 0.1 * k),
                              collective_bytes=1e6 * b * (k + 1), argument_bytes=50e9 + 0.2e9 * b)
    experts = uncounted.ExpertLayer(expert_bytes=20e6, row_flops=1e8, row_bytes=1e4, n_experts=64, top_k=4, groups=8)
    cells = {(b, k): cell(b, k) for b in (1, 128) for k in (0, 1, 6)}
    return {"cells": cells, "cuts": (2, 3), "layers": 10, "moe_layers": 9, "experts": experts, "compiled": {}}


def test_report_on_synthetic_costs_names_a_best_k_per_batch():
    from tools.plan.serve import PlanSettings

    grid = rounds.GridSettings(compile_batches=(1, 128), step_batches=(64, 256))
    settings = PlanSettings(model="m.json", mesh="data=1,expert=8,tensor=1", platform="tpu", topology="v5p:2x2x2")
    lines, obj = speedup.report("m.json", settings, grid, synthetic_full(), CHIPS["v5p"], 1, hbm=70e9)
    json.dumps(obj)   # serializable as it is
    assert obj["k_by_batch"].keys() == {"1", "8", "32", "128"}
    for table in obj["tables"]:
        rows = {(r["batch"], r["k"]): r for r in table["rounds"]}
        assert {(b, 0) for b in (64, 256)} <= rows.keys()
        for acc in table["acceptances"]:
            for b, best in acc["best"].items():
                per_k = acc["speedup"][b]
                assert best["speedup"] == max(per_k) and per_k[best["k"]] == best["speedup"]
                assert per_k[0] == 1.0
        # more tokens per round read more experts: rounds cost more as K grows at every batch
        assert all(rows[b, k]["seconds"] < rows[b, k + 1]["seconds"] for b in grid.batches for k in range(6))
        regen = {r["batch"]: r for r in table["regeneration"]}
        assert regen.keys() == {32, 64, 128, 256}
        assert regen[256]["tokens_per_s"] > regen[32]["tokens_per_s"]
    assert any("does not fit" in line for line in lines)   # 50 GB + 0.2 GB a row passes 70 GB by 128 rows


def test_round_store_keeps_what_was_compiled(tmp_path):
    from tools.plan.roofline import HloCosts
    from tools.plan.serve import PlanSettings

    path = str(tmp_path / "rounds.json")
    s = PlanSettings(model="m.json", mesh="data=1,expert=8,tensor=1", platform="tpu", topology="v5p:2x2x2")
    grid = rounds.GridSettings()
    rc = rounds.RoundCost(batch=8, k=3, layers=2, flops=1.0, bytes_accessed=2.0, hlo=HloCosts(collective_bytes=3.0),
                          compile_s=4.0, argument_bytes=5, temp_bytes=6)
    key = rounds.Store.key(s, 2, 8, 3, grid)
    rounds.Store(path).put(key, rc)
    again = rounds.Store(path)
    assert again.get(key) == rc
    assert again.get(rounds.Store.key(s, 3, 8, 3, grid)) is None   # another cut is another program
    other = dataclasses.replace(grid, capacity=grid.capacity * 2)
    assert again.get(rounds.Store.key(s, 2, 8, 3, other)) is None   # another capacity too
