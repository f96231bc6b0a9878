"""tools.doctor on the demo pair: from a config shifted by one layer it names the shipped wiring."""

import json
import shutil
from pathlib import Path

from tools.doctor.__main__ import main
from tools.doctor.core import candidate_wirings

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET, DEMO_DRAFT = REPO / "demo" / "target", REPO / "demo" / "draft"
# Few prompts and tokens: enough to separate the wirings on the demo pair, small enough to stay quick.
# On the 24-layer demo target neighbouring layers are alike: shifted by +1 the shipped ids lose
# little (8 x 32: tau 2.48 against 2.67, 8 x 64: 2.60 against 2.67, within the per-prompt noise);
# shifted by -1, onto layer 0, they lose clearly (2.41 against 2.67 at 8 x 32).
FAST = ["--num-prompts", "8", "--max-new-tokens", "32", "--num-draft-tokens", "3"]


def test_candidates_cover_both_conventions_and_both_engine_defaults():
    names = {w.name: (w.ids, w.skipped) for w in candidate_wirings((2, 30, 58), 61, 3)}
    # Published Kimi ids: vLLM's default equals them, SGLang's default is them shifted by -1.
    assert names == {"configured = vLLM default": ((2, 30, 58), None),
                     "configured -1 = SGLang default": ((1, 29, 57), None),
                     "configured +1": ((3, 31, 59), None)}
    edge = {w.name: w.skipped for w in candidate_wirings((0, 2, 5), 6, 3)}
    assert "outside the target's layers 0..5" in edge["configured -1"]
    assert "outside the target's layers 0..5" in edge["configured +1"]


def test_doctor_names_the_shipped_ids_when_the_config_is_shifted(tmp_path, capsys, monkeypatch):
    """One measurement (the wirings compile one program each, the suite's costliest part here): a
    config shifted by -1 (ids read as "input of layer i", the other convention) gets a report
    naming the shipped ids, in text and in JSON, as "configured +1"."""
    import tools.doctor.core as core

    shipped = json.loads((DEMO_DRAFT / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    shifted = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, shifted)
    cfg = json.loads((shifted / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in shipped]
    (shifted / "config.json").write_text(json.dumps(cfg))

    reports = []
    measure = core.diagnose
    monkeypatch.setattr(core, "diagnose", lambda *a, **kw: reports.append(measure(*a, **kw)) or reports[-1])
    assert main(["--target", str(DEMO_TARGET), "--draft", str(shifted), *FAST]) == 3
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    # [1, 11, 20] is also SGLang's default for 24 layers, so the wiring carries both names
    assert verdict.startswith("verdict: use configured +1") and f"{shipped}:" in verdict, verdict
    assert f"set `eagle_config.eagle_aux_hidden_state_layer_ids` to {shipped}" in out
    fix = json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": shipped, "use_aux_hidden_state": True}})
    assert fix in out
    assert "skipped: ids [-1] outside the target's layers 0..23" in out

    # the --json rendering of the same report (printed by main, not measured again)
    monkeypatch.setattr(core, "diagnose", lambda *a, **kw: reports[0])
    assert main(["--target", str(DEMO_TARGET), "--draft", str(shifted), "--json", *FAST]) == 3
    report = json.loads(capsys.readouterr().out)
    assert not report["configured_is_best"] and report["best_ids"] == shipped and report["within_noise"] is None
    assert report["fix_json"] == json.loads(fix)
    rows = {w["name"].split(" = ")[0]: w for w in report["wirings"]}
    # the shipped ids accept more than either neighbour, prompt by prompt beyond the noise
    assert rows["configured +1"]["tau"] > rows["configured"]["tau"]
    assert rows["configured +1"]["tau"] > rows["vLLM default"]["tau"]
    assert len(rows["configured +1"]["accept_rate_per_position"]) == 3
    assert len(rows["configured +1"]["per_prompt_tau"]) == 8
    assert 0.0 < report["vocab_coverage"] <= 1.0
    assert report["target_dtype"] == report["draft_dtype"] == "bfloat16"
    # the configured wiring still gets tokens accepted (one layer off on 24 is not a collapse)
    assert not report["tau_near_one"] and report["likely_causes"] == []


def test_static_failure_is_reported_without_measuring(tmp_path, capsys):
    bad = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["--target", str(DEMO_TARGET), "--draft", str(bad), *FAST]) == 1
    assert "fc.weight takes 768 inputs" in capsys.readouterr().err


def test_watchdog_names_the_doctor_command_for_this_pair(caplog):
    import logging

    import pytest

    import eagle3_jax as e3
    from eagle3_jax.serve.report import RunStats, Watchdog

    stats = RunStats(4)
    stats.add("length", e3.GenerationStats(rounds=40, tokens=41, round_tokens=41, seconds=0.0,
                                           accepted_per_position=[1, 0, 0, 0]))
    dog = Watchdog(4, context="out.jsonl", pair=("/models/kimi k2.5", "/drafts/eagle3"))
    with pytest.warns(e3.AcceptanceCollapseWarning), caplog.at_level(logging.WARNING, logger="eagle3_jax"):
        assert dog.maybe_check(stats)
    assert "run: python -m tools.doctor --target '/models/kimi k2.5' --draft /drafts/eagle3" in caplog.text


def test_a_gain_within_the_noise_is_not_recommended():
    """Judged prompt by prompt: a steady small gain is recommended, the same mean gain made of one
    lucky prompt is not, and two prompts never decide (README's quick doctor run uses two)."""
    from tools.doctor.core import Wiring, clear_gain

    def wiring(per_prompt):
        return Wiring("w", (0,), tau=float(sum(per_prompt) / len(per_prompt)), per_prompt_tau=list(per_prompt))

    base = wiring([2.5, 2.6, 2.4, 2.5, 2.7, 2.3, 2.5, 2.6])
    assert clear_gain(wiring([x + 0.2 for x in base.per_prompt_tau]), base)
    lucky = wiring([x + (1.6 if i == 0 else 0.0) for i, x in enumerate(base.per_prompt_tau)])
    assert abs((lucky.tau - base.tau) - 0.2) < 1e-9 and not clear_gain(lucky, base)
    assert not clear_gain(wiring([3.3, 3.3]), wiring([3.0, 3.0]))
    assert not clear_gain(wiring([x + 0.04 for x in base.per_prompt_tau]), base)   # below MIN_GAIN
