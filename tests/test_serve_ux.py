"""What a user of serve.py sees: throughput without compile time, failed prompts retried, ids
derived from content, metrics for an empty input, help texts, bad command lines (exit 2), the
compute dtype a CPU host gets, and the demo's summary."""

import json
import logging
import re

import pytest

from eagle3_jax.serve import cli
from eagle3_jax.serve.inputs import content_id, read_prompts
from eagle3_jax.serve.output import ResumableOutput, sidecar_path
from tests.serve_fixtures import REPO, ModelCache, byte_target_dir, read_jsonl, serve, write_jsonl


@pytest.fixture(scope="module")
def models(tiny_target):
    return ModelCache(tiny_target, {})


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir, tmp_path_factory):
    return byte_target_dir(tiny_target_dir, tmp_path_factory.mktemp("serve_ux") / "target")


# ---------------------------------------------------------------------- 1: throughput
def test_tokens_per_second_excludes_compiles_across_two_prompt_buckets(tmp_path, models, target_dir, capsys,
                                                                       caplog):
    # Byte tokenizer: prompts under 16 bytes share one bucket, 17-31 bytes the next (a second compile).
    short = [f"s{i}" for i in range(12)]
    long = [f"a longer prompt, number {i:02d}" for i in range(12)]
    rows = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(short[:6] + long + short[6:])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    # Settings no other test uses, so this run compiles its programs. Enough tokens that decoding,
    # not the first execution of each program (a fixed ~0.5 s on CPU), dominates the figure.
    opts = dict(max_new_tokens=200, batch_size=4, max_len=240)
    first, steady = tmp_path / "first.json", tmp_path / "steady.json"
    with caplog.at_level(logging.INFO, logger="eagle3_jax"):
        assert serve(models, target_dir, inp, tmp_path / "a.jsonl", metrics=first, **opts) == 0
    progress = caplog.text
    # stderr is no terminal here: plain lines, no progress bar redrawn with carriage returns
    assert "\r" not in capsys.readouterr().err
    assert serve(models, target_dir, inp, tmp_path / "b.jsonl", metrics=steady, **opts) == 0
    m1, m2 = json.loads(first.read_text()), json.loads(steady.read_text())
    assert m1["tokens"] == m2["tokens"] > 0
    assert m1["compile_seconds"] > 0 and m1["compile_seconds"] > 5 * m2["compile_seconds"]
    assert m1["load_seconds"] >= 0 and m1["tokens_per_second"] == pytest.approx(m1["tokens"] / m1["seconds"])
    # Decode throughput of the compiling run is the steady-state figure, not compile-bound. Had the
    # compiles been counted, the first run's figure would be ~50x lower (here ~40 s of compiling
    # against ~1 s of decoding); the first executions of its programs, which count, and a loaded
    # machine (a full suite on 2 workers measured 0.46) leave it within a few x of the second's.
    timings = [(m["seconds"], m["compile_seconds"], m["load_seconds"]) for m in (m1, m2)]
    if m1["compile_seconds"] <= 5 * m1["seconds"] and m1["compiles"]["from_cache"]:
        # a rerun of the suite: programs loaded from its persistent cache in seconds, too little to
        # tell counted compiles from excluded ones (a fresh clone, as CI runs it, compiles them)
        pytest.skip(f"programs came from the suite's compile cache: {m1['compiles']}")
    assert m1["compile_seconds"] > 5 * m1["seconds"], timings   # the check below can tell the two apart
    assert 0.2 <= m1["tokens_per_second"] / m2["tokens_per_second"] <= 5.0, timings
    assert "compiling prompt bucket 32" in progress and re.search(r"serve: 24/24 prompts, [0-9.]+ tok/s", progress)


