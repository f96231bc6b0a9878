"""Every draft/target wiring contract fails loudly, before any token, naming both numbers."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter


def _variant(src, dst, config_changes=None, tensor_changes=None):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in (config_changes or {}).items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_changes:
        reader = CheckpointReader(src)
        tensors = {k: reader.read(k) for k in reader.keys()}
        tensors.update(tensor_changes)
        for f in dst.glob("*.safetensors"):
            f.unlink()
        with CheckpointWriter(dst) as w:
            for k, v in tensors.items():
                w.add(k, v)
    return dst


@pytest.mark.parametrize("case, config_changes, tensor_changes, words", [
    ("seed_bug_one_layer_for_three",
     {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2]}}, None,
     ["fc.weight takes 192 inputs", "provides 64", "1 captured layer", "3 ids"]),
    ("aux_id_out_of_range",
     {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, None,
     ["[9]", "outside the target's layers 0..3", "output of layer i"]),
    ("aux_disabled",
     {"eagle_config": {"use_aux_hidden_state": False}}, None,
     ["use_aux_hidden_state is false", "192 inputs"]),
    ("vocab_mismatch", {"vocab_size": 512}, None, ["vocab_size=512", "256"]),
    ("target_hidden_mismatch", {"target_hidden_size": 128}, None, ["target_hidden_size=128", "hidden_size is 64"]),
    ("shared_embedding_width", {"hidden_size": 32, "target_hidden_size": 64}, None,
     ["embedding of width 64", "hidden_size is 32"]),
    ("d2t_outside_vocab", None, {"d2t": np.full(64, 250, np.int64)}, ["d2t maps draft id", "outside the target vocab"]),
    ("eagle1_architecture", {"architectures": ["LlamaForCausalLMEagle"]}, None, ["not an EAGLE-3 draft"]),
])
def test_broken_pairing_is_refused(tiny_target, random_draft_dir, tmp_path, case, config_changes, tensor_changes,
                                   words):
    bad = _variant(random_draft_dir, tmp_path / case, config_changes, tensor_changes)
    with pytest.raises(e3.ConfigError) as err:
        e3.load_draft(bad, tiny_target)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_missing_fc_is_not_an_eagle3_draft(tiny_target, random_draft_dir, tmp_path):
    reader = CheckpointReader(random_draft_dir)
    dst = tmp_path / "nofc"
    dst.mkdir()
    shutil.copy(random_draft_dir / "config.json", dst / "config.json")
    with CheckpointWriter(dst) as w:
        for k in reader.keys():
            if k != "fc.weight":
                w.add(k, reader.read(k))
    with pytest.raises(e3.CheckpointError, match="no fc.weight"):
        e3.load_draft(dst, tiny_target)


def test_default_aux_ids_follow_sglang_convention(tiny_target):
    from eagle3_jax.contracts import resolve_aux_ids
    from tests.spec_fixtures import tiny_draft_config

    cfg = dataclasses.replace(tiny_draft_config(tiny_target.config), aux_layer_ids=None)
    L = tiny_target.config.num_hidden_layers
    assert resolve_aux_ids(cfg, tiny_target.config) == (1, L // 2 - 1, L - 4)
