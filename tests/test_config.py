"""Config reading, validation and the real presets (shapes only; nothing materialized)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.config import MeshConfig, TargetConfig
from eagle3_jax.models.target import Target

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"


def _param_count(cfg):
    abstract = nnx.eval_shape(lambda: Target(cfg, jnp.bfloat16, None))
    return sum(int(np.prod(v.value.shape)) for _, v in nnx.to_flat_state(nnx.state(abstract)))


def test_kimi_k25_nested_text_config():
    cfg = TargetConfig.from_path(MODELS / "kimi_k25.json")
    assert cfg.weight_prefix == "language_model."
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts) == (7168, 61, 384)
    assert cfg.num_experts_per_tok == 8 and cfg.first_k_dense_replace == 1
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 50000
    assert cfg.eos_token_ids == (163585,)
    assert cfg.default_aux_layer_ids() == (1, 29, 57)


def test_kimi_k25_parameter_count_is_about_1_03_trillion():
    n = _param_count(TargetConfig.from_path(MODELS / "kimi_k25.json"))
    assert 1.00e12 < n < 1.06e12, n


def test_deepseek_v3_preset():
    cfg = TargetConfig.from_path(MODELS / "deepseek_v3.json")
    assert (cfg.num_attention_heads, cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group) == (128, 3, 8, 4)
    assert cfg.rope.factor == 40 and cfg.rope.mscale_all_dim == 1.0
    assert cfg.routed_scaling_factor == 2.5 and cfg.vocab_size == 129280
    # 671B total with the MTP layer; our 61 serving layers hold about 671B - 11.5B
    n = _param_count(cfg)
    assert 6.5e11 < n < 6.75e11, n


@pytest.mark.parametrize("name", ["kimi_k25.json", "kimi_k2.json", "deepseek_v3.json", "tiny_deepseek_v3.json",
                                  "tiny_kimi_k25.json"])
def test_config_round_trip(name, tmp_path):
    cfg = TargetConfig.from_path(MODELS / name)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert TargetConfig.from_path(tmp_path) == cfg
    # and a config built in code (no source dict) round-trips through its generated HF form
    bare = cfg.replace(hf_config={})
    assert TargetConfig.from_hf_dict(bare.to_hf_dict()).replace(weight_prefix=cfg.weight_prefix) == cfg


def test_rope_parameters_and_rope_scaling_agree():
    base = json.loads((MODELS / "tiny_deepseek_v3.json").read_text())
    old = dict(base)
    new = dict(base)
    scaling = new.pop("rope_scaling")
    new["rope_parameters"] = dict(scaling, rope_type="yarn", rope_theta=new.pop("rope_theta", 10000.0))
    assert TargetConfig.from_hf_dict(old).rope == TargetConfig.from_hf_dict(new).rope


@pytest.mark.parametrize("change, words", [
    ({"topk_group": 9}, ["topk_group=9", "n_group=4"]),
    ({"n_routed_experts": 10}, ["n_routed_experts=10", "n_group=4"]),
    ({"scoring_func": "relu"}, ["scoring_func", "relu", "sigmoid"]),
    ({"model_type": "llama"}, ["model_type 'llama'", "deepseek_v3"]),
    ({"hidden_size": None}, ["hidden_size", "missing"]),
    ({"num_key_value_heads": 2}, ["num_key_value_heads=2", "MLA"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope type 'dynamic'", "yarn"]),
])
def test_validation_names_field_value_and_fix(change, words):
    d = json.loads((MODELS / "tiny_deepseek_v3.json").read_text())
    d.update(change)
    with pytest.raises(e3.ConfigError) as err:
        TargetConfig.from_hf_dict(d)
    for w in words:
        assert w in str(err.value)


def test_mesh_spec_parsing():
    assert MeshConfig.parse("data=2,expert=2,tensor=2").shape == (2, 2, 2)
    assert MeshConfig.parse("expert=8").shape == (1, 8, 1)
    for bad, word in [("data=0", "positive"), ("pipeline=2", "unknown axis"), ("data:2", "axis=size"),
                      ("data=x", "integer")]:
        with pytest.raises(e3.ConfigError, match=word):
            MeshConfig.parse(bad)
    with pytest.raises(e3.ConfigError, match="needs 16 devices"):
        e3.make_mesh("data=2,expert=8")