# ---------------------------------------------------------------------- 2: failed prompts
def test_failed_prompt_retried_after_raising_max_len(tmp_path, models, target_dir, capsys):
    rows = [{"id": "abc", "prompt": "abc"}, {"id": "hello", "prompt": "hello world"},
            {"id": "long", "prompt": "y" * 40}, {"id": "x", "prompt": "x"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out, metrics = tmp_path / "out.jsonl", tmp_path / "m.json"
    # max_len 32: "long" cannot run; "hello world" (11 tokens) has room for 21 of 24 new tokens.
    assert serve(models, target_dir, inp, out, max_new_tokens=24, max_len=32, metrics=metrics) == 1
    err = capsys.readouterr().err
    assert "1 of 4 prompts failed: 1 prompt too long for max_len" in err and "retries" in err
    m = json.loads(metrics.read_text())
    assert m["errors"] == 1 and m["failures"] == {"prompt too long for max_len": 1}
    first = {r["id"]: r for r in read_jsonl(out)}
    assert first["long"]["finish_reason"].startswith("error: prompt has")
    cut = [k for k, r in first.items() if r["finish_reason"] == "max_len"]
    kept_lines = [line for line in out.read_bytes().splitlines(keepends=True)
                  if json.loads(line)["finish_reason"] in ("eos", "length")]
    assert kept_lines and "hello" in cut
    # Same max_len again: the failure is retried (and fails again); the finished rows stay.
    assert serve(models, target_dir, inp, out, max_new_tokens=24, max_len=32) == 1
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(first)
    # A larger max_len needs no --overwrite: the failed row and the rows cut at the old capacity
    # run again; every other row is kept byte for byte, ahead of the new ones.
    assert serve(models, target_dir, inp, out, max_new_tokens=24, max_len=80) == 0
    assert out.read_bytes().startswith(b"".join(kept_lines))
    final = read_jsonl(out)
    assert sorted(r["id"] for r in final) == sorted(first)   # each id once
    fresh = tmp_path / "fresh.jsonl"
    assert serve(models, target_dir, inp, fresh, max_new_tokens=24, max_len=80) == 0
    assert {r["id"]: r for r in final} == {r["id"]: r for r in read_jsonl(fresh)}
    assert json.loads(open(sidecar_path(str(out))).read())["max_len"] == 80


def test_output_from_before_max_len_left_the_settings_check_resumes(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = [json.dumps({"id": i, "text": "t", "num_tokens": 1, "finish_reason": r}) + "\n"
             for i, r in enumerate(["eos", "error: prompt has 9 tokens, max_len is 8", "max_len", "length"])]
    out.write_text("".join(lines))
    old = {"max_new_tokens": 4, "max_len": 8}
    with open(sidecar_path(str(out)), "w") as f:
        json.dump({"version": 1, "generation": old}, f)
    with ResumableOutput(str(out), {"max_new_tokens": 4}, max_len=8) as o:   # same capacity
        assert o.done == {"0", "2", "3"} and o.retried == {"1"}
    assert out.read_text() == lines[0] + lines[2] + lines[3]
    with ResumableOutput(str(out), {"max_new_tokens": 4}, max_len=16) as o:  # the cut row runs again
        assert o.done == {"0", "3"} and o.retried == {"2"}
        o.append({"id": 2, "text": "u", "num_tokens": 2, "finish_reason": "eos"})
    assert out.read_text().startswith(lines[0] + lines[3])
    assert json.loads(open(sidecar_path(str(out))).read())["max_len"] == 16
    with pytest.raises(Exception, match="max_new_tokens: output has 4, this run has 5"):
        ResumableOutput(str(out), {"max_new_tokens": 5}, max_len=16)


# ---------------------------------------------------------------------- 7: ids
def test_ids_derived_from_content_are_stable_and_repeats_numbered(tmp_path):
    rows = [{"prompt": "alpha"}, {"id": "b", "prompt": "beta"}, {"prompt": "alpha"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}]
    recs, bad = read_prompts(str(write_jsonl(tmp_path / "a.jsonl", rows)))
    assert not bad
    alpha = recs[0].id
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", alpha) and recs[2].id == alpha + "-2" and recs[1].id == "b"
    # the id of a chat is its prompt turns: the trailing assistant turn is what gets regenerated
    assert recs[3].id == content_id(read_prompts(str(write_jsonl(
        tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])))[0][0])
    # inserting lines does not move any id
    inserted, _ = read_prompts(str(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "new"}] + rows[:2] + rows[2:])))
    assert [r.id for r in inserted[1:]] == [r.id for r in recs]


