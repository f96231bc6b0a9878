"""benchmarks/gpu_check.sh at tiny sizes on CPU: every step's plumbing runs and writes what it
promises, so the one command waiting for a GPU cannot rot. (Speed is not checked: this is CPU.)"""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = ["rounds", "cmdbuf", "moe", "b1"]


def test_gpu_check_smoke_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one host device, as a GPU host has
    env.update(OUT=str(tmp_path), GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_QUICK="1", GPU_CHECK_STEPS=",".join(STEPS),
               GPU_CHECK_BUDGET_S="3000", PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=3000)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["rounds", "command buffers off", "command buffers on",
                                                     "moe_dispatch", "speedup B=1"]
    assert all(s["status"] == "0" for s in summary["steps"]), summary
    # (a) rounds measured beside the roofline, both positive, the FP8 round's loops accounted
    rounds = json.loads((tmp_path / "round_costs.json").read_text())
    assert {(r["batch"], r["k"]) for r in rounds["rows"]} == {(2, 0), (2, 1)}
    for row in rounds["rows"]:
        assert row["measured_s"] > 0 and row["roofline_s"] > 0 and row["bytes"] > 0
        assert row["ratio"] == row["measured_s"] / row["roofline_s"]
    # the tiny config's rounds are while loops of attention blocks and FP8 tiles, all of them counted
    assert all(row["while_loops"] > 0 for row in rounds["rows"])
    for name in ("cmdbuf_off", "cmdbuf_on"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    # (b) the demo pair end to end: greedy tokens identical to target-only's
    speed = json.loads((tmp_path / "speedup_b1.json").read_text())
    modes = {row["mode"] for row in speed["rows"]}
    assert {"target-only", "K=1", "auto"} <= modes
    assert all(row["identical"] == row["num_prompts"] for row in speed["rows"])
    # (c) the expert kernels' table
    assert "ragged" in (tmp_path / "moe_dispatch.txt").read_text()
    assert "measured / roofline" in (tmp_path / "gpu_check.log").read_text()
