"""The trainer end to end on a tiny target: learning that shows up as acceptance in the real
Generator, exact kill-and-resume, online == offline hidden states, and the data pipeline."""

import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import eagle3_jax as e3
from eagle3_jax.errors import ConfigError
from eagle3_jax.train import TrainConfig, data as data_lib, pipeline as pipeline_lib, run
from eagle3_jax.train.trainer import Trainer
from tests import spec_fixtures

PROMPT_LEN, NEW_TOKENS = 6, 18
# One set of shapes for every trainer in this file, so they share compiled steps.
SMALL = dict(max_len=PROMPT_LEN + NEW_TOKENS, batch_size=4, grad_accum=2, ttt_steps=2, draft_vocab_size=128)


@pytest.fixture(scope="module")
def predictable_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with a sharp head and quiet layers.

    A random-weight target is near-uniform (max prob ~3 %) and chaotic: its greedy next token depends
    on the whole context in a way no one-layer draft learns from a few hundred sequences, so held-out
    acceptance stays ~1 however training goes. Real LMs are peaked and largely predictable. Scaling
    lm_head by 30 makes the softmax peaked without changing any argmax; damping what the attention
    and MLP blocks write into the residual stream (x0.1) makes the next token depend mostly, not
    only, on the current one. Everything else (MLA, MoE routing, YaRN) is the tiny target as is.
    """
    out = tmp_path_factory.mktemp("predictable_target")
    for name in os.listdir(tiny_target_dir):
        src = os.path.join(tiny_target_dir, name)
        if name.endswith(".safetensors"):
            w = load_file(src)
            for k in w:
                if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                    w[k] = w[k] * 0.1
            w["lm_head.weight"] = w["lm_head.weight"] * 30
            save_file(w, str(out / name), metadata={"format": "pt"})
        elif os.path.isfile(src):
            shutil.copy(src, out / name)
    return out


@pytest.fixture(scope="module")
def predictable_target(predictable_target_dir):
    return e3.load_target(predictable_target_dir)


@pytest.fixture(scope="module")
def corpus(predictable_target, tmp_path_factory):
    """The target's own greedy generations (loss on the generated part) and held-out prompts."""
    root = tmp_path_factory.mktemp("corpus")
    seqs = spec_fixtures.target_greedy_corpus(predictable_target, n_prompts=192, prompt_len=PROMPT_LEN,
                                              new_tokens=NEW_TOKENS, seed=1)
    data = root / "train.jsonl"
    with open(data, "w") as f:
        for s in seqs:
            mask = [0] * PROMPT_LEN + [1] * (len(s) - PROMPT_LEN)
            f.write(json.dumps({"input_ids": s.tolist(), "loss_mask": mask}) + "\n")
    held_out = np.random.default_rng(99).integers(2, 256, size=(12, PROMPT_LEN))
    prompts = root / "eval.jsonl"
    with open(prompts, "w") as f:
        for p in held_out:
            f.write(json.dumps({"prompt_ids": p.tolist()}) + "\n")
    return data, prompts, held_out.tolist()


def _config(target_dir, data, out_dir, **over) -> TrainConfig:
    d = {
        "target": str(target_dir), "data": None if data is None else str(data), "out_dir": str(out_dir),
        "draft": {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        "aux_layer_ids": [0, 1, 2], "lr": 3e-3, "warmup_ratio": 0.05, "total_steps": 200, "save_every": 100,
        "seed": 0, **SMALL,
    }
    d.update(over)
    return TrainConfig.from_dict(d)


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["ploss"]) for r in map(json.loads, f) if "loss" in r]


