"""``train.py`` with ``draft_kind: peagle``: the P-EAGLE draft learns a tiny memorizable set, a
killed run resumes to the same weights as an uninterrupted one, online and offline target states
train alike, the export loads strictly here and in SpecForge's class, and bad settings are refused."""

import json
import os
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import eagle3_jax as e3
from eagle3_jax import drafts
from eagle3_jax.errors import ConfigError
from eagle3_jax.train import TrainConfig, run
from eagle3_jax.drafts.peagle.objective import peagle_loss
from eagle3_jax.train.peagle_trainer import PEagleTrainer
from tests import spec_fixtures
from tests.test_train import predictable_target, predictable_target_dir  # noqa: F401  (a peaked tiny target)
from tests.test_train_config import draft_config

T = 16
# One set of shapes for every trainer here, so they share one compiled step.
SMALL = dict(max_len=T, batch_size=4, grad_accum=2, draft_vocab_size=128, aux_layer_ids=[0, 1, 2],
             draft={"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
             peagle={"num_hidden_layers": 2, "num_depths": 4})


PROMPT_LEN = 6


@pytest.fixture(scope="module")
def corpus(predictable_target, tmp_path_factory):  # noqa: F811
    """Eight of the target's own greedy continuations (the loss on the generated part), and their
    prompts: memorizable in a few dozen steps, and what the evaluation then generates again."""
    seqs = spec_fixtures.target_greedy_corpus(predictable_target, n_prompts=8, prompt_len=PROMPT_LEN,
                                              new_tokens=T - PROMPT_LEN, seed=3)
    root = tmp_path_factory.mktemp("peagle_data")
    with open(root / "rows.jsonl", "w") as f:
        for s in seqs:
            mask = [0] * PROMPT_LEN + [1] * (T - PROMPT_LEN)
            f.write(json.dumps({"input_ids": s.tolist(), "loss_mask": mask}) + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for s in seqs:
            f.write(json.dumps({"prompt_ids": s[:PROMPT_LEN].tolist()}) + "\n")
    return root / "rows.jsonl", root / "prompts.jsonl"


@pytest.fixture(scope="module")
def rows_file(corpus):
    return corpus[0]


def _config(target_dir, data, out_dir, **over) -> TrainConfig:
    d = {"target": str(target_dir), "data": None if data is None else str(data), "out_dir": str(out_dir),
         "draft_kind": "peagle", "lr": 3e-3, "warmup_ratio": 0.0, "total_steps": 6, "save_every": 2, "keep": 2,
         "seed": 0, **SMALL}
    d.update(over)
    return TrainConfig.from_dict(d)


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["acc"]) for r in map(json.loads, f) if "loss" in r]


def test_training_reduces_the_loss(predictable_target_dir, corpus, tmp_path):  # noqa: F811
    rows, prompts = corpus
    result = run(_config(predictable_target_dir, rows, tmp_path / "run", total_steps=30, save_every=30,
                         eval_every=30, eval_prompts=str(prompts), eval_new_tokens=T - PROMPT_LEN,
                         eval_draft_tokens=3), progress=False)
    assert result.finished and result.step == 30
    # The evaluation serves the draft in the decode loop (parallel drafting, K = 3) on the rows'
    # prompts: the memorized continuations are accepted (a random draft's tau is about 1).
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "eval_tau" in r]
    assert len(evals) == 1 and evals[0]["eval_tau"] > 1.5, evals
    losses = [loss for _, loss, _ in _losses(tmp_path / "run")]
    # Soft labels: the floor is the target's own entropy, not 0.
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    acc = _losses(tmp_path / "run")[-1][2]
    assert len(acc) == 4 and acc[0] > 0.9, acc   # depth 0 (the EAGLE-3 prediction) is memorized


