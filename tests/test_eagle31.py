"""EAGLE-3.1 drafts on the chain kind: ``fc_norm``, ``norm_before_fc`` and ``norm_output``.

The oracle is SpecForge's own ``LlamaForCausalLMEagle3``: it writes the checkpoint (its state dict,
norms perturbed so a swap would show), we load it through ``e3.load_draft`` and compare logits in
float32. Two flags are not computed by SpecForge 0.2.0 itself, so the test composes its modules:
- ``norm_before_fc`` (SGLang / vLLM: one RMSNorm, ``input_norm``, over the concatenated aux states)
  is not in SpecForge; the oracle applies SpecForge's ``LlamaRMSNorm`` of that width before its
  ``project_hidden_states``.
- ``norm_output``: SpecForge 0.2.0 always feeds the un-normed state to the next step (its later
  fix, PR 879, feeds ``norm(out)`` when the flag is true, which is how SGLang and vLLM serve it);
  the second step here is fed SpecForge's own ``norm`` of the first step's output.
SpecForge is installed without dependencies (``pip install --no-deps specforge``); skipped without it.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import eagle3_jax as e3
from tests import spec_fixtures
from tests.test_convert import assert_same_tensors, to_hf, to_jax

eagle = pytest.importorskip("specforge.modeling.draft.llama3_eagle")


@pytest.fixture(autouse=True, scope="module")
def eager_torch():
    """SpecForge compiles its RMSNorm with torch.compile; eager on CPU gives the same numbers in
    seconds. Only for this module: torch's flex attention (test_peagle_specforge, later in the
    same worker) needs Dynamo on even when run eagerly."""
    saved = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = saved


T = 7
CASES = {
    "eagle3": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "eagle31": {"fc_norm": True, "norm_output": True},
}


def _specforge_draft(path, target_cfg, flags: dict, seed: int):
    """SpecForge's module with ``flags``, its state dict saved as a checkpoint at ``path``; returns the
    module and, with norm_before_fc, the oracle's ``input_norm`` (SpecForge's RMSNorm class)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=target_cfg.hidden_size, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=target_cfg.vocab_size, draft_vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, num_hidden_layers=1, tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}, **flags)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    torch.manual_seed(seed)
    model = eagle.LlamaForCausalLMEagle3(cfg).float().eval()
    input_norm = eagle.LlamaRMSNorm(3 * target_cfg.hidden_size, eps=cfg.rms_norm_eps) if flags.get(
        "norm_before_fc") else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        if input_norm is not None:
            input_norm.weight.add_(0.3 * torch.randn_like(input_norm.weight))
        model.d2t.copy_(torch.arange(64))   # draft id i -> target id 2i
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if input_norm is not None:
        state["input_norm.weight"] = input_norm.weight.detach().clone()
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    cfg.save_pretrained(str(path))
    return model, input_norm


def _specforge_two_steps(model, input_norm, ids, aux, norm_output: bool):
    """Step 0 over fc(aux), then step 1 fed step 0's output (normed with norm_output), both causal
    passes at positions 0..T-1: logits of each step, on SpecForge's own module methods."""
    B, _ = ids.shape
    mask = eagle.prepare_decoder_attention_mask(torch.ones(B, T, dtype=torch.bool), (B, T), aux, 0)
    pos = torch.arange(T)[None]
    logits = []
    with torch.no_grad():
        hidden = model.project_hidden_states(aux if input_norm is None else input_norm(aux))
        for step_ids in (ids, ids.roll(-1, dims=1)):
            out = model.backbone(model.embed_input_ids(step_ids), hidden, None, mask, pos)
            logits.append(model.compute_logits(out).numpy())   # 0.2.0 with norm_output unset/true: lm_head(norm(out))
            hidden = model.norm(out) if norm_output else out
    return logits


