"""The gate between training and serving (eagle3_jax/train_serve.py): data rendered otherwise than
serve.py renders is refused by train.py before the target loads, with both renderings shown; a
draft served far below what its training accuracies imply stops training; tau per context length
in the trainer's eval and in serve.py's metrics JSON."""

import importlib.util
import json
import re

import jinja2
import pytest

import eagle3_jax as e3
from eagle3_jax import train_serve
from eagle3_jax.metrics import GenerationStats
from eagle3_jax.serve.report import RunStats, metrics_dict
from eagle3_jax.tokenizer import load_tokenizer
from eagle3_jax.train import data as data_lib, run
from eagle3_jax.train.trainer import Trainer
from tests import spec_fixtures
from tests.serve_fixtures import REPO, model_dir_with_files, word_level_tokenizer_files, write_jsonl
from tests.test_train import PROMPT_LEN, NEW_TOKENS, _config, predictable_target, predictable_target_dir  # noqa: F401

CONV = [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w20 w21 w22"},
        {"role": "user", "content": "w13"}, {"role": "assistant", "content": "w23 w24"}]
# Another tool's template: no turn markers, a different end of turn.
OTHER_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
# A template whose generation prompt opens a thinking block its rendering of past turns leaves out.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant <think> {% endif %}")


@pytest.fixture(scope="module")
def chatml_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with a word-level tokenizer and a ChatML-style template."""
    return model_dir_with_files(tiny_target_dir, tmp_path_factory.mktemp("chatml") / "target",
                                word_level_tokenizer_files())


@pytest.fixture(scope="module")
def tok(chatml_dir):
    return load_tokenizer(str(chatml_dir))


def _rendered(tok, template, messages, add_generation_prompt=False) -> list[int]:
    text = jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **tok.template_variables())
    return tok.encode(text, add_special_tokens=False)


def _check(tok, tmp_path, *records):
    return train_serve.check_rendering(str(write_jsonl(tmp_path / "data.jsonl", records)), tok)


def test_what_agrees_passes_and_an_unstoppable_turn_end_is_named(tok, tmp_path, caplog):
    ours = data_lib.encode_chat(tok, CONV)
    ids, mask = [int(x) for x in ours.ids], [int(x) for x in ours.loss_mask]
    raw = {"input_ids": list(range(40, 60)), "loss_mask": [0] * 6 + [1] * 14}   # a prompt and its continuation
    assert _check(tok, tmp_path, {"messages": CONV}, {"messages": CONV, "input_ids": ids, "loss_mask": mask},
                  {"input_ids": ids, "loss_mask": mask}, raw, {"text": "w1 w2"}) == 3
    # the user-turn opening and the generation prompt: <|im_start|> user, <|im_start|> assistant
    assert train_serve.template_markers(tok) == ([2, 5], [2, 6])
    # stop tokens: this tokenizer's stop id is </s> (1), its template ends answers with <|im_end|> (3)
    assert "ends an answer with '<|im_end|>' (id 3), which is not one of serve.py's stop ids [1]" in caplog.text


def test_another_template_is_refused_with_both_renderings(tok, tmp_path):
    ids = _rendered(tok, OTHER_TEMPLATE, CONV)
    with pytest.raises(train_serve.RenderingMismatch) as e:
        _check(tok, tmp_path, {"messages": CONV, "input_ids": ids})
    msg = str(e.value)
    assert "data.jsonl:1: the data is rendered unlike serve.py" in msg and "another chat template" in msg
    # position 1: after BOS the data has the word 'user', serve.py's rendering the turn marker
    assert ("First differing token, position 1: the data has id 5 'user', serve.py's rendering id 2 "
            "'<|im_start|>'") in msg
    assert "\n  data:  '<s>' ▸ 'user w10 w11 w12 </s>" in msg and "\n  serve: '<s>' ▸ '<|im_start|>" in msg


def test_no_generation_prompt_is_refused(tok, tmp_path):
    """A pre-tokenized row with this template's turns, its answer rendered straight after the prompt
    (add_generation_prompt=False), the loss on the answer."""
    prompt = tok.encode(tok.render_chat(CONV[:1], add_generation_prompt=False), add_special_tokens=False)
    answer = tok.encode(CONV[1]["content"] + "<|im_end|>", add_special_tokens=False)
    with pytest.raises(train_serve.RenderingMismatch) as e:
        _check(tok, tmp_path, {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    msg = str(e.value)
    assert f"the answer at token {len(prompt)} does not follow this template's generation prompt" in msg
    # serve.py's prompt ends <|im_start|> assistant where the data's ends w12 <|im_end|>
    assert "position 5: the data has id 12 'w12', serve.py's rendering id 2 '<|im_start|>'" in msg
    assert "\n  data:  " in msg and "\n  serve: " in msg


def test_loss_mask_elsewhere_and_rewritten_turns_are_refused(tok, tmp_path, chatml_dir):
    ours = data_lib.encode_chat(tok, CONV)
    ids, mask = [int(x) for x in ours.ids], [int(x) for x in ours.loss_mask]
    shifted = [0, 0] + mask[:-2]   # a loss mask two tokens late
    with pytest.raises(train_serve.RenderingMismatch, match=r"loss mask falls elsewhere .* at token \d+"):
        _check(tok, tmp_path, {"messages": CONV, "input_ids": ids, "loss_mask": shifted})

    cfg = json.loads((chatml_dir / "tokenizer_config.json").read_text())
    thinking = model_dir_with_files(chatml_dir, tmp_path / "thinking",
                                    {"tokenizer_config.json": {**cfg, "chat_template": THINKING_TEMPLATE}})
    with pytest.raises(train_serve.RenderingMismatch, match="prompt for assistant turn 1 is not how training renders"):
        _check(load_tokenizer(str(thinking)), tmp_path, {"messages": CONV})


def _train_main():
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_train_py_refuses_before_the_target_loads(tok, chatml_dir, tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "rendered.jsonl",
                       [{"messages": CONV, "input_ids": _rendered(tok, OTHER_TEMPLATE, CONV)}])
    monkeypatch.setattr(e3, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    rc = _train_main()(["--no-progress", f"target={chatml_dir}", f"data={data}", f"out_dir={tmp_path / 'run'}",
                        "aux_layer_ids=[0,1,2]", "draft_vocab_size=128"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.py: error: " in err and "rendered unlike serve.py" in err
    assert "\n  data:  " in err and "\n  serve: " in err
    assert not (tmp_path / "run").exists()


def test_served_acceptance_check():
    check = train_serve.check_served_acceptance
    with pytest.raises(train_serve.ServedAcceptanceGap) as e:
        check(1.1, 2.0, 4)
    msg = str(e.value)
    assert "tau through the decode loop is 1.10 at K = 4" in msg and "imply 1 + 2.00" in msg and "it gets 5%" in msg
    assert "Likely causes" in msg and "chat template, generation prompt, a thinking prefix, stop tokens" in msg
    check(1.6, 2.0, 4)                 # 30 % of the implied tokens: a held-out shortfall, not a mismatch
    check(1.0, 0.4, 4)                 # the draft has learned too little to tell
    check(1.0, 2.0, 4, min_share=0)    # off
    check(float("nan"), 2.0, 4)        # no rounds


def test_tau_by_context_buckets_and_serve_metrics():
    def stats(rounds, round_tokens, tokens):
        return GenerationStats(rounds=rounds, tokens=tokens, round_tokens=round_tokens, seconds=1.0,
                               accepted_per_position=[0, 0])

    run_stats = RunStats(num_draft_tokens=2)
    # mean context while generating: prompt + half the new tokens
    for prompt, s in ((100, stats(10, 25, 26)), (1900, stats(50, 100, 300)), (7000, stats(20, 30, 31)),
                      (30000, stats(4, 4, 5))):
        run_stats.add("length", s, prompt_tokens=prompt)
    run_stats.add("error: too long", failure="too long")
    by = metrics_dict(run_stats, 0, 0, {})["tau_by_context"]
    assert by == {"<2k": {"prompts": 1, "rounds": 10, "tau": 2.5},
                  "2k-8k": {"prompts": 2, "rounds": 70, "tau": 130 / 70},
                  "8k-32k": {"prompts": 1, "rounds": 4, "tau": 1.0}, ">=32k": {"prompts": 0, "rounds": 0, "tau": None}}


def test_serve_metrics_carry_tau_by_context(tiny_target, tiny_target_dir, trained_draft_dir, tmp_path):
    from tests.serve_fixtures import ModelCache, byte_target_dir, prompt_rows, serve

    models = ModelCache(tiny_target, {str(trained_draft_dir): e3.load_draft(trained_draft_dir, tiny_target)})
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows()[:3])
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    assert serve(models, byte_target_dir(tiny_target_dir, tmp_path / "target"), inp, out, trained_draft_dir,
                 metrics=metrics) == 0
    m = json.loads(metrics.read_text())
    by = m["tau_by_context"]
    assert by["<2k"]["prompts"] == 3 and by["<2k"]["rounds"] == m["rounds"] > 0
    assert by["<2k"]["tau"] == pytest.approx(m["mean_accept_length"])
    assert all(by[k] == {"prompts": 0, "rounds": 0, "tau": None} for k in ("2k-8k", "8k-32k", ">=32k"))


@pytest.fixture(scope="module")
def small_corpus(predictable_target, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("gate_corpus")
    seqs = spec_fixtures.target_greedy_corpus(predictable_target, n_prompts=64, prompt_len=PROMPT_LEN,
                                              new_tokens=NEW_TOKENS, seed=1)
    mask = [0] * PROMPT_LEN + [1] * NEW_TOKENS
    data = write_jsonl(root / "train.jsonl", [{"input_ids": s.tolist(), "loss_mask": mask} for s in seqs])
    prompts = write_jsonl(root / "eval.jsonl", [{"prompt_ids": s[:PROMPT_LEN].tolist()} for s in seqs[:8]])
    return data, prompts


def test_training_stops_when_the_served_draft_is_not_the_trained_one(predictable_target_dir, small_corpus,  # noqa: F811
                                                                     tmp_path, monkeypatch):
    """The eval serves another draft (random weights: what a stack that loads the wrong checkpoint
    serves) than the one training measures: its real tau through the decode loop is about 1, the
    trained draft's accuracies imply far more, and training stops at that eval with the causes named."""
    data, prompts = small_corpus
    monkeypatch.setattr(Trainer, "loaded_draft", lambda self: e3.build_draft(self.dcfg, self.target, seed=5))
    cfg = _config(predictable_target_dir, data, tmp_path / "run", total_steps=100, eval_every=50, save_every=100,
                  eval_prompts=str(prompts), eval_new_tokens=12, eval_draft_tokens=2)
    with pytest.raises(train_serve.ServedAcceptanceGap, match=r"step (50|100) eval: the draft's tau .* Likely causes"):
        run(cfg, progress=False)
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "eval_tau" in r]
    last = evals[-1]
    assert last["eval_tau"] < 1.2 and last["simulated_acc_len"] >= train_serve.MIN_SIMULATED
    by = last["eval_tau_by_context"]   # short prompts: all in the first bucket
    assert by["<2k"]["prompts"] == 8 and by["<2k"]["tau"] == pytest.approx(last["eval_tau"])
    assert all(by[k]["prompts"] == 0 and by[k]["tau"] is None for k in ("2k-8k", "8k-32k", ">=32k"))
    assert not (tmp_path / "run" / "draft").exists()