def test_mixing_explicit_and_derived_ids_names_the_collision(tmp_path):
    derived = content_id(read_prompts(str(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])))[0][0])
    _, bad = read_prompts(str(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x"}, {"id": derived, "prompt": "y"},
                                                                 {"id": 7, "prompt": "p"}, {"prompt": "q"}])))
    assert len(bad) == 1 and bad[0].startswith("line 2: ")
    assert "derived from the content of line 1" in bad[0] and "choose another id" in bad[0]
    _, bad = read_prompts(str(write_jsonl(tmp_path / "c.jsonl", [{"id": derived, "prompt": "y"}, {"prompt": "x"}])))
    assert len(bad) == 1 and "is the explicit id of line 1" in bad[0] and "give this line an 'id'" in bad[0]


# ---------------------------------------------------------------------- 8: small things
def test_empty_input_writes_metrics(tmp_path, models, target_dir, capsys):
    inp, metrics = tmp_path / "in.jsonl", tmp_path / "m.json"
    inp.write_text("\n")
    assert serve(models, target_dir, inp, tmp_path / "out.jsonl", metrics=metrics) == 0
    m = json.loads(metrics.read_text())
    assert m["prompts"] == 0 and m["tokens"] == 0 and m["tokens_per_second"] is None


def test_help_texts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "With no arguments at all, runs the embedded demo" in text and "Exit status" in text
    from tools.convert.__main__ import main as convert_main
    from tools.plan.__main__ import main as plan_main

    for main, argv, expected in ((plan_main, ["--help"], "(default:"),
                                 (convert_main, ["inspect", "--help"], "checkpoint directory")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0 and expected in capsys.readouterr().out


def test_bad_command_lines_exit_2_before_any_output(tmp_path, target_dir, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "abc"}])
    out = tmp_path / "out.jsonl"
    cases = [(["--target", str(tmp_path / "no_such_target")], "--target .*no_such_target does not exist"),
             (["--draft", str(tmp_path / "no_such_draft")], "--draft .*no_such_draft does not exist"),
             (["--num-draft-tokens", "-1"], "num_draft_tokens must be 'auto' or a whole number >= 0"),
             (["--num-draft-tokens", "many"], "expected an integer or 'auto', found str 'many'")]
    for extra, message in cases:
        args = ["--target", str(target_dir), "--input", str(inp), "--output", str(out)] + extra
        assert cli.main(args) == 2, extra
        assert re.search(message, capsys.readouterr().err), extra
        assert not out.exists()
    # --no-progress is a flag of serve.py as of train.py
    assert cli.settings_from_argv(["--no-progress"]).no_progress is True


def test_auto_dtype_is_float32_on_a_cpu_host_and_says_why(target_dir):
    from eagle3_jax.config import TargetConfig

    cfg = TargetConfig.from_path(target_dir)
    stored = cli.checkpoint_dtype_name(cfg)
    half = stored if stored in ("bfloat16", "float16") else "bfloat16"
    dtype, note = cli.resolve_dtype_name("auto", cfg, platform="cpu")
    assert dtype == "float32" and (note is None) == (stored == "float32")
    if note:
        assert f"not the checkpoint's {stored}" in note and f"--dtype {stored}" in note
    assert cli.resolve_dtype_name("auto", cfg, platform="tpu") == (stored, None)
    dtype, note = cli.resolve_dtype_name(half, cfg, platform="cpu")   # an explicit choice is kept, with why
    assert dtype == half and "float32 is faster here" in note
    assert cli.resolve_dtype_name("float32", cfg, platform="cpu") == ("float32", None)


def test_demo_summary_says_what_this_run_measured():
    from eagle3_jax.metrics import GenerationStats
    from eagle3_jax.serve import demo

    def mode(rates, rounds):
        stats = GenerationStats(rounds=rounds, tokens=96, round_tokens=96, seconds=1.0,
                                accepted_per_position=[rounds // 2] if rounds < 96 else [],
                                per_row_accept_length=[96 / rounds])
        return demo.ModeRun([[1, 2]], stats, 12.0, rates)

    base, spec = mode([100.0, 80.0, 100.0], 96), mode([120.0, 104.0, 90.0], 40)
    case = demo.Case(8, 0.0, base, spec)
    assert spec.tokens_per_second == 104.0 and base.tokens_per_second == 100.0
    assert demo.ratio(spec, base)[0] == pytest.approx(1.2)   # the median of 1.2, 1.3 and 0.9, not a ratio of medians
    text = demo.table([case], 3) + "\n" + demo.table_notes(3)
    assert "1.20x (0.90-1.30)" in text and "first pass, s" in text and "12 / 12" in text
    assert "median of 3 timed passes" in text and "untimed pass" in text