def test_training_raises_held_out_acceptance(predictable_target_dir, predictable_target, corpus, tmp_path):
    data, prompts_file, prompts = corpus
    cfg = _config(predictable_target_dir, data, tmp_path / "run", eval_every=200, eval_prompts=str(prompts_file),
                  eval_new_tokens=24)
    result = run(cfg, progress=False)
    assert result.finished and result.step == 200
    log = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    first, last = log[0], [r for r in log if "loss" in r][-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert len(last["acc"]) == 2 and min(last["acc"]) > 0.5
    logged_tau = [r["eval_tau"] for r in log if "eval_tau" in r]
    assert len(logged_tau) == 1

    # The export is a SpecForge-layout draft that load_draft accepts, with the ids it was trained on.
    hf = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == 128
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    trained = e3.load_draft(tmp_path / "run" / "draft", predictable_target)
    assert int(trained.model.t2d[...].sum()) == 128
    random = e3.build_draft(trained.config, predictable_target, seed=5)

    def tau(draft):
        gen = e3.Generator(predictable_target, draft, num_draft_tokens=4, max_len=PROMPT_LEN + 25)
        return gen.generate(prompts, 24).stats.mean_accept_length

    with pytest.warns(e3.AcceptanceCollapseWarning):
        tau_random = tau(random)
    tau_trained = tau(trained)
    assert tau_trained == pytest.approx(logged_tau[0], rel=1e-6)
    assert tau_random < 1.2 and tau_trained > tau_random + 0.8, (tau_random, tau_trained)


def test_kill_and_resume_equals_uninterrupted(predictable_target_dir, corpus, tmp_path, caplog):
    data = corpus[0]
    small = dict(total_steps=6, save_every=2, keep=2)

    with caplog.at_level(logging.INFO, logger="eagle3_jax"):
        straight = Trainer(_config(predictable_target_dir, data, tmp_path / "a", log_every=2, **small),
                           progress=False)
        straight.train()
        straight.close()
    # without a progress bar: the phases with their timings, then a line every log_every steps
    for text in ("training records from", "loaded target", "step 1 took", "compiling the training step",
                 "step 2/6  loss", "tok/s  ETA", "step 6/6", "exported the draft to"):
        assert text in caplog.text, text

    cfg = _config(predictable_target_dir, data, tmp_path / "b", **small)
    first = Trainer(cfg, progress=False)
    stopped = first.train(stop_at=5)  # killed after step 5; the last checkpoint is step 4
    first.close()
    assert not stopped.finished and not (tmp_path / "b" / "draft").exists()
    assert [s for s, *_ in _losses(tmp_path / "b")] == [1, 2, 3, 4, 5]

    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 4
    resumed.train()
    resumed.close()

    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # the log reads as one run, identical
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))["fc.weight"],
                                  load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))["fc.weight"])
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["4", "6"]  # keep=2

    # Rerunning a finished run changes nothing; changing a setting that alters the run is refused.
    again = Trainer(cfg, progress=False)
    assert again.train().step == 6
    again.close()
    with pytest.raises(ConfigError, match="batch_size: 4 -> 8"):
        Trainer(_config(predictable_target_dir, data, tmp_path / "b", **dict(small, batch_size=8)), progress=False)
    # Changing any other setting of a finished run would silently train nothing: refused, with the fix.
    with pytest.raises(ConfigError, match=r"holds a finished run \(step 6\) trained with other settings "
                                          r"\(lr: 0.003 -> 0.001\).*Use a new out_dir.*raise total_steps above 6"):
        Trainer(_config(predictable_target_dir, data, tmp_path / "b", **dict(small, lr=1e-3)), progress=False)
    longer = Trainer(_config(predictable_target_dir, data, tmp_path / "b", **dict(small, total_steps=8)),
                     progress=False)   # continuing past the end is fine (a warning names the change)
    assert longer.step == 6
    longer.close()


