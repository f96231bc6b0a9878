"""``train.py`` with ``draft_kind: dflash``: the step's loss and gradients equal SpecForge's own DFlash
training forward (``OnlineDFlashModel``, eager attention) on the same batch and blocks; a run lowers
the loss and its draft is accepted when served; a killed run resumes to the same weights as an
uninterrupted one; online and offline target states, and one device and a mesh, train alike; the
export loads strictly here and into SpecForge's ``DFlashDraftModel`` with the same logits; settings
of other objectives are refused."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import eagle3_jax as e3
from eagle3_jax import drafts
from eagle3_jax.drafts.dflash.checkpoint import dflash_rules
from eagle3_jax.drafts.loaded import rule_tensors
from eagle3_jax.errors import ConfigError
from eagle3_jax.train import TrainConfig, run
from eagle3_jax.train.dflash_trainer import DFlashTrainer, block_loss
from eagle3_jax.train.step import micro_features
from tests.test_train import predictable_target, predictable_target_dir  # noqa: F401  (a peaked tiny target)
from tests.test_train_config import draft_config
from tests.test_train_peagle import T, corpus, rows_file  # noqa: F401  (its target-written rows)

torch = pytest.importorskip("torch")
family = pytest.importorskip("specforge.algorithms.common.dflash_family_model")
dflash_module = pytest.importorskip("specforge.modeling.draft.dflash")

BLOCK, ANCHORS = 4, 6
SMALL = dict(max_len=T, batch_size=4, grad_accum=2, aux_layer_ids=[0, 1, 2],
             draft={"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
             dflash={"num_hidden_layers": 2, "block_size": BLOCK, "num_anchors": ANCHORS})


def _config(target_dir, data, out_dir, **over) -> TrainConfig:
    d = {"target": str(target_dir), "data": None if data is None else str(data), "out_dir": str(out_dir),
         "draft_kind": "dflash", "lr": 3e-3, "warmup_ratio": 0.0, "total_steps": 6, "save_every": 2, "keep": 2,
         "seed": 0, **SMALL}
    d.update(over)
    return TrainConfig.from_dict(d)


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["acc"]) for r in map(json.loads, f) if "loss" in r]


def _dflash_file(tmp_path, **over):
    """A SpecForge DFlash config.json with a full and a sliding layer."""
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "vocab_size": 256,
         "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True,
         "sliding_window": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "block_size": BLOCK, "dflash_config": {"target_layer_ids": [0, 1, 2]}, **over}
    path = tmp_path / f"dflash_config_{len(list(tmp_path.glob('dflash_config_*')))}.json"
    path.write_text(json.dumps(d))
    return str(path)


def _specforge_draft(path):
    """SpecForge's own class built from an export's config.json, its tensors loaded strictly."""
    from safetensors.torch import load_file as load_torch
    from transformers import Qwen3Config

    theirs = dflash_module.DFlashDraftModel(Qwen3Config.from_pretrained(str(path))).float()
    theirs.config._attn_implementation = "eager"
    missing, unexpected = theirs.load_state_dict(load_torch(str(path / "model.safetensors")), strict=True)
    assert not missing and not unexpected
    return theirs


def _online_specforge(theirs, target, mask_id, gamma=None):
    embed_VD, head_VD = (np.array(a) for a in (target.model.embed_tokens[...], target.model.lm_head[...].T))
    lm_head = torch.nn.Linear(*head_VD.shape[::-1], bias=False)
    embed = torch.nn.Embedding(*embed_VD.shape)
    with torch.no_grad():
        lm_head.weight.copy_(torch.as_tensor(head_VD))
        embed.weight.copy_(torch.as_tensor(embed_VD))
    for p in (*lm_head.parameters(), *embed.parameters()):
        p.requires_grad_(False)
    return family.OnlineDFlashModel(theirs, lm_head, embed, mask_token_id=mask_id, block_size=BLOCK,
                                    attention_backend="sdpa", num_anchors=ANCHORS, loss_decay_gamma=gamma)


def block_loss_and_grads(trainer, draft):
    """(the draft's parameters, jitted (params, aux, micro-batch) -> ((loss, metrics), grads)) of
    the step's objective: one compiled program, not hundreds of eager ops."""
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

    def loss(p, aux, mb):
        return block_loss(nnx.merge(graphdef, p, rest), trainer.embed_VD, trainer.lm_head_DV, aux, mb, trainer.spec)

    return params, jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("gamma,chunk", [(None, 0), (3.0, 4)])
def test_step_loss_and_gradients_equal_specforges(predictable_target_dir, predictable_target,  # noqa: F811
                                                  rows_file, tmp_path, gamma, chunk):  # noqa: F811
    """Full and sliding layers (a SpecForge config file), two micro-batches of four rows whose loss
    masks start past the prompt: the step's loss is the mean of SpecForge's micro-batch losses, and
    the gradient the step takes of each micro-batch is SpecForge's, tensor by tensor (float32); the
    head's logits all at once, or four blocks at a time."""
    cfg = _config(predictable_target_dir, rows_file, tmp_path / "run", draft={},
                  draft_config_file=_dflash_file(tmp_path),
                  dflash={"num_anchors": ANCHORS, "loss_decay_gamma": gamma, "objective_chunk_blocks": chunk})
    trainer = DFlashTrainer(cfg, progress=False)
    batch = trainer.next_batch()
    draft = trainer.draft_model()   # the weights the step starts from
    trainer.export(tmp_path / "start")
    theirs = _specforge_draft(tmp_path / "start")
    online = _online_specforge(theirs, predictable_target, trainer.dcfg.mask_token_id, gamma)
    params, loss_and_grads = block_loss_and_grads(trainer, draft)
    losses = []
    for a in range(batch["ids"].shape[0]):
        mb = {k: v[a] for k, v in batch.items()}
        aux, _ = micro_features(mb, trainer.target.graphdef, trainer.target.state, trainer.aux_ids, cfg.target_chunk)
        (loss, _), grads = loss_and_grads(params, aux, mb)
        width = int(np.asarray(mb["keep"]).sum(1).max())   # SpecForge's blocks a row: the most any row keeps
        anchors = torch.as_tensor(np.asarray(mb["anchor"], np.int64)[:, :width])
        keep = torch.as_tensor(np.asarray(mb["keep"])[:, :width])
        online._sample_anchor_positions = lambda *args, **kw: (anchors, keep)
        theirs.zero_grad()
        ref, _, _ = online(torch.as_tensor(np.asarray(mb["ids"], np.int64)), torch.as_tensor(np.array(aux)),
                           torch.as_tensor(np.array(mb["loss_mask"], np.float32)))
        ref.backward()
        assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (float(loss), float(ref))
        losses.append(float(ref))
        ours = dict(rule_tensors(dflash_rules(trainer.dcfg, 3),
                                 {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}))
        worst = 0.0
        for name, p in theirs.named_parameters():
            g = p.grad.numpy()
            err = np.abs(ours[name] - g).max() / max(np.abs(g).max(), 1e-30)
            worst = max(worst, err)
            assert err <= 1e-5, (name, err)
        print(f"DFlash step vs SpecForge, gamma={gamma}, chunk={chunk}, micro-batch {a}: loss {float(loss):.7f} vs {float(ref):.7f}, "
              f"worst gradient {worst:.2e} (max |ours - specforge| / max |specforge| per tensor)")
    assert trainer.run_step(batch)["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    trainer.close()


def test_training_lowers_the_loss_and_the_draft_is_accepted(predictable_target_dir, corpus, tmp_path):  # noqa: F811
    rows, prompts = corpus
    result = run(_config(predictable_target_dir, rows, tmp_path / "run", total_steps=30, save_every=30,
                         eval_every=30, eval_prompts=str(prompts), eval_new_tokens=10, eval_draft_tokens=BLOCK - 1),
                 progress=False)
    assert result.finished and result.step == 30
    losses = [loss for _, loss, _ in _losses(tmp_path / "run")]
    print(f"DFlash training: loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-3:]):.3f}, "
          f"last accuracy by offset {_losses(tmp_path / 'run')[-1][2]}")
    assert np.mean(losses[-3:]) < 0.3 * np.mean(losses[:3]), losses
    # The evaluation serves the draft in the decode loop (one block pass, K = 3) on the rows' prompts:
    # the memorized continuations are accepted (a random draft's tau is about 1).
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "eval_tau" in r]
    print(f"DFlash eval tau {evals[0]['eval_tau']:.2f}")
    assert len(evals) == 1 and evals[0]["eval_tau"] > 1.5, evals


def test_kill_and_resume_equals_uninterrupted_and_export_loads_strictly(predictable_target_dir,  # noqa: F811
                                                                         predictable_target, rows_file, tmp_path,
                                                                         monkeypatch):
    straight = DFlashTrainer(_config(predictable_target_dir, rows_file, tmp_path / "a"), progress=False)
    straight.train()
    straight.close()

    cfg = _config(predictable_target_dir, rows_file, tmp_path / "b")
    first = DFlashTrainer(cfg, progress=False)
    stopped = first.train(stop_at=5)   # killed after step 5; the last checkpoint is step 4
    first.close()
    assert not stopped.finished and not (tmp_path / "b" / "draft").exists()
    resumed = DFlashTrainer(cfg, progress=False)
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

    # The export: SpecForge's DFlash layout with the target layers and MASK token it was trained with.
    out = tmp_path / "b" / "draft"
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["num_hidden_layers"] == 2 and hf["block_size"] == BLOCK
    assert hf["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": resumed.dcfg.mask_token_id}
    loaded = e3.load_draft(out, predictable_target)   # strict: any missing or extra tensor is an error
    assert drafts.of_module(loaded.model).name == "dflash" and loaded.aux_layer_ids == (0, 1, 2)
    trained = dict(nnx.to_flat_state(nnx.state(resumed.draft_model())))
    for path, v in nnx.to_flat_state(nnx.state(loaded.model)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(trained[path][...]), err_msg=str(path))

    # A multi-process run's export (the weights gathered to the host, the writer writes them as the
    # same kind) writes the same files.
    from eagle3_jax.train import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod.distributed, "is_multi_process", lambda: True)
    monkeypatch.setattr(trainer_mod.distributed, "is_writer", lambda: True)
    gathered = tmp_path / "gathered"
    resumed.export(str(gathered))
    monkeypatch.undo()
    assert json.loads((gathered / "config.json").read_text()) == hf
    wg = load_file(str(gathered / "model.safetensors"))
    assert wg.keys() == wb.keys() and all(np.array_equal(wg[k], wb[k]) for k in wb)

    # SpecForge's class takes it strictly and gives our blocks' logits.
    theirs = _specforge_draft(out)
    assert theirs.target_layer_ids == [0, 1, 2] and theirs.mask_token_id == resumed.dcfg.mask_token_id
    online = _online_specforge(theirs, predictable_target, theirs.mask_token_id)
    ids = np.asarray(json.loads(open(rows_file).readline())["input_ids"])[None]
    mask = np.zeros(ids.shape, np.float32)
    mask[:, 2:] = 1
    aux = np.asarray(predictable_target.forward(ids, aux_layer_ids=(0, 1, 2)).aux_hidden, np.float32)
    anchors, keep = np.array([[2, 7, 11]]), np.array([[True, True, True]])
    online._sample_anchor_positions = lambda *a, **k: (torch.as_tensor(anchors), torch.as_tensor(keep))
    with torch.no_grad():
        _, _, hidden = online._forward_draft_blocks(torch.as_tensor(ids), torch.as_tensor(aux), torch.as_tensor(mask))
        ref = online.lm_head(hidden).numpy()
    logits = np.asarray(loaded.forward_blocks(ids, aux, anchors, keep)[1])
    err = np.abs(logits - ref).max() / np.abs(ref).max()
    print(f"DFlash export in SpecForge's class: logits {err:.2e} (max |ours - specforge| / max |specforge|)")
    assert err <= 1e-5


