"""serve.py end to end (in-process, on the session's tiny target + trained draft, byte tokenizer or a
tokenizer built here): outputs equal target-only generation, refill batching equals one-at-a-time,
resume, settings protection, bad input, the no-target message, config files, the watchdog."""

import json
import logging
import re

import pytest

import eagle3_jax as e3
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import WATCHDOG_TAU
from eagle3_jax.serve import cli
from eagle3_jax.serve.inputs import content_id, read_prompts
from eagle3_jax.serve.output import ResumableOutput, sidecar_path
from eagle3_jax.metrics import GenerationStats
from eagle3_jax.serve.report import RunStats, Watchdog
from eagle3_jax.tokenizer import load_tokenizer
from tests.serve_fixtures import (COMMON, REPO, ModelCache, byte_target_dir, expected_text_records, model_dir_with_files,
                                  prompt_rows, read_jsonl, serve, word_level_tokenizer_files, write_jsonl)


@pytest.fixture(scope="module")
def models(tiny_target, trained_draft_dir):
    return ModelCache(tiny_target, {str(trained_draft_dir): e3.load_draft(trained_draft_dir, tiny_target)})


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target (byte tokenizer) with stop ids 1, 254, 255."""
    return byte_target_dir(tiny_target_dir, tmp_path_factory.mktemp("serve") / "target")


@pytest.fixture(scope="module")
def expected_tokens():
    return {}


@pytest.fixture(scope="module")
def expected(tiny_target, target_dir, expected_tokens):
    """Target-only greedy results, one prompt at a time: what every serve run must reproduce."""
    return expected_text_records(tiny_target, target_dir, prompt_rows(), tokens=expected_tokens)


def check_matches(records, expected):
    assert [r["id"] for r in records].count(records[0]["id"]) == 1
    assert sorted((r["id"] for r in records), key=str) == sorted(expected, key=str)
    for r in records:
        assert (r["text"], r["num_tokens"], r["finish_reason"]) == expected[r["id"]], r["id"]


def test_end_to_end_matches_target_only(tmp_path, models, tiny_target, target_dir, trained_draft_dir,
                                        expected, capsys, caplog):
    no_id = {"prompt": "no id"}   # its id is derived from its content
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows() + [no_id])
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    with caplog.at_level(logging.INFO, logger="eagle3_jax"):
        assert serve(models, target_dir, inp, out, trained_draft_dir, metrics=metrics) == 0
    records = read_jsonl(out)
    want = dict(expected)
    no_id_key = [r.id for r in read_prompts(str(inp))[0]][-1]
    assert no_id_key.startswith("sha256:")
    want.update(expected_text_records(tiny_target, target_dir, [dict(no_id, id=no_id_key)]))
    check_matches(records, want)
    for r in records:
        assert list(r) == ["id", "text", "num_tokens", "finish_reason", "accept_length"]
        assert r["accept_length"] is None or 1.0 <= r["accept_length"] <= COMMON["num_draft_tokens"] + 1
    m = json.loads(metrics.read_text())
    assert m["prompts"] == 13 and m["errors"] == 0 and m["tokens"] == sum(r["num_tokens"] for r in records)
    assert m["mean_accept_length"] >= 1.0 and len(m["accept_rate_per_position"]) == COMMON["num_draft_tokens"]
    assert m["settings"]["draft"] == str(trained_draft_dir)
    printed = capsys.readouterr().out
    assert "serve summary" in printed and "accept by position" in printed and "tau" in printed
    assert "byte-level fallback" in caplog.text
    if m["mean_accept_length"] < WATCHDOG_TAU:   # the draft does not know these prompts: the warning shows
        assert "ACCEPTANCE COLLAPSE" in caplog.text
    side = json.loads(open(sidecar_path(str(out))).read())
    assert side["generation"]["max_new_tokens"] == COMMON["max_new_tokens"]


def test_refill_with_mixed_lengths_equals_one_at_a_time(tmp_path, models, tiny_target, tiny_target_dir,
                                                        trained_draft_dir, expected, expected_tokens):
    """A stop id that some prompts emit early: rows finish at different rounds and are refilled with
    waiting prompts; each result must still equal that prompt generated alone."""
    rows = prompt_rows()
    counts = {}
    for toks in expected_tokens.values():
        for t in set(toks[1:6]) - {1, 254}:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)   # early in the most rows, absent from others
    target_dir = byte_target_dir(tiny_target_dir, tmp_path / "target", [stop, 254])
    want = expected_text_records(tiny_target, target_dir, rows)
    reasons = [w[2] for w in want.values()]
    assert "eos" in reasons and "length" in reasons, reasons
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert serve(models, target_dir, inp, out, trained_draft_dir) == 0
    check_matches(read_jsonl(out), want)
    assert json.loads(open(sidecar_path(str(out))).read())["generation"]["eos_token_ids"] == [stop, 254, 1]


def test_chat_template_stop_ids_and_training_emit(tmp_path, models, tiny_target, tiny_target_dir,
                                                  trained_draft_dir):
    """A tokenizer.json + chat template built here; the assistant turn is replaced by the generation."""
    files = word_level_tokenizer_files()
    target_dir = model_dir_with_files(tiny_target_dir, tmp_path / "target", files)
    convo = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w50 w51 w52"},
             {"role": "assistant", "content": "an old answer"}]
    rows = [{"id": "c0", "messages": convo}, {"id": "c1", "messages": convo[1:2]},
            {"id": "c2", "prompt": "w60 w61"}]
    # Find a token the target emits a few tokens into c0's answer, and make it a stop id.
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [254, 3]}))
    tok = load_tokenizer(target_dir)
    gen = e3.Generator(tiny_target, None, max_len=COMMON["max_len"])
    first = gen.generate([tok.encode_chat(convo[:2])], COMMON["max_new_tokens"], eos_token_ids=tok.eos_token_ids)
    toks = first.tokens[0]
    j = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i] and toks[i] not in (1, 3, 254))
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [toks[j], 3]}))
    tok = load_tokenizer(target_dir)
    assert tok.eos_token_ids == (toks[j], 3, 1)

    want = expected_text_records(tiny_target, target_dir,
                                 [{"id": "c0", "messages": convo[:2]}, {"id": "c1", "messages": convo[1:2]},
                                  {"id": "c2", "prompt": "w60 w61"}])
    assert want["c0"] == (tok.decode(toks[:j]), j + 1, "eos")
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert serve(models, target_dir, inp, out, trained_draft_dir, emit="training") == 0
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert set(by_id) == {"c0", "c1", "c2"}
    assert by_id["c0"]["messages"] == convo[:2] + [{"role": "assistant", "content": want["c0"][0]}]
    assert by_id["c0"]["finish_reason"] == "eos"
    assert by_id["c1"]["messages"] == convo[1:2] + [{"role": "assistant", "content": want["c1"][0]}]
    assert by_id["c2"]["messages"] == [{"role": "user", "content": "w60 w61"},
                                       {"role": "assistant", "content": want["c2"][0]}]


def test_resume_after_partial_line_and_settings_protection(tmp_path, models, target_dir, trained_draft_dir,
                                                           expected, capsys, caplog):
    rows = prompt_rows()
    out = tmp_path / "out.jsonl"
    assert serve(models, target_dir, write_jsonl(tmp_path / "first.jsonl", rows[:4]), out,
                 trained_draft_dir) == 0
    done = out.read_bytes()
    with open(out, "ab") as f:   # what a crash in the middle of a write leaves behind
        f.write(b'{"id": "p7", "text": "par')
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="eagle3_jax"):
        assert serve(models, target_dir, inp, out, trained_draft_dir) == 0
    assert "partial last line" in caplog.text and "4 of 12 prompts already done" in caplog.text
    data = out.read_bytes()
    assert data.startswith(done) and data.endswith(b"\n")
    records = read_jsonl(out)
    check_matches(records, expected)
    assert [r["id"] for r in records[:4]] == ["p0", "p1", "p2", "p3"]
    # not with settings that change what is generated
    capsys.readouterr()
    assert serve(models, target_dir, inp, out, trained_draft_dir, max_new_tokens=5, temperature=0.5) == 1
    err = capsys.readouterr().err
    assert "max_new_tokens: output has 12, this run has 5" in err and "temperature: output has 0.0" in err
    assert "--overwrite" in err and out.read_bytes() == data
    # everything done: nothing loads
    calls = models.calls
    assert serve(models, target_dir, inp, out, trained_draft_dir) == 0
    assert "nothing to do" in capsys.readouterr().out and models.calls == calls
    # --overwrite starts over with the new settings
    assert serve(models, target_dir, write_jsonl(tmp_path / "two.jsonl", rows[:2]), out, trained_draft_dir,
                 seed=5, overwrite=True) == 0
    assert [r["id"] for r in read_jsonl(out)] == ["p0", "p1"]
    assert json.loads(open(sidecar_path(str(out))).read())["generation"]["seed"] == 5


def test_speed_settings_may_change_between_runs_of_one_job():
    s = cli.settings_from_argv(["--target", "t", "--input", "i", "--output", "o"])
    fast = cli.settings_from_argv(["--target", "t", "--input", "i", "--output", "o", "--draft", "d",
                                   "--num-draft-tokens", "6", "--batch-size", "64", "--mesh", "expert=8"])
    assert s.fingerprint("bfloat16", (1,), "x") == fast.fingerprint("bfloat16", (1,), "x")
    # max_len decides only which prompts fit and where rows are cut; the output handles those rows
    assert s.fingerprint("bfloat16", (1,), "x") == cli.settings_from_argv(
        ["--target", "t", "--input", "i", "--output", "o", "--max-len", "99"]).fingerprint("bfloat16", (1,), "x")
    for flag, value in [("--max-new-tokens", "9"), ("--temperature", "1"), ("--top-p", "0.9"), ("--top-k", "5"),
                        ("--seed", "3"), ("--emit", "training")]:
        other = cli.settings_from_argv(["--target", "t", "--input", "i", "--output", "o", flag, value])
        assert other.fingerprint("bfloat16", (1,), "x") != s.fingerprint("bfloat16", (1,), "x"), flag
    assert s.fingerprint("float32", (1,), "x") != s.fingerprint("bfloat16", (1,), "x")
    assert s.fingerprint("float32", (1, 2), "x") != s.fingerprint("float32", (1,), "x")


def test_output_without_settings_file_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    write_jsonl(out, [{"id": "a", "text": "x"}])
    with pytest.raises(Exception, match="settings file .* is missing"):
        ResumableOutput(str(out), {"max_new_tokens": 1})
    write_jsonl(out, ["not json"])
    with pytest.raises(Exception, match="line 1 is not a serve.py result"):
        ResumableOutput(str(out), {"max_new_tokens": 1})
    with ResumableOutput(str(out), {"max_new_tokens": 1}, overwrite=True) as o:
        assert o.done == set() and out.read_bytes() == b""
        with pytest.raises(Exception, match="another serve.py process"):
            ResumableOutput(str(out), {"max_new_tokens": 1})


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "no end', "not valid JSON (Invalid control character at: column 19)"),
    ("[1, 2]", "expected a JSON object, found list"),
    ('{"id": "a"}', "exactly one of 'messages'"),
    ('{"prompt": "x", "messages": []}', "exactly one of 'messages'"),
    ('{"id": 1.5, "prompt": "x"}', "'id' must be a string or an integer"),
    ('{"prompt": 3}', "'prompt' must be a string"),
    ('{"messages": [{"content": "x"}]}', "no string 'role'"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "only an assistant turn"),
    ('{"id": "p0", "prompt": "again"}', "id \"p0\" was already used on line 1"),
])
def test_malformed_line_reported_with_line_number(tmp_path, line, why):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "p0", "prompt": "a"}, "", line, {"prompt": "b"}])
    records, errors = read_prompts(str(path))
    assert [r.id for r in records] == ["p0", content_id(records[1])] and records[1].id.startswith("sha256:")
    assert len(errors) == 1 and errors[0].startswith("line 3: ") and why in errors[0], errors


def test_malformed_line_aborts_before_generating(tmp_path, models, target_dir, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows()[:2] + ["{oops"])
    out = tmp_path / "out.jsonl"
    calls = models.calls
    assert serve(models, target_dir, inp, out) == 1
    err = capsys.readouterr().err
    assert "line 3: not valid JSON" in err and "--skip-bad-lines" in err
    assert not out.exists() and models.calls == calls


def test_skip_bad_lines_and_too_long_prompt(tmp_path, models, target_dir, trained_draft_dir, expected, capsys):
    long_prompt = "y" * COMMON["max_len"]
    inp = write_jsonl(tmp_path / "in.jsonl",
                      prompt_rows()[:3] + ["{oops", {"id": "long", "prompt": long_prompt}, {"id": "empty", "prompt": ""}])
    out = tmp_path / "out.jsonl"
    assert serve(models, target_dir, inp, out, trained_draft_dir, skip_bad_lines=True) == 1   # 2 prompts failed
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert set(by_id) == {"p0", "p1", "p2", "long", "empty"}
    assert by_id["long"]["finish_reason"] == f"error: prompt has {len(long_prompt)} tokens, max_len is 48"
    assert by_id["long"]["num_tokens"] == 0 and by_id["long"]["text"] == ""
    assert by_id["empty"]["finish_reason"] == "error: prompt is empty (0 tokens)"
    check_matches([by_id[k] for k in ("p0", "p1", "p2")], {k: expected[k] for k in ("p0", "p1", "p2")})
    captured = capsys.readouterr()
    assert "(2 errors)" in captured.out and "1 bad lines skipped" in captured.out
    assert re.search(r"failed +2: 1 prompt too long for max_len, 1 empty prompt; a rerun retries them", captured.out)
    assert "2 of 5 prompts failed: 1 prompt too long for max_len, 1 empty prompt" in captured.err


def test_empty_input_ends_cleanly(tmp_path, models, target_dir, capsys):
    calls = models.calls
    for content in ("", "\n\n  \n"):
        inp = tmp_path / "in.jsonl"
        inp.write_text(content)
        assert serve(models, target_dir, inp, tmp_path / "out.jsonl") == 0
        assert "has no prompts; nothing to do" in capsys.readouterr().out
    assert models.calls == calls


def test_missing_input_file_is_a_bad_command_line(tmp_path, models, target_dir, capsys):
    assert serve(models, target_dir, tmp_path / "nope.jsonl", tmp_path / "out.jsonl") == 2
    assert "--input" in (err := capsys.readouterr().err) and "nope.jsonl does not exist" in err


def test_messages_without_chat_template_refused_before_loading(tmp_path, models, tiny_target_dir, capsys):
    files = word_level_tokenizer_files()
    cfg = files["tokenizer_config.json"]
    del cfg["chat_template"]
    target_dir = model_dir_with_files(tiny_target_dir, tmp_path / "target", files)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "w9"}]}])
    calls = models.calls
    assert serve(models, target_dir, inp, tmp_path / "out.jsonl") == 1
    assert "no chat template" in capsys.readouterr().err and models.calls == calls


# ---------------------------------------------------------------------- command line and settings
def test_without_target_prints_how_to_point_at_a_model(capsys, monkeypatch):
    from eagle3_jax.serve import demo

    monkeypatch.setattr(demo, "available", lambda *a: False)   # with demo/ present, no arguments = the demo
    assert cli.main([]) == 0
    assert "--target" in capsys.readouterr().out
    assert cli.main(["--input", "x.jsonl"]) == 2
    assert "--target is required" in capsys.readouterr().err


def test_yaml_config_supplies_defaults_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-new-tokens: 7\ntemperature: 0.5\nbatch_size: 16\noverwrite: true\nmesh: data=1,expert=8\n")
    s = cli.settings_from_argv(["--config", str(cfg), "--temperature", "0", "--target", "t"])
    assert (s.max_new_tokens, s.temperature, s.batch_size, s.overwrite, s.mesh) == (7, 0.0, 16, True, "data=1,expert=8")
    assert s.top_p == 1.0 and s.skip_bad_lines is False
    cfg.write_text("max_new_token: 7\n")
    with pytest.raises(ConfigError, match="unknown key 'max_new_token' \\(did you mean 'max_new_tokens'\\?\\)"):
        cli.settings_from_argv(["--config", str(cfg)])
    cfg.write_text("max_new_tokens: lots\n")
    with pytest.raises(ConfigError, match=f"--config {cfg}: max_new_tokens: expected an integer, found str 'lots'"):
        cli.settings_from_argv(["--config", str(cfg)])
    s = cli.settings_from_argv(["--target", "t", "--input", "i", "--output", "o", "--top-p", "0"])
    with pytest.raises(ConfigError, match="top_p must be in"):
        s.validate()
    for name in ("example.yaml", "regenerate_training.yaml"):
        s = cli.settings_from_argv(["--config", str(REPO / "configs/serve" / name)])
        s.input, s.output = s.input or "i", s.output or "o"
        s.validate()


def test_settings_errors_name_their_source_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("mesh: {data: 1, expert: 8}\nmax_len: 64\n")
    s = cli.settings_from_argv(["--config", str(cfg), "--max-len", "32"])
    assert (s.mesh, s.max_len) == ("data=1,expert=8", 32)
    cfg.write_text("overwrite: yes please\n")
    with pytest.raises(ConfigError, match=f"--config {cfg}: overwrite: expected true or false"):
        cli.settings_from_argv(["--config", str(cfg)])
    assert cli.main(["--config", str(cfg), "--target", "t"]) == 2
    assert "overwrite: expected true or false" in capsys.readouterr().err
    # a bad value (not only a bad key) is a bad command line too: exit 2, before anything loads
    assert cli.main(["--target", "t", "--input", "i", "--output", "o", "--top-p", "0"]) == 2
    assert "top_p must be in" in capsys.readouterr().err


def test_watchdog_warns_on_collapse_and_is_rate_limited(caplog):
    stats = RunStats(4)
    dog = Watchdog(4, context="out.jsonl", interval=3600)
    stats.add("length", GenerationStats(rounds=10, tokens=40, round_tokens=10, seconds=0.0, accepted_per_position=[0, 0, 0, 0]))
    assert not dog.maybe_check(stats)          # too few rounds to judge
    stats.add("length", GenerationStats(rounds=30, tokens=40, round_tokens=31, seconds=0.0, accepted_per_position=[1, 0, 0, 0]))
    with pytest.warns(e3.AcceptanceCollapseWarning), caplog.at_level(logging.WARNING, logger="eagle3_jax"):
        assert dog.maybe_check(stats)
    assert "ACCEPTANCE COLLAPSE in out.jsonl" in caplog.text
    assert not dog.maybe_check(stats)          # once per interval
    healthy = RunStats(4)
    healthy.add("eos", GenerationStats(rounds=40, tokens=100, round_tokens=100, seconds=0.0,
                                      accepted_per_position=[30, 20, 10, 0]))
    assert not Watchdog(4, "x").maybe_check(healthy)


def test_prefill_memory_bounds_keep_the_output(tmp_path, models, target_dir, trained_draft_dir, expected,
                                                monkeypatch):
    """--admit-rows 1 --prefill-chunk 4 (what tools.plan uses to make prefill fit) change how prompts
    are admitted, never the tokens."""
    from eagle3_jax.speculative import engine

    admitted = []   # (rows, prefill chunk) of each prefill call the engine made
    original = engine.admit_rows
    monkeypatch.setattr(engine, "admit_rows", lambda *args, program, **kw: (
        admitted.append((len(args[6]), program.prefill_chunk)), original(*args, program=program, **kw))[1])
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows())
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    assert serve(models, target_dir, inp, out, trained_draft_dir, metrics=metrics, admit_rows=1, prefill_chunk=4) == 0
    check_matches(read_jsonl(out), expected)
    assert len(admitted) == len(prompt_rows()) and set(admitted) == {(1, 4)}
    settings = json.loads(metrics.read_text())["settings"]
    assert (settings["admit_rows"], settings["prefill_chunk"]) == (1, 4)
