"""DFlash against SpecForge's own ``DFlashDraftModel``: it writes the checkpoint (its state dict, norms
perturbed so a swap would show), we load it through ``e3.load_draft`` and compute the blocks' outputs
and logits under SpecForge's own training masks (``create_dflash_sdpa_mask``), full and sliding
layers, float32. The context comes from our target through the aux contract (the draft's
``target_layer_ids``). The logits are the target's ``lm_head`` of the outputs, as SpecForge takes them.
SpecForge is installed without dependencies (``pip install --no-deps specforge``); skipped without it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import eagle3_jax as e3
from eagle3_jax import drafts
from eagle3_jax.drafts.dflash.config import DFlashConfig, default_target_layer_ids
from eagle3_jax.drafts.dflash.model import block_mask
from eagle3_jax.errors import ConfigError

dflash = pytest.importorskip("specforge.modeling.draft.dflash")
family = pytest.importorskip("specforge.algorithms.common.dflash_family_model")

BLOCK, MASK_ID, WINDOW, S = 4, 5, 3, 14
ANCHORS = [[1, 5, 9], [0, 4, 10]]
LAYOUTS = {"full": ["full_attention", "full_attention"], "full_and_sliding": ["full_attention", "sliding_attention"]}


def _specforge_draft(path, tcfg, layer_types, seed, attention_bias=False):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=tcfg.vocab_size, num_hidden_layers=len(layer_types), layer_types=layer_types,
        use_sliding_window="sliding_attention" in layer_types, sliding_window=WINDOW, rms_norm_eps=1e-6,
        max_position_embeddings=256, attention_bias=attention_bias, block_size=BLOCK,
        num_target_layers=tcfg.num_hidden_layers, dflash_config={"target_layer_ids": [0, 1, 2], "mask_token_id": MASK_ID})
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(seed)
    model = dflash.DFlashDraftModel(cfg).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    cfg.save_pretrained(str(path))
    return model


def _specforge_blocks(model, target, ids, aux, anchors, keep):
    """SpecForge's training forward up to the blocks' outputs, on its own mask builders."""
    anchors_t, keep_t = torch.as_tensor(anchors), torch.as_tensor(keep)
    B, N = anchors_t.shape
    noise = torch.full((B, N * BLOCK), MASK_ID)
    noise[:, ::BLOCK] = torch.where(keep_t, torch.gather(torch.as_tensor(ids), 1, anchors_t), MASK_ID)
    embed = torch.as_tensor(np.asarray(target.model.embed_tokens[...]))
    positions = torch.cat([torch.arange(S).expand(B, S), (anchors_t[..., None] + torch.arange(BLOCK)).reshape(B, -1)], 1)
    args = dict(anchor_positions=anchors_t, block_keep_mask=keep_t, S=S, block_size=BLOCK, device="cpu")
    masks = {"full_attention": family.create_dflash_sdpa_mask(**args),
             "sliding_attention": family.create_dflash_sdpa_mask(**args, sliding_window=WINDOW)}
    with torch.no_grad():
        out = model(position_ids=positions, attention_mask=masks, noise_embedding=embed[noise],
                    target_hidden=torch.as_tensor(aux))
    return out.numpy(), masks


@pytest.fixture(scope="module")
def sequence(tiny_target):
    rng = np.random.default_rng(8)
    return rng.integers(0, tiny_target.config.vocab_size, size=(2, S))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("keep", [[[True] * 3] * 2, [[True, True, False], [True, True, True]]], ids=["all", "dropped"])
def test_specforge_checkpoint_loads_and_gives_its_outputs(tiny_target, tmp_path, sequence, layout, keep):
    model = _specforge_draft(tmp_path / "sf", tiny_target.config, LAYOUTS[layout], seed=3)
    draft = e3.load_draft(tmp_path / "sf", tiny_target, dtype="float32")
    assert drafts.of_module(draft.model).name == "dflash" and draft.aux_layer_ids == (0, 1, 2)
    aux = np.asarray(tiny_target.forward(sequence, aux_layer_ids=draft.aux_layer_ids).aux_hidden, np.float32)
    ref, masks = _specforge_blocks(model, tiny_target, sequence, aux, ANCHORS, keep)
    # our masks are SpecForge's, both rules
    anchors, keep_a = np.asarray(ANCHORS), np.asarray(keep)
    np.testing.assert_array_equal(np.asarray(block_mask(anchors, keep_a, S, BLOCK)), masks["full_attention"][:, 0].numpy())
    np.testing.assert_array_equal(np.asarray(block_mask(anchors, keep_a, S, BLOCK, WINDOW)),
                                  masks["sliding_attention"][:, 0].numpy())
    out, logits = (np.asarray(a) for a in draft.forward_blocks(sequence, aux, ANCHORS, keep))
    rows = np.repeat(keep_a, BLOCK, axis=1)   # a dropped block's outputs are never read (zero loss weight)
    err = np.abs(out - ref)[rows].max() / np.abs(ref[rows]).max()
    ref_logits = ref @ np.asarray(tiny_target.model.lm_head[...])
    lerr = np.abs(logits - ref_logits)[rows].max() / np.abs(ref_logits[rows]).max()
    print(f"DFlash {layout} keep={keep}: outputs {err:.2e}, logits {lerr:.2e} (max |ours - specforge| / max |specforge|)")
    assert err <= 1e-5 and lerr <= 1e-5, (err, lerr)


def test_attention_bias_and_default_layer_ids(tiny_target, tmp_path, sequence):
    model = _specforge_draft(tmp_path / "sf", tiny_target.config, LAYOUTS["full"], seed=4, attention_bias=True)
    draft = e3.load_draft(tmp_path / "sf", tiny_target, dtype="float32")
    aux = np.asarray(tiny_target.forward(sequence, aux_layer_ids=draft.aux_layer_ids).aux_hidden, np.float32)
    keep = [[True] * 3] * 2
    ref, _ = _specforge_blocks(model, tiny_target, sequence, aux, ANCHORS, keep)
    out = np.asarray(draft.forward_blocks(sequence, aux, ANCHORS, keep)[0])
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5
    # SpecForge's spread when the config names no ids: its own function's numbers
    for layers, draft_layers in ((36, 5), (61, 3), (4, 1), (61, 1)):
        assert list(default_target_layer_ids(layers, draft_layers)) == dflash.build_target_layer_ids(layers,
                                                                                                     draft_layers)


def test_config_errors_name_the_fix(tmp_path):
    base = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
            "vocab_size": 256, "block_size": 4, "dflash_config": {"target_layer_ids": [0, 1, 2], "mask_token_id": 5}}
    assert DFlashConfig.from_hf_dict(base).layer_types == ("full_attention", "full_attention")
    for change, words in [({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
                          ({"dflash_config": {"projector_type": "domino"}}, "Domino"),
                          ({"block_size": 1}, "block_size=1"),
                          ({"dflash_config": {"attention_mode": "mla"}}, "attention_mode=.mla. needs")]:
        with pytest.raises(ConfigError, match=words):
            DFlashConfig.from_hf_dict({**base, **change})
    cfg = DFlashConfig.from_hf_dict({**base, "dflash_config": {"target_layer_ids": [0, 1, 2]}})
    with pytest.raises(ConfigError, match="mask_token_id"):
        cfg.require_mask_token()


def test_wrong_layer_ids_are_refused_before_weights(tiny_target, tmp_path):
    _specforge_draft(tmp_path / "sf", tiny_target.config, LAYOUTS["full"], seed=5)
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    for ids, words in (([0, 1, 9], "outside the target's layers"), ([0, 1], "fc.weight takes 192 inputs")):
        bad = tmp_path / f"bad{len(ids)}"
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(tmp_path / "sf" / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                            "target_layer_ids": ids}}))
        with pytest.raises((ConfigError, e3.CheckpointError), match=words):
            e3.load_draft(bad, tiny_target)


def test_preflight_checks_a_dflash_pair(tiny_target, tmp_path):
    from eagle3_jax import preflight

    _specforge_draft(tmp_path / "sf", tiny_target.config, LAYOUTS["full_and_sliding"], seed=6)
    facts = preflight.check_pair(tiny_target.config, tmp_path / "sf")
    assert isinstance(facts.draft, DFlashConfig) and facts.aux_layer_ids == (0, 1, 2) and facts.fc_in_width == 192
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 999
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(tmp_path / "sf" / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mask_token_id=999 outside the vocab"):
        preflight.check_pair(tiny_target.config, bad)


def test_conversion_round_trip_is_byte_identical(tiny_target, tmp_path, sequence):
    _specforge_draft(tmp_path / "sf", tiny_target.config, LAYOUTS["full_and_sliding"], seed=7, attention_bias=True)
    assert_round_trip(tmp_path, tiny_target, sequence)


def assert_round_trip(tmp_path, tiny_target, sequence):
    """The SpecForge-layout draft in tmp_path/sf converts to JAX and back byte for byte, and both
    forms give the same block logits."""
    from tests.test_convert import assert_same_tensors, to_hf, to_jax

    assert to_jax(tmp_path / "sf", tmp_path / "d.jax")["kind"] == "draft"
    to_hf(tmp_path / "d.jax", tmp_path / "back")
    assert_same_tensors(tmp_path / "sf", tmp_path / "back")
    a, b = (e3.load_draft(p, tiny_target, dtype="float32") for p in (tmp_path / "sf", tmp_path / "d.jax"))
    aux = np.asarray(tiny_target.forward(sequence, aux_layer_ids=a.aux_layer_ids).aux_hidden, np.float32)
    np.testing.assert_array_equal(np.asarray(a.forward_blocks(sequence, aux, ANCHORS)[1]),
                                  np.asarray(b.forward_blocks(sequence, aux, ANCHORS)[1]))