def test_kill_and_resume_equals_uninterrupted_and_export_loads_strictly(predictable_target_dir,  # noqa: F811
                                                                         predictable_target, rows_file, tmp_path):
    straight = PEagleTrainer(_config(predictable_target_dir, rows_file, tmp_path / "a"), progress=False)
    straight.train()
    straight.close()

    cfg = _config(predictable_target_dir, rows_file, tmp_path / "b")
    first = PEagleTrainer(cfg, progress=False)
    stopped = first.train(stop_at=5)   # killed after step 5; the last checkpoint is step 4
    first.close()
    assert not stopped.finished and not (tmp_path / "b" / "draft").exists()
    resumed = PEagleTrainer(cfg, progress=False)
    assert resumed.step == 4
    resumed.train()
    resumed.close()
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wa = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k])

    # The export: SpecForge's P-EAGLE layout with the ids and MASK token it was trained with.
    out = tmp_path / "b" / "draft"
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["PEagleDraftModel"] and hf["num_hidden_layers"] == 2
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert hf["mask_token_id"] == resumed.dcfg.mask_token_id and hf["draft_vocab_size"] == 128
    loaded = e3.load_draft(out, predictable_target)   # strict: any missing or extra tensor is an error
    assert drafts.of_module(loaded.model).name == "peagle" and loaded.aux_layer_ids == (0, 1, 2)
    trained = dict(nnx.to_flat_state(nnx.state(resumed.draft_model())))
    for path, v in nnx.to_flat_state(nnx.state(loaded.model)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(trained[path][...]), err_msg=str(path))

    import torch
    from safetensors.torch import load_file as load_torch
    from specforge.modeling.draft import peagle
    from transformers import LlamaConfig

    theirs = peagle.PEagleDraftModel(LlamaConfig.from_pretrained(str(out))).float()
    missing, unexpected = theirs.load_state_dict(load_torch(str(out / "model.safetensors")), strict=True)
    assert not missing and not unexpected
    np.testing.assert_array_equal(theirs.mask_hidden.detach().numpy().reshape(-1),
                                  np.asarray(loaded.model.mask_hidden[...]))
    assert torch.equal(theirs.d2t, torch.as_tensor(wb["d2t"]))


@pytest.mark.parametrize("convention", ["ours", "specforge"])
def test_step_pairs_the_rows_as_specforge_captures_them(predictable_target_dir, predictable_target,  # noqa: F811
                                                         rows_file, tmp_path, convention):
    """The step's loss against peagle_loss on rows built here from the target's public forward:
    ids and logits shifted by one with SpecForge's zero padding, the mask per convention; specforge
    averages the rows' own means (one row a device), ours weighs every sampled token alike."""
    trainer = PEagleTrainer(_config(predictable_target_dir, rows_file, tmp_path / "run", loss_convention=convention),
                            progress=False)
    batch = trainer.next_batch()
    draft = trainer.draft_model()   # the weights the step starts from
    ids, mask = np.asarray(batch["ids"]), np.asarray(batch["loss_mask"])
    anchor, depth, valid = (np.asarray(batch[k]) for k in ("anchor", "depth", "valid"))
    expected = []
    for a in range(ids.shape[0]):
        out = predictable_target.forward(ids[a], aux_layer_ids=(0, 1, 2))
        logits = np.asarray(out.logits)
        ids_s = np.concatenate([ids[a][:, 1:], np.zeros_like(ids[a][:, :1])], axis=1)
        target_s = np.concatenate([logits[:, 1:], np.zeros_like(logits[:, :1])], axis=1)
        # ours: position t predicts x_{t+2}, counted when that is a loss token; specforge: its mask as is
        mask_s = (mask[a] if convention == "specforge"
                  else np.concatenate([mask[a][:, 2:], np.zeros_like(mask[a][:, :2])], axis=1))
        pos = anchor[a] + depth[a]
        guessed = valid[a] & (depth[a] > 0)
        assert guessed.any() and mask_s[np.nonzero(guessed)[0], pos[guessed]].all()  # rollouts reach loss positions
        loss, _ = peagle_loss(draft, ids_s, np.asarray(out.aux_hidden), target_s, mask_s, anchor[a], depth[a],
                              valid[a], num_depths=4, row_means=convention == "specforge")
        expected.append(float(loss))
    assert trainer.run_step(batch)["loss"] == pytest.approx(np.mean(expected), rel=1e-5)
    trainer.close()