def _our_two_steps(draft, ids, aux):
    m = draft.model
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids.shape)
    hidden = m.fuse(jnp.asarray(aux))
    logits = []
    for step_ids in (ids, np.roll(ids, -1, axis=1)):
        step = m(jnp.asarray(step_ids), hidden, pos, draft.target.model.embed_tokens[...], None)
        logits.append(np.asarray(step.logits_BTW))
        hidden = step.hidden_BTD
    return logits


@pytest.fixture(scope="module")
def inputs(tiny_target):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, tiny_target.config.vocab_size, size=(2, T))
    return ids, rng.standard_normal((2, T, 3 * tiny_target.config.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_specforge_checkpoint_loads_and_gives_its_logits(tiny_target, tmp_path, inputs, case):
    flags = CASES[case]
    model, input_norm = _specforge_draft(tmp_path / case, tiny_target.config, flags, seed=len(case))
    draft = e3.load_draft(tmp_path / case, tiny_target, dtype="float32")
    for flag in ("fc_norm", "norm_before_fc", "norm_output"):
        assert getattr(draft.config, flag) == flags.get(flag, False)
    ids, aux = inputs
    ref = _specforge_two_steps(model, input_norm, torch.as_tensor(ids), torch.as_tensor(aux),
                               flags.get("norm_output", False))
    ours = _our_two_steps(draft, ids, aux)
    for step, (a, b) in enumerate(zip(ours, ref)):
        err = np.abs(a - b).max() / np.abs(b).max()
        print(f"{case} step {step}: max |ours - specforge| / max |specforge| = {err:.2e}")
        assert err <= 1e-5, (case, step, err)
    # the one-pass path serving and training use (jitted): step 0 again
    np.testing.assert_allclose(np.asarray(draft.forward(ids, aux).logits), ours[0], rtol=0, atol=1e-5)


def test_norm_flags_change_the_logits(tiny_target, tmp_path, inputs):
    """Each flag is computed, not parsed and dropped: flipping it in the config of the same weights
    changes the logits (norm_output from the second step on)."""
    _specforge_draft(tmp_path / "d", tiny_target.config, CASES["eagle31"], seed=1)
    ids, aux = inputs
    on = _our_two_steps(e3.load_draft(tmp_path / "d", tiny_target, dtype="float32"), ids, aux)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for flag in ("fc_norm", "norm_output"):
        off = tmp_path / f"no_{flag}"
        off.mkdir()
        (off / "model.safetensors").write_bytes((tmp_path / "d" / "model.safetensors").read_bytes())
        (off / "config.json").write_text(json.dumps({**cfg, flag: False}))
        if flag == "fc_norm":   # its weights are no longer expected: the loader says which
            with pytest.raises(e3.CheckpointError, match="fc_norm.0.weight"):
                e3.load_draft(off, tiny_target, dtype="float32")
            continue
        other = _our_two_steps(e3.load_draft(off, tiny_target, dtype="float32"), ids, aux)
        np.testing.assert_array_equal(other[0], on[0])
        assert np.abs(other[1] - on[1]).max() > 1e-2


def test_nested_eagle_config_flags_are_read(tiny_target):
    """NVIDIA's checkpoints put norm_before_fc inside eagle_config; SGLang and vLLM read it there first."""
    cfg = spec_fixtures.tiny_draft_config(tiny_target.config)
    d = cfg.to_hf_dict()
    d["eagle_config"]["norm_before_fc"] = True
    parsed = e3.DraftConfig.from_hf_dict(d)
    assert parsed.norm_before_fc and not parsed.fc_norm


def test_conversion_round_trip_is_byte_identical(tiny_target, tmp_path, inputs):
    src = tmp_path / "sf"
    _specforge_draft(src, tiny_target.config, {"fc_norm": True, "norm_before_fc": True, "norm_output": True}, seed=2)
    to_jax(src, tmp_path / "d.jax")
    to_hf(tmp_path / "d.jax", tmp_path / "back")
    assert_same_tensors(src, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["fc_norm"] and back["norm_before_fc"] and back["norm_output"]
    ids, aux = inputs
    a, b = (e3.load_draft(p, tiny_target, dtype="float32") for p in (src, tmp_path / "d.jax"))
    np.testing.assert_array_equal(np.asarray(a.forward(ids, aux).logits), np.asarray(b.forward(ids, aux).logits))


# ---------------------------------------------------------------------- serving and training
EAGLE31_ALL = {"fc_norm": True, "norm_before_fc": True, "norm_output": True}


def test_trained_eagle31_draft_is_lossless_and_accepted(tiny_target):
    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=32)
    cfg = spec_fixtures.tiny_draft_config(tiny_target.config, **EAGLE31_ALL)
    draft, loss = spec_fixtures.train_draft_on_target(tiny_target, e3.build_draft(cfg, tiny_target, seed=3), seqs,
                                                      steps=200)
    assert draft.config.norm_output and draft.model.fc_norm is not None and draft.model.input_norm is not None
    prompts = [seqs[i, :n].tolist() for i, n in enumerate([6, 9, 12, 7, 6, 10, 8, 11])]
    ref = e3.Generator(tiny_target, None, max_len=48).generate(prompts, 24)
    for k in (1, 4):
        res = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=48).generate(prompts, 24)
        assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
        print(f"EAGLE-3.1 K={k}: loss {loss:.3f}, mean accept length {res.stats.mean_accept_length:.2f}, "
              f"accepted per position {res.stats.accepted_per_position}")
        assert res.stats.mean_accept_length > 1.3, res.stats
    assert res.stats.accepted_per_position[1] > 0   # the fed-back (normed) state drafts past position 1


def test_trainer_trains_and_exports_an_eagle31_draft_specforge_loads(tiny_target_dir, tiny_target, tmp_path):
    from eagle3_jax.train import TrainConfig, run

    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=16, new_tokens=12)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s.tolist(), "loss_mask": [0] * 6 + [1] * 12}) + "\n"
                            for s in seqs))
    recipe = spec_fixtures.tiny_draft_config(tiny_target.config, **EAGLE31_ALL).to_hf_dict()
    (tmp_path / "draft_config.json").write_text(json.dumps(recipe))
    cfg = TrainConfig.from_dict({
        "target": str(tiny_target_dir), "data": str(data), "out_dir": str(tmp_path / "run"),
        "draft_config_file": str(tmp_path / "draft_config.json"), "aux_layer_ids": [0, 1, 2], "lr": 3e-3,
        "total_steps": 20, "save_every": 20, "max_len": 18, "batch_size": 4, "grad_accum": 1, "ttt_steps": 2,
        "seed": 0})
    assert run(cfg, progress=False).finished
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert losses[-1] < losses[0], losses
    export = tmp_path / "run" / "draft"
    hf = json.loads((export / "config.json").read_text())
    assert all(hf[f] for f in EAGLE31_ALL), hf
    ours = e3.load_draft(export, tiny_target, dtype="float32")
    # SpecForge's class takes every tensor but input_norm (a flag it lacks) and its own embedding
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    theirs = eagle.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(str(export))).float().eval()
    state = load_file(str(export / "model.safetensors"))
    input_norm = eagle.LlamaRMSNorm(3 * tiny_target.config.hidden_size)
    input_norm.load_state_dict({"weight": state.pop("input_norm.weight")})
    state["embed_tokens.weight"] = torch.as_tensor(np.asarray(tiny_target.model.embed_tokens[...]))
    theirs.load_state_dict(state, strict=True)
    ids = seqs[:2, :T]
    aux = np.asarray(tiny_target.forward(ids, aux_layer_ids=ours.aux_layer_ids).aux_hidden, np.float32)
    ref = _specforge_two_steps(theirs, input_norm, torch.as_tensor(ids), torch.as_tensor(aux), True)
    for a, b in zip(_our_two_steps(ours, ids, aux), ref):
        assert np.abs(a - b).max() / np.abs(b).max() <= 1e-5