def test_online_and_offline_hidden_states_give_the_same_loss(predictable_target_dir, corpus, tmp_path):
    data = corpus[0]
    small = dict(total_steps=2, offline_dir=str(tmp_path / "offline"))
    run(_config(predictable_target_dir, data, tmp_path / "unused", mode="prepare", **small), progress=False)
    meta = json.loads((tmp_path / "offline" / "meta.json").read_text())
    assert meta["complete"] and meta["aux_layer_ids"] == [0, 1, 2] and meta["num_examples"] == 192
    for name in ("aux", "hidden", "ids", "loss_mask"):
        assert json.loads((tmp_path / "offline" / name / "zarr.json").read_text())["zarr_format"] == 3

    online = Trainer(_config(predictable_target_dir, data, tmp_path / "on", **small), progress=False)
    offline = Trainer(_config(predictable_target_dir, None, tmp_path / "off", hidden_source="offline", **small),
                      progress=False)
    assert offline.target is None
    np.testing.assert_array_equal(online.vocab.d2t, offline.vocab.d2t)
    for _ in range(2):
        b_on, b_off = online.next_batch(), offline.next_batch()
        np.testing.assert_array_equal(b_on["ids"], b_off["ids"])
        m_on, m_off = online.run_step(b_on), offline.run_step(b_off)
        np.testing.assert_allclose(m_on["loss"], m_off["loss"], rtol=1e-5)
        np.testing.assert_allclose(m_on["ploss"], m_off["ploss"], rtol=1e-5)
        np.testing.assert_allclose(m_on["acc"], m_off["acc"], atol=1e-6)
    for a, b in zip(jax.tree.leaves(online.params), jax.tree.leaves(offline.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    online.close()
    offline.close()

    # Offline data prepared for other settings is refused, not silently misused.
    with pytest.raises(ConfigError, match="max_len=24 but this run has max_len=20"):
        Trainer(_config(predictable_target_dir, None, tmp_path / "off2", hidden_source="offline",
                        **dict(small, max_len=20)), progress=False)


def test_data_parallel_step_on_a_mesh_matches_one_device(predictable_target_dir, corpus, tmp_path):
    small = dict(total_steps=2, save_every=2)
    one = Trainer(_config(predictable_target_dir, corpus[0], tmp_path / "one", **small), progress=False)
    mesh = Trainer(_config(predictable_target_dir, corpus[0], tmp_path / "mesh", mesh="data=2,tensor=2",
                           **small), progress=False)
    r_one, r_mesh = one.train(), mesh.train()
    one.close()
    mesh.close()
    assert mesh.next_batch()["ids"].sharding.spec == P(None, "data")  # [grad_accum, rows, T]: rows split
    np.testing.assert_allclose(r_mesh.last_metrics["loss"], r_one.last_metrics["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(mesh.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert any(x.sharding.spec != () for x in jax.tree.leaves(mesh.params))  # lm_head/heads split on tensor
    # Trainable weights and their AdamW moments are split over the data axis too, not replicated
    # (sharding.TRAIN_SPLIT_AXES): every parameter with a dimension the data axis divides, that the
    # table leaves replicated, holds 1/2 of it per device.
    moments = [s for s in jax.tree.leaves(mesh.opt_state, is_leaf=lambda x: isinstance(x, dict))
               if isinstance(s, dict) and jax.tree.structure(s) == jax.tree.structure(mesh.params)]
    assert moments, "AdamW's moments not found in the optimizer state"
    split = 0
    for x, *ms in zip(jax.tree.leaves(mesh.params), *(jax.tree.leaves(m) for m in moments)):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        if any(s is None and d % 2 == 0 for s, d in zip(spec, x.shape)) or "data" in spec:
            assert "data" in spec, (x.shape, spec)
            split += 1
        for m in ms:
            assert m.sharding.is_equivalent_to(x.sharding, x.ndim), (m.sharding, x.sharding)
    assert split >= len(jax.tree.leaves(mesh.params)) // 2


# ---------------------------------------------------------------------- records and the pipeline
def test_chat_text_and_token_records(tiny_target_dir, tmp_path):
    tok = data_lib.load_tokenizer(tiny_target_dir)  # no tokenizer files: byte level
    chat = data_lib.encode_record(tok, {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"}]}, "x")
    text = bytes(chat.ids.tolist()).decode()
    assert text == "<|system|>be brief\n<|user|>hi\n<|assistant|>hello!\n<|user|>more\n<|assistant|>ok\n"
    trained = bytes(chat.ids[chat.loss_mask].tolist()).decode()
    assert trained == "hello!\nok\n"  # assistant turns (with their end-of-turn), nothing else
    plain = data_lib.encode_record(tok, {"text": "abc"}, "x")
    assert plain.ids.tolist() == [97, 98, 99] and plain.loss_mask.all()
    pre = data_lib.encode_record(tok, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, "x")
    assert pre.loss_mask.tolist() == [False, True, True]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: messages\[0\] must be an object"):
        data_lib.read_examples(str(bad), tok, 32, 256)
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not valid JSON"):
        data_lib.read_examples(str(bad), tok, 32, 256)
    bad.write_text('{"input_ids": [1, 2, 300]}\n')
    with pytest.raises(ConfigError, match="outside the target vocab"):
        data_lib.read_examples(str(bad), tok, 32, 256)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "drop me"}]}) + "\n")
    assert bytes(data_lib.read_prompts(str(prompts), tok)[0]).decode() == "<|user|>hi\n<|assistant|>"


def test_pipeline_is_deterministic_per_epoch_and_resumable():
    examples = [data_lib.Example(np.arange(3, 3 + n, dtype=np.int32), np.ones(n, bool)) for n in range(3, 13)]
    source = pipeline_lib.TokenizedSource(examples, max_len=12)
    ds = pipeline_lib.make_dataset(source, batch_size=4, seed=7)
    it = pipeline_lib.make_iterator(ds)
    batches = [next(it) for _ in range(5)]  # 20 rows: two epochs of 10
    order = np.concatenate([b["index"] for b in batches])
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert list(order[:10]) != list(order[10:20])  # reshuffled each epoch
    assert batches[0]["ids"].shape == (4, 12) and batches[0]["loss_mask"].dtype == bool
    row = batches[0]["index"][0]
    n = len(examples[row].ids)
    assert batches[0]["loss_mask"][0].sum() == n and not batches[0]["ids"][0, n:].any()  # right-padded

    again = pipeline_lib.make_iterator(pipeline_lib.make_dataset(source, batch_size=4, seed=7))
    for _ in range(2):
        next(again)
    state = again.get_state()
    fresh = pipeline_lib.make_iterator(pipeline_lib.make_dataset(source, batch_size=4, seed=7))
    fresh.set_state(json.loads(json.dumps(state)))
    for b in batches[2:]:
        np.testing.assert_array_equal(next(fresh)["index"], b["index"])
    other = pipeline_lib.make_iterator(pipeline_lib.make_dataset(source, batch_size=4, seed=8))
    assert list(next(other)["index"]) != list(batches[0]["index"])