def test_online_and_offline_states_train_alike(predictable_target_dir, rows_file, tmp_path):  # noqa: F811
    off = dict(offline_dir=str(tmp_path / "offline"), total_steps=2)
    run(_config(predictable_target_dir, rows_file, tmp_path / "unused", mode="prepare", **off), progress=False)
    online = DFlashTrainer(_config(predictable_target_dir, rows_file, tmp_path / "on", **off), progress=False)
    offline = DFlashTrainer(_config(predictable_target_dir, None, tmp_path / "off", hidden_source="offline", **off),
                            progress=False)
    assert offline.target is None and offline.dcfg.mask_token_id == online.dcfg.mask_token_id
    for _ in range(2):
        b_on, b_off = online.next_batch(), offline.next_batch()
        for k in ("ids", "anchor", "keep"):   # the same rows and the same drawn blocks
            np.testing.assert_array_equal(b_on[k], b_off[k])
        m_on, m_off = online.run_step(b_on), offline.run_step(b_off)
        np.testing.assert_allclose(m_on["loss"], m_off["loss"], rtol=1e-5)
        assert m_on["count"] == m_off["count"]
    for a, b in zip(jax.tree.leaves(online.params), jax.tree.leaves(offline.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    online.close()
    offline.close()


def test_a_mesh_step_matches_one_device(predictable_target_dir, rows_file, tmp_path):  # noqa: F811
    small = dict(total_steps=2, save_every=2)
    one = DFlashTrainer(_config(predictable_target_dir, rows_file, tmp_path / "one", **small), progress=False)
    mesh = DFlashTrainer(_config(predictable_target_dir, rows_file, tmp_path / "mesh", mesh="data=2,tensor=2",
                                 **small), progress=False)
    r_one, r_mesh = one.train(), mesh.train()
    one.close()
    mesh.close()
    np.testing.assert_allclose(r_mesh.last_metrics["loss"], r_one.last_metrics["loss"], rtol=1e-5)
    assert r_mesh.last_metrics["count"] == r_one.last_metrics["count"]
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(mesh.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert any(x.sharding.spec != () for x in jax.tree.leaves(mesh.params))   # split, not replicated


def test_dflash_settings(predictable_target_dir, rows_file, tmp_path):  # noqa: F811
    base = dict(target=str(predictable_target_dir), data=str(rows_file), out_dir=str(tmp_path / "o"))
    check = lambda **kw: TrainConfig.from_dict({**base, **kw}).resolve()  # noqa: E731

    # Without ids, SpecForge's spread: one target layer per draft layer; the config is SpecForge's.
    plan = check(draft_kind="dflash")
    assert plan.kind.name == "dflash" and plan.aux_ids == (2,)   # one layer of a 4-layer target: the middle
    d = plan.draft
    assert type(d).__name__ == "DFlashConfig" and d.block_size == 16 and d.num_hidden_layers == 1
    assert d.layer_types == ("full_attention",) and d.aux_layer_ids == (2,) and d.hidden_size == 64
    # A draft config file decides the kind, the layout and the ids; the run's settings override them.
    f = _dflash_file(tmp_path)
    plan = check(draft_config_file=f)
    assert plan.kind.name == "dflash" and plan.aux_ids == (0, 1, 2) and plan.draft.sliding_window == 3
    plan = check(draft_config_file=f, aux_layer_ids=[1, 3], dflash={"block_size": 8, "mask_token_id": 7})
    assert plan.aux_ids == (1, 3) and plan.draft.block_size == 8 and plan.draft.mask_token_id == 7
    assert plan.draft.to_hf_dict()["dflash_config"]["target_layer_ids"] == [1, 3]

    for kw, words in [
            (dict(dflash={"num_anchors": 4}), "apply to draft_kind: dflash, but this run trains an eagle3 draft"),
            (dict(draft_kind="dflash", lk_loss_type="alpha"), "SpecForge's DFlash loss"),
            (dict(draft_kind="dflash", loss_convention="specforge"), "SpecForge's DFlash loss"),
            (dict(draft_kind="dflash", draft_vocab_size=128), "the target's own head"),
            (dict(draft_kind="dflash", dflash={"block_size": 1}), "dflash.block_size must be >= 2"),
            (dict(draft_kind="dflash", dflash={"num_anchors": 0}), "dflash.num_anchors"),
            (dict(draft_kind="dflash", dflash={"mask_token_id": 999}), r"outside the vocab \[0, 256\)"),
            (dict(draft_config_file=f, dflash={"num_hidden_layers": 3}), "set it in one place"),
            (dict(draft_config_file=f, eval_every=5, eval_prompts=str(rows_file), eval_draft_tokens=4),
             "block_size - 1 = 3"),
            (dict(draft_kind="peagle", draft_config_file=f), r"\(a dflash draft\)")]:
        with pytest.raises(ConfigError, match=words):
            check(**kw)


def test_chunked_objective_equals_one_chunk():
    """The step's loss over chunks of blocks (the last one padded with dropped blocks) is the loss
    over all blocks at once, and so are its gradients."""
    from eagle3_jax.drafts.dflash.objective import chunked_terms, sample_anchors_host, terms_loss

    rng = np.random.default_rng(0)
    B, S, D, V, N = 2, 20, 8, 32, 7
    ids, mask = rng.integers(0, V, (B, S)), (rng.random((B, S)) < 0.8).astype(np.float32)
    anchors, keep = (np.stack(x) for x in zip(*(sample_anchors_host(m, N, rng) for m in mask)))
    out, head = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, N * BLOCK, D), (D, V)))

    def loss(out, head, chunk):
        t = chunked_terms(out, head, ids, mask, anchors, keep, BLOCK, 3.0, chunk)
        return terms_loss(t), t["hits_K"]

    (whole, hits), g_whole = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(out, head, 0)
    for chunk in (3, 4):
        (part, hits_c), g_part = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(out, head, chunk)
        assert float(part) == pytest.approx(float(whole), rel=1e-6) and (np.asarray(hits_c) == np.asarray(hits)).all()
        for a, b in zip(g_whole, g_part):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_shipped_dflash_recipe_fits_the_demo_target():
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    cfg = TrainConfig.load(repo / "configs/train/demo_dflash.yaml")
    tcfg = e3.TargetConfig.from_path(repo / "demo/target")
    d = draft_config(cfg, tcfg)
    assert cfg.resolved_draft_kind == "dflash" and type(d).__name__ == "DFlashConfig"
    assert d.num_hidden_layers == 1 and d.block_size == 8 and d.hidden_size == tcfg.hidden_size
    assert cfg.resolved_aux_ids(tcfg) == (1, 11, 20) == d.aux_layer_ids   # the recipe's, as the chain draft
    assert d.vocab_size == tcfg.vocab_size and cfg.eval_draft_tokens <= d.block_size - 1
