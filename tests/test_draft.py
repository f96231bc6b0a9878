"""The draft module: shapes, vocab mapping, variants, and the SpecForge layout round trip."""

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from tests.spec_fixtures import tiny_draft_config


def test_forward_shapes_and_layout(tiny_target, random_draft_dir):
    draft = e3.load_draft(random_draft_dir, tiny_target)
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 7))
    aux = tiny_target.forward(ids, aux_layer_ids=draft.aux_layer_ids).aux_hidden
    out = draft.forward(ids, aux)
    assert out.logits.shape == (2, 7, 64) and out.hidden.shape == (2, 7, 64)
    # draft id i maps to target id i + d2t[i] = 2i + 1 in the fixture
    np.testing.assert_array_equal(np.asarray(draft.model.to_target_ids(np.arange(64))), 2 * np.arange(64) + 1)
    reader = CheckpointReader(random_draft_dir)
    assert reader.shape("fc.weight") == (64, 3 * 64)
    assert reader.shape("midlayer.self_attn.q_proj.weight") == (4 * 16, 2 * 64)
    assert reader.dtype("d2t") == np.int64 and reader.dtype("t2d") == np.bool_
    assert "embed_tokens.weight" not in reader


def test_causal(tiny_target, random_draft_dir):
    draft = e3.load_draft(random_draft_dir, tiny_target)
    ids = np.random.default_rng(1).integers(0, 256, size=(1, 8))
    aux = np.asarray(tiny_target.forward(ids, aux_layer_ids=draft.aux_layer_ids).aux_hidden)
    full = np.asarray(draft.forward(ids, aux).logits)
    part = np.asarray(draft.forward(ids[:, :5], aux[:, :5]).logits)
    np.testing.assert_allclose(full[:, :5], part, rtol=1e-5, atol=1e-6)


def test_norm_before_residual_changes_the_computation(tiny_target, tmp_path):
    base = e3.build_draft(tiny_draft_config(tiny_target.config), tiny_target, seed=3)
    e3.save_draft(base, tmp_path / "a")
    e3.save_draft(base, tmp_path / "b", config_overrides={"norm_before_residual": True})
    a, b = e3.load_draft(tmp_path / "a", tiny_target), e3.load_draft(tmp_path / "b", tiny_target)
    assert b.config.norm_before_residual and not a.config.norm_before_residual
    ids = np.random.default_rng(2).integers(0, 256, size=(1, 5))
    aux = tiny_target.forward(ids, aux_layer_ids=a.aux_layer_ids).aux_hidden
    assert not np.allclose(np.asarray(a.forward(ids, aux).logits), np.asarray(b.forward(ids, aux).logits))


def test_save_load_round_trip_preserves_outputs(tiny_target, tmp_path):
    d = e3.build_draft(tiny_draft_config(tiny_target.config), tiny_target, seed=5)
    e3.save_draft(d, tmp_path / "d")
    back = e3.load_draft(tmp_path / "d", tiny_target)
    ids = np.random.default_rng(3).integers(0, 256, size=(2, 4))
    aux = tiny_target.forward(ids, aux_layer_ids=d.aux_layer_ids).aux_hidden
    np.testing.assert_array_equal(np.asarray(d.forward(ids, aux).logits), np.asarray(back.forward(ids, aux).logits))
    with pytest.raises(e3.CheckpointError, match="already exists"):
        e3.save_draft(d, tmp_path / "d")


def test_save_in_bfloat16_casts_weights_and_keeps_the_vocab_map(tiny_target, tmp_path):
    d = e3.build_draft(tiny_draft_config(tiny_target.config), tiny_target, seed=6)
    e3.save_draft(d, tmp_path / "bf16", dtype="bfloat16")
    reader = CheckpointReader(tmp_path / "bf16")
    assert str(reader.dtype("fc.weight")) == "bfloat16" and str(reader.dtype("lm_head.weight")) == "bfloat16"
    assert reader.dtype("d2t") == np.int64 and reader.dtype("t2d") == np.bool_
    back = e3.load_draft(tmp_path / "bf16", tiny_target)
    ids = np.random.default_rng(4).integers(0, 256, size=(1, 6))
    aux = tiny_target.forward(ids, aux_layer_ids=d.aux_layer_ids).aux_hidden
    # bf16 keeps ~3 significant digits: close to the float32 draft, not equal to it.
    np.testing.assert_allclose(np.asarray(back.forward(ids, aux).logits), np.asarray(d.forward(ids, aux).logits),
                               rtol=0.05, atol=0.05)
    np.testing.assert_array_equal(np.asarray(back.model.d2t[...]), np.asarray(d.model.d2t[...]))