def test_online_and_offline_states_train_alike(predictable_target_dir, rows_file, tmp_path):  # noqa: F811
    off = dict(offline_dir=str(tmp_path / "offline"), total_steps=2)
    run(_config(predictable_target_dir, rows_file, tmp_path / "unused", mode="prepare", **off), progress=False)
    online = PEagleTrainer(_config(predictable_target_dir, rows_file, tmp_path / "on", **off), progress=False)
    offline = PEagleTrainer(_config(predictable_target_dir, None, tmp_path / "off", hidden_source="offline", **off),
                            progress=False)
    assert offline.target is None
    for _ in range(2):
        b_on, b_off = online.next_batch(), offline.next_batch()
        for k in ("ids", "anchor", "depth", "valid"):   # the same rows and the same sampled rollouts
            np.testing.assert_array_equal(b_on[k], b_off[k])
        m_on, m_off = online.run_step(b_on), offline.run_step(b_off)
        np.testing.assert_allclose(m_on["loss"], m_off["loss"], rtol=1e-5)
        assert m_on["count"] == m_off["count"]
    for a, b in zip(jax.tree.leaves(online.params), jax.tree.leaves(offline.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    online.close()
    offline.close()


def _peagle_file(tmp_path, **over):
    d = {"architectures": ["PEagleDraftModel"], "model_type": "llama", "hidden_size": 64, "vocab_size": 256,
         "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
         "num_hidden_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "draft_vocab_size": 64, **over}
    path = tmp_path / f"draft_config_{len(list(tmp_path.glob('draft_config_*')))}.json"   # one file a call
    path.write_text(json.dumps(d))
    return str(path)


def test_draft_kind_settings(predictable_target_dir, rows_file, tmp_path):  # noqa: F811
    base = dict(target=str(predictable_target_dir), data=str(rows_file), out_dir=str(tmp_path / "o"))
    check = lambda **kw: TrainConfig.from_dict({**base, **kw}).resolve()  # noqa: E731

    assert TrainConfig.from_dict(base).resolved_draft_kind == "eagle3"   # the default is unchanged
    with pytest.raises(ConfigError, match=re.escape(f"draft_kind 'medusa' is not one of {drafts.NAMES}")):
        check(draft_kind="medusa")

    # A draft config file decides the kind and the sizes; a disagreeing draft_kind names both.
    peagle_file = _peagle_file(tmp_path)
    cfg = TrainConfig.from_dict({**base, "draft_config_file": peagle_file})
    cfg.resolve()
    assert cfg.resolved_draft_kind == "peagle"
    dcfg = draft_config(cfg)
    assert type(dcfg).__name__ == "PEagleConfig" and dcfg.num_hidden_layers == 3 and dcfg.intermediate_size == 96
    assert dcfg.draft_vocab_size == 64 and dcfg.target_hidden_size == 64
    with pytest.raises(ConfigError, match=r"draft_kind is 'eagle3' but draft_config_file .* has architectures "
                                          r"\['PEagleDraftModel'\] \(a peagle draft\)"):
        check(draft_kind="eagle3", draft_config_file=peagle_file)
    eagle3_file = _peagle_file(tmp_path, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1)
    with pytest.raises(ConfigError, match=r"draft_kind is 'peagle' but .*LlamaForCausalLMEagle3.* \(a eagle3 draft\)"):
        check(draft_kind="peagle", draft_config_file=eagle3_file)
    assert TrainConfig.from_dict({**base, "draft_config_file": eagle3_file}).resolved_draft_kind == "eagle3"
    with pytest.raises(ConfigError, match=r"architectures \['LlamaForCausalLM'\] is neither an EAGLE-3 draft"):
        check(draft_config_file=_peagle_file(tmp_path, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match="does not exist"):
        check(draft_config_file=str(tmp_path / "nowhere.json"))
    with pytest.raises(ConfigError, match=r"hidden_size=32 but the target's hidden_size is 64"):
        check(draft_config_file=_peagle_file(tmp_path, hidden_size=32))
    with pytest.raises(ConfigError, match="both draft: .* give the draft's sizes"):
        check(draft_config_file=peagle_file, draft={"intermediate_size": 64})
    with pytest.raises(ConfigError, match=r"peagle.num_hidden_layers=2 but draft_config_file .* num_hidden_layers=3"):
        check(draft_config_file=peagle_file, peagle={"num_hidden_layers": 2})

    # Settings of one kind given to the other are refused rather than ignored.
    with pytest.raises(ConfigError, match="apply to draft_kind: peagle, but this run trains an eagle3 draft"):
        check(peagle={"num_depths": 4})
    with pytest.raises(ConfigError, match="lk_loss_type 'alpha' is EAGLE-3's"):
        check(draft_kind="peagle", lk_loss_type="alpha")
    with pytest.raises(ConfigError, match="peagle.num_depths must be >= 1"):
        check(draft_kind="peagle", peagle={"num_depths": 0})
    with pytest.raises(ConfigError, match=r"peagle.mask_token_id=999 is outside the vocab \[0, 256\)"):
        check(draft_kind="peagle", peagle={"mask_token_id": 999})
    with pytest.raises(ConfigError, match="unknown key 'depths'"):
        check(draft_kind="peagle", peagle={"depths": 4})


def test_shipped_peagle_recipe_fits_the_demo_target():
    repo = Path(__file__).resolve().parent.parent
    cfg = TrainConfig.load(repo / "configs/train/peagle_demo.yaml")
    tcfg = e3.TargetConfig.from_path(repo / "demo/target")
    d = draft_config(cfg, tcfg)
    assert cfg.resolved_draft_kind == "peagle" and type(d).__name__ == "PEagleConfig"
    assert d.num_hidden_layers == 4 and d.hidden_size == tcfg.hidden_size and d.head_dim % 2 == 0
    assert all(0 <= i < tcfg.num_hidden_layers for i in cfg.resolved_aux_ids(tcfg))
    assert d.draft_vocab_size == 2048 and d.vocab_size == tcfg.vocab_size
