"""The static checks: a mismatched pair is refused from config.json files and headers alone."""

import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest

import eagle3_jax as e3
from eagle3_jax import preflight
from eagle3_jax.checkpoint.checkpoint_reader import SafetensorsFile
from eagle3_jax.serve import cli
from eagle3_jax.tokenizer import TokenizerError

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET, DEMO_DRAFT = REPO / "demo" / "target", REPO / "demo" / "draft"


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Any read of tensor data (or opening a weight file for data) fails the test."""
    def refuse(self, *a, **k):
        raise AssertionError(f"tensor data of {self.path} was read by a static check")

    monkeypatch.setattr(SafetensorsFile, "read", refuse)
    monkeypatch.setattr(SafetensorsFile, "_open", refuse)


@pytest.fixture
def seed_miswired_draft(tmp_path):
    """The seed's bug: fc fuses 3 target layers, the config names 1."""
    return _copy_with_config(DEMO_DRAFT, tmp_path / "draft", eagle_config={"eagle_aux_hidden_state_layer_ids": [2]})


def test_shipped_demo_pair_passes_from_headers(no_tensor_reads):
    facts = preflight.check_pair(DEMO_TARGET, DEMO_DRAFT, mesh="data=1,expert=8,tensor=1", dtype="float32")
    shipped = json.loads((DEMO_DRAFT / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert facts.aux_layer_ids == tuple(shipped)
    assert facts.fc_in_width == 3 * 256 and facts.num_aux_layers == 3
    assert (facts.target_dtype, facts.draft_dtype, facts.quantization) == ("bfloat16", "bfloat16", None)


def test_seed_miswiring_refused_fast_without_reading_tensors(seed_miswired_draft, no_tensor_reads):
    start = time.perf_counter()
    with pytest.raises(e3.ConfigError) as err:
        preflight.check_pair(DEMO_TARGET, seed_miswired_draft)
    elapsed = time.perf_counter() - start
    msg = str(err.value)
    for words in ("fc.weight takes 768 inputs", "provides 256", "1 captured layer", "3 ids"):
        assert words in msg, (words, msg)
    # The promise: seconds, not a target load. Headers of two small files take milliseconds.
    assert elapsed < 2.0, elapsed


def test_load_draft_refuses_before_reading_a_tensor(seed_miswired_draft, monkeypatch):
    target = e3.build_target(e3.TargetConfig.from_path(DEMO_TARGET), seed=0)
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, name: pytest.fail(f"read {name}"))
    with pytest.raises(e3.ConfigError, match="fc.weight takes 768 inputs"):
        e3.load_draft(seed_miswired_draft, target)


def test_mesh_larger_than_the_devices_names_both_counts_and_the_ways_out():
    with pytest.raises(e3.ConfigError) as err:
        preflight.check_pair(DEMO_TARGET, DEMO_DRAFT, mesh="data=2,expert=8,tensor=1")
    msg = str(err.value)
    for words in ("needs 16 devices", "8 are visible", "none", "xla_force_host_platform_device_count=16"):
        assert words in msg, (words, msg)


@pytest.mark.parametrize("changes, error, words", [
    ({"draft_vocab_size": 1024}, e3.CheckpointError, ["lm_head.weight has 2048 rows", "draft_vocab_size is 1024"]),
    ({"target_hidden_size": 512}, e3.ConfigError, ["target_hidden_size=512", "hidden_size is 256"]),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 24]}}, e3.ConfigError,
     ["[24] outside the target's layers 0..23"]),
    ({"quantization_config": {"quant_method": "fp8"}}, e3.ConfigError, ["quantization_config", "unquantized"]),
])
def test_draft_mismatches_are_refused(tmp_path, no_tensor_reads, changes, error, words):
    draft = _copy_with_config(DEMO_DRAFT, tmp_path / "draft", **changes)
    with pytest.raises(error) as err:
        preflight.check_pair(DEMO_TARGET, draft)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_unsupported_target_quantization_is_refused(tmp_path, no_tensor_reads):
    target = _copy_with_config(DEMO_TARGET, tmp_path / "target", quantization_config={"quant_method": "awq"})
    with pytest.raises(e3.CheckpointError, match="quant_method 'awq' is not supported"):
        preflight.check_pair(target, DEMO_DRAFT)


def test_quantization_not_held_natively_is_refused_before_weights(tmp_path, no_tensor_reads):
    """INT4 group size 16 dequantizes fine but has no native kernel: a run that loads the target as
    stored (serve, train) is refused from config.json alone, naming the field."""
    group16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 16}}}}
    target = _copy_with_config(DEMO_TARGET, tmp_path / "target", quantization_config=group16)
    with pytest.raises(e3.ConfigError, match=r"config_groups\.group_0\.weights\.group_size is 16.*weights='bfloat16'"):
        preflight.check_pair(target, DEMO_DRAFT, weights="native")
    assert preflight.check_pair(target, DEMO_DRAFT).quantization == "compressed-tensors"  # dequantizing load: fine


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    from eagle3_jax.tokenizer import load_tokenizer

    draft = _copy_with_config(DEMO_DRAFT, tmp_path / "draft")
    shutil.copy(DEMO_TARGET / "tokenizer.json", draft / "tokenizer.json")
    preflight.check_pair(DEMO_TARGET, draft)   # the same tokenizer on both sides is fine
    # Same size, two tokens' ids swapped: a tokenizer that splits text into other ids.
    first, second = load_tokenizer(DEMO_TARGET).encode(preflight.TOKENIZER_PROBE)[:2]
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[first]], vocab[by_id[second]] = second, first
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerError, match="split the same text differently"):
        preflight.check_pair(DEMO_TARGET, draft)


def test_serve_with_mismatched_pair_exits_before_loading_and_writes_nothing(
        tmp_path, seed_miswired_draft, monkeypatch, capsys):
    monkeypatch.setattr(e3, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    out = tmp_path / "out.jsonl"

    def models(*a):
        pytest.fail("models were loaded")

    rc = cli.main(["--target", str(DEMO_TARGET), "--draft", str(seed_miswired_draft), "--input",
                   str(REPO / "demo" / "prompts.jsonl"), "--output", str(out), "--mesh", "none"], models=models)
    assert rc == 1
    assert "fc.weight takes 768 inputs" in capsys.readouterr().err
    assert not out.exists() and not Path(str(out) + ".settings.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def _train_main():
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("target_changes, overrides, words", [
    ({}, ["mesh=data=1,expert=16,tensor=1"], ["needs 16 devices", "8 are visible"]),
    ({"quantization_config": {"quant_method": "awq"}}, [], ["quant_method 'awq' is not supported"]),
])
def test_train_with_mismatched_setup_exits_before_loading_and_writes_nothing(
        tmp_path, monkeypatch, capsys, target_changes, overrides, words):
    target = _copy_with_config(DEMO_TARGET, tmp_path / "target", **target_changes)
    monkeypatch.setattr(e3, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    out_dir = tmp_path / "run"
    rc = _train_main()(["--no-progress", f"target={target}", f"data={REPO / 'demo' / 'prompts.jsonl'}",
                        f"out_dir={out_dir}", *overrides])
    assert rc == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)
    assert not out_dir.exists()
