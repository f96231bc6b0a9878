"""``make bench``'s pipeline, on tiny inputs in seconds: a script's printed tables -> JSON -> RESULTS.md.

The benchmarks themselves are not run here (they measure speed; tests never do); a stand-in
script that prints the way they do goes through ``benchmarks/run_all.py``'s own run and render
functions, and every flag run_all passes to a real benchmark is checked to exist in its script.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"


def _load(name: str):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))   # the scripts import _common as a sibling module
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


run_all = _load("run_all")
common = sys.modules["_common"]   # the copy run_all imported

MACHINE = {"cpu": "Test CPU", "cores": 2, "jax": "0.0", "backend": "cpu", "devices": 8, "device_kind": "cpu"}

STAND_IN = f"""
import sys
sys.path.insert(0, {str(BENCH_DIR)!r})
from _common import table
n = int(sys.argv[sys.argv.index("--n") + 1])
print("# stand-in  machine: test, load average 0.0")
print()
print("Tokens per second by batch (higher is better)")
print(table(["batch", "mode", "tok/s", "x target-only"],
            [[b, "EAGLE-3", 100.0 * b, 1.25] for b in range(1, n + 1)]))
print()
print(table(["what", "value"], [["identical", "4/4"]]))
"""


def test_tables_read_back_as_printed():
    headers = ["B", "mode", "tok/s", "ratio"]
    rows = [[1, "target-only", 177.8, 1.0], [8, "K=2", 404.25, 0.0123]]
    text = "# a setup line\nSome title\n" + common.table(headers, rows) + "\n\ntrailing prose\n"
    (t,) = common.read_tables(text)
    assert t["title"] == "Some title" and t["headers"] == headers
    # numbers come back as the numbers table() printed (its rounding), text as text
    assert t["rows"] == [[1, "target-only", 178.0, 1.0], [8, "K=2", 404.0, 0.012]]
    assert common.read_tables("no tables | here\n") == []


def test_run_one_writes_json_and_results_md(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('# started')\nsys.exit('error: the demo pair is missing')\n")
    ok = run_all.Bench("stand_in", str(script), "a stand-in benchmark", quick_args=("--n", "3"))
    bad = run_all.Bench("broken", str(broken), "a benchmark that fails")
    out = tmp_path / "results"

    r = run_all.run_one(ok, quick=True, out_dir=out, machine=MACHINE, commit="abc1234", echo=False)
    saved = json.loads((out / "stand_in.json").read_text())
    assert saved == json.loads(json.dumps(r))
    assert saved["returncode"] == 0 and saved["commit"] == "abc1234" and saved["quick"] is True
    assert saved["command"].endswith("stand_in.py --n 3")
    assert saved["context"] == ["stand-in  machine: test, load average 0.0"]
    first, second = saved["tables"]
    assert first["title"] == "Tokens per second by batch (higher is better)"
    assert [row[0] for row in first["rows"]] == [1, 2, 3] and first["rows"][2][2] == 300.0
    assert second["title"] == "" and second["rows"] == [["identical", "4/4"]]

    f = run_all.run_one(bad, quick=False, out_dir=out, machine=MACHINE, commit="abc1234", echo=False)
    assert f["returncode"] == 1 and "demo pair is missing" in f["stderr_tail"]

    md = run_all.render(out, order=(ok, bad))
    assert md.index("## stand_in") < md.index("## broken")   # the given order, not the file names'
    assert "commit: abc1234" in md and "Test CPU, 2 cores; jax 0.0 on cpu (8 × cpu)" in md
    assert "**--quick**" in md and "**failed** (exit status 1)" in md
    assert "| batch |    mode | tok/s | x target-only |" in md and "|     3 | EAGLE-3 |   300 |          1.25 |" in md


def test_a_benchmark_past_its_time_is_stopped_and_recorded(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('# started', flush=True)\ntime.sleep(60)\n")
    slow = run_all.Bench("slow", str(script), "a benchmark that hangs", timeout_s=1)
    r = run_all.run_one(slow, quick=False, out_dir=tmp_path, machine=MACHINE, commit="abc1234", echo=False)
    assert r["returncode"] == "timeout" and r["seconds"] < 30 and r["context"] == ["started"]
    assert "**failed** (exit status timeout)" in run_all.render(tmp_path)


def test_readme_table_comes_from_the_speedup_json(tmp_path):
    rows = [{"prompts": "demo", "batch": 8, "temperature": 0.0, "mode": m, "tok_s": t, "speedup": x,
             "identical": 16, "num_prompts": 16} for m, t, x in
            [("target-only", 400.0, 1.0), ("K=2", 500.0, 1.25), ("K=4", 560.0, 1.4)]]
    rows.append({"prompts": "demo", "batch": 8, "temperature": 0.0, "mode": "auto", "tok_s": 540.0,
                 "speedup": 1.35, "identical": 15, "num_prompts": 16, "chosen_k": 4})
    rows.append({"prompts": "demo", "batch": 8, "temperature": 1.0, "mode": "target-only", "tok_s": 380.0,
                 "speedup": 1.0, "num_prompts": 16})
    (tmp_path / "speedup.json").write_text(json.dumps(
        {"name": "speedup", "tables": [], "machine": MACHINE, "commit": "abc1234", "date": "2026-12-03 08:00 UTC",
         "command": ".venv/bin/python benchmarks/speedup.py", "data": {"rows": rows}}))
    summary = run_all.speedup_summary(tmp_path)
    (greedy, sampled) = common.read_tables(summary)[0]["rows"]
    assert greedy == ["demo", 8, 0, 400.0, "K=4: 1.40×", "1.35×", 4, "15/16"]   # the worst greedy row counts
    assert sampled[4:] == ["-", "-", "-", "-"]
    assert "commit abc1234" in summary and "2026-12-03 08:00 UTC" in summary

    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results: generated -->\nold table\n<!-- /results -->\nrest\n")
    assert run_all.update_readme(readme, summary)
    text = readme.read_text()
    assert text.startswith("intro\n<!-- results: generated -->\n| prompts |") and text.endswith("<!-- /results -->\nrest\n")
    assert "old table" not in text
    assert not run_all.update_readme(tmp_path / "speedup.json", summary)   # no markers: left alone

    # a P-EAGLE draft beside: its best fixed K gets a column (rows without one show "-")
    rows += [{"prompts": "demo", "batch": 8, "temperature": 0.0, "mode": f"P-EAGLE K={k}", "tok_s": t, "speedup": x,
              "identical": 16, "num_prompts": 16} for k, t, x in [(4, 600.0, 1.5), (8, 580.0, 1.45)]]
    (tmp_path / "speedup.json").write_text(json.dumps(
        {"name": "speedup", "tables": [], "machine": MACHINE, "data": {"rows": rows}}))
    (greedy, sampled) = common.read_tables(run_all.speedup_summary(tmp_path))[0]["rows"]
    assert greedy == ["demo", 8, 0, 400.0, "K=4: 1.40×", "1.35×", 4, "K=4: 1.50×", "15/16"]
    assert sampled[7] == "-"

    # and a DFlash draft too: a column of its own, after P-EAGLE's
    rows += [{"prompts": "demo", "batch": 8, "temperature": 0.0, "mode": f"DFlash K={k}", "tok_s": t, "speedup": x,
              "identical": 16, "num_prompts": 16} for k, t, x in [(2, 520.0, 1.3), (4, 620.0, 1.55)]]
    (tmp_path / "speedup.json").write_text(json.dumps(
        {"name": "speedup", "tables": [], "machine": MACHINE, "data": {"rows": rows}}))
    table_ = common.read_tables(run_all.speedup_summary(tmp_path))[0]
    assert table_["headers"][7:9] == ["P-EAGLE, best fixed K", "DFlash, best fixed K"]
    assert table_["rows"][0] == ["demo", 8, 0, 400.0, "K=4: 1.40×", "1.35×", 4, "K=4: 1.50×", "K=4: 1.55×", "15/16"]


def test_render_without_results(tmp_path):
    assert "No results yet" in run_all.render(tmp_path)


@pytest.mark.parametrize("bench", run_all.BENCHES, ids=[b.name for b in run_all.BENCHES])
def test_flags_passed_exist_in_each_script(bench):
    """run_all passes flags to scripts others edit: each must still be one the script defines."""
    path = REPO / bench.script
    if not path.is_file():
        pytest.skip(f"{bench.script} is not in this checkout")
    source = path.read_text(encoding="utf-8")
    flags = {a for a in bench.args + bench.quick_args if a.startswith("--")} | ({"--json"} if bench.writes_json else set())
    missing = sorted(f for f in flags if not re.search(rf"add_argument\(\s*['\"]{re.escape(f)}['\"]", source))
    assert not missing, f"{bench.script} no longer defines {missing}; update BENCHES in benchmarks/run_all.py"