def test_doctor_with_data(tiny_target, tiny_target_dir, trained_draft_dir, tmp_path, capsys, monkeypatch):
    """``python -m tools.doctor --data``: a file rendered otherwise is refused before any weight
    loads; on the target's own continuations the tests' trained draft is served about as well as its
    accuracies on them imply (the configured wiring alone: the others are test_doctor's)."""
    import tools.doctor.core as core
    from tools.doctor.__main__ import main

    monkeypatch.setattr(core, "candidate_wirings", lambda ids, layers, n: [core.Wiring("configured", tuple(ids))])

    conv = [{"role": "user", "content": "count 1 2 3"}, {"role": "assistant", "content": "4 5 6"}]
    tok = load_tokenizer(str(tiny_target_dir))
    other = write_jsonl(tmp_path / "other.jsonl", [{"messages": conv, "input_ids": tok.encode("count 1 2 3 4 5 6")}])
    assert main(["--target", str(tiny_target_dir), "--draft", str(trained_draft_dir), "--data", str(other)]) == 1
    err = capsys.readouterr().err
    assert "static check failed" in err and "rendered unlike serve.py" in err and "\n  serve: " in err

    # the first continuations the draft was trained on (tests/data/build_trained_draft.py: the same
    # seed draws the same first prompts, and greedy decoding continues each alike in any batch)
    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=6)
    data = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": s.tolist(), "loss_mask": [0] * 6 + [1] * 40}
                                                  for s in seqs])
    rc = main(["--target", str(tiny_target_dir), "--draft", str(trained_draft_dir), "--data", str(data),
               "--num-prompts", "6", "--max-new-tokens", "24", "--num-draft-tokens", "2"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("on the data:"))
    tau, simulated = (float(w) for w in re.match(r"on the data: tau ([\d.]+) served vs 1 \+ ([\d.]+)", line).groups())
    assert rc == 0 and line.endswith("consistent") and simulated >= train_serve.MIN_SIMULATED, out
    assert tau - 1 >= train_serve.MIN_ACCEPT_SHARE * simulated
