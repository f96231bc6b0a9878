"""tools.plan for quantized checkpoints: the runtime row is exactly what load_target allocates,
prefill compiles chunked, and --json writes the rows."""

import json
import pathlib
import subprocess
import sys

import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint.quant_native import layout_from_config
from tests.quant_fixtures import int4_config
from tools.plan import report, serve

REPO = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,expert=2,tensor=2"


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    cfg = json.loads((REPO / "configs/models/tiny_deepseek_v3.json").read_text())
    cfg["quantization_config"] = int4_config()
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_runtime_row_is_what_load_target_allocates(int4_model):
    settings = serve.PlanSettings(model=str(int4_model), mesh=MESH, batch=4, max_len=32, num_draft_tokens=2,
                                  prompt_len=8, dtype="float32", compile_dtype="float32", programs=("prefill",), prefill_chunk=4)
    plan = serve.plan(settings)
    assert plan.quant.experts == "int4" and plan.prefill_chunk == 4
    cfg = e3.TargetConfig.from_path(int4_model)
    real = e3.build_target(cfg, "float32", mesh=MESH, quant=layout_from_config(cfg))
    assert sum(leaf.device_bytes for leaf in plan.target_params) * 8 == real.param_bytes
    per_device_experts = real.param_bytes_by_kind()["routed experts (int4)"] // 8
    assert plan.routed_expert_bytes() == per_device_experts
    row = report.json_mesh(plan, hbm=10**9)["rows"]
    assert len(row) == 1 and row[0]["runtime"] is True and row[0]["weights"] == "int4-experts"
    assert row[0]["programs"]["prefill"]["fits"] is True and row[0]["programs"]["prefill"]["prefill_chunk"] == 4


def test_cli_json(int4_model, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tools.plan", "--model", str(int4_model), "--mesh", MESH, "--batch", "4",
         "--max-len", "32", "--prompt-len", "8", "--programs", "", "--hbm", "1GB", "--json", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "int4-experts (runtime)" in out.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    (mesh,) = doc["meshes"]
    assert mesh["mesh"] == MESH and mesh["rows"][0]["runtime"] is True and mesh["rows"][0]["weights"] == "int4-experts"
