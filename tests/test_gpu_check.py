"""benchmarks/gpu_check.sh at tiny sizes on CPU: every step's plumbing runs and writes what it
promises, so the one command waiting for a GPU cannot rot. (Speed is not checked: this is CPU.)"""

import json
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks/gpu_check.sh"
# The steps this file runs: round costs (a) twice more for command buffers, and the expert kernels
# (c). The demo pair's speedup steps (b) run benchmarks/speedup.py, which takes minutes of compiling
# on CPU; what the script passes it is checked below, flag by flag, like every other script's.
STEPS = ["rounds", "cmdbuf", "moe"]


def script_calls() -> dict[str, set[str]]:
    """benchmarks/<name>.py -> the flags gpu_check.sh passes it (its arrays expanded)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    arrays: dict[str, set[str]] = {}   # every assignment of an array (full and quick sizes)
    for m in re.finditer(r"(\w+)=\(([^)]*)\)", text):
        arrays.setdefault(m.group(1), set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2)))
    calls: dict[str, set[str]] = {}
    for line in text.splitlines():
        for m in re.finditer(r"benchmarks/(\w+)\.py(.*)", line):
            flags = calls.setdefault(m.group(1), set())
            flags |= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2)))
            for name in re.findall(r"\$\{(\w+)\[[@*]\]\}", m.group(2)):
                flags |= arrays.get(name, set())
    return calls


def test_every_flag_gpu_check_passes_exists():
    calls = script_calls()
    assert {"round_costs", "speedup", "moe_dispatch", "quant_decode"} <= calls.keys()
    assert {"--tiny", "--model", "--pair", "--budget-s", "--k", "--batch", "--experts"} <= set().union(*calls.values())
    for name, flags in calls.items():
        source = (REPO / "benchmarks" / f"{name}.py").read_text()
        missing = sorted(f for f in flags if not re.search(rf"add_argument\(\s*['\"]{re.escape(f)}['\"]", source))
        assert not missing, f"gpu_check.sh passes benchmarks/{name}.py flags it no longer defines: {missing}"


def test_gpu_check_smoke_on_cpu(tmp_path):
    from tests.conftest import suite_cache_env

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one host device, as a GPU host has
    # The suite's compile cache: on CPU the command buffer runs are the rounds step's K = 0 programs
    # again (no flag to flip), so they load them instead of compiling them twice more.
    env.update(suite_cache_env())
    env.update(OUT=str(tmp_path), GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_QUICK="1", GPU_CHECK_STEPS=",".join(STEPS),
               GPU_CHECK_BUDGET_S="3000", PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=3000)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["rounds", "command buffers off", "command buffers on",
                                                     "moe_dispatch"]
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
    # (c) the expert kernels' table
    assert "ragged" in (tmp_path / "moe_dispatch.txt").read_text()
    assert "measured / roofline" in (tmp_path / "gpu_check.log").read_text()
