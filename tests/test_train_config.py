"""Training configs: YAML + overrides into a frozen TrainConfig; every bad config is refused with a
message naming the key, before a model is loaded or anything is computed."""

import dataclasses
import json

import pytest

import eagle3_jax as e3
from eagle3_jax.errors import ConfigError
from eagle3_jax.train import TrainConfig
from eagle3_jax.train import trainer as trainer_lib
from tests.hf_fixtures import REPO


def draft_config(cfg: TrainConfig, tcfg=None):
    """The draft config ``cfg.resolve()`` builds, here against ``tcfg`` (default: cfg's target's config)."""
    from eagle3_jax.train.draft_kind import build_draft_config, read_draft_file, resolve_kind

    tcfg = tcfg or cfg.target_config()
    file = read_draft_file(cfg)
    return build_draft_config(cfg, tcfg, resolve_kind(cfg, file), file, cfg.resolved_aux_ids(tcfg, file))


@pytest.fixture
def files(tiny_target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "hello there, general kenobi"}) + "\n")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        f"target: {tiny_target_dir}\n"
        f"data: {data}\n"
        f"out_dir: {tmp_path / 'out'}\n"
        "draft:\n  intermediate_size: 128\n  num_attention_heads: 4\n  num_key_value_heads: 2\n"
        "aux_layer_ids: [0, 1, 2]\n"
        "draft_vocab_size: 64\n"
        "max_len: 32\n"
        "lr: 1e-4\n"
        "betas: [0.9, 0.95]\n")
    return cfg, data


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if anything tries to load or build a model."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the config was checked")
    monkeypatch.setattr(e3, "load_target", refuse)
    monkeypatch.setattr(trainer_lib.Trainer, "_load_target", refuse)


def test_yaml_and_overrides(files):
    path, data = files
    cfg = TrainConfig.load(path, ["batch_size=4", "draft.head_dim=8", "mesh=data=2", "lr=3e-4", "ttt_steps=5"])
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    assert (cfg.batch_size, cfg.draft.head_dim, cfg.mesh, cfg.lr, cfg.ttt_steps) == (4, 8, "data=2", 3e-4, 5)
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)
    assert cfg.betas == (0.9, 0.95) and cfg.aux_layer_ids == (0, 1, 2)
    assert cfg.grad_clip == 0.5 and cfg.loss_decay == 0.8  # recipe defaults
    tcfg = cfg.resolve().target
    d = draft_config(cfg, tcfg)
    assert (d.hidden_size, d.num_key_value_heads, d.head_dim, d.draft_vocab_size) == (64, 2, 8, 64)
    assert d.aux_layer_ids == (0, 1, 2) and d.target_hidden_size == tcfg.hidden_size


def test_like_target_draft_and_default_aux_ids(files, tiny_target_dir):
    cfg = TrainConfig.load(None, [f"target={tiny_target_dir}", f"data={files[1]}", "out_dir=/tmp/x", "draft=like_target"])
    tcfg = cfg.resolve().target
    d = draft_config(cfg, tcfg)
    assert (d.hidden_size, d.num_attention_heads, d.intermediate_size) == (
        tcfg.hidden_size, tcfg.num_attention_heads, tcfg.intermediate_size)
    assert d.aux_layer_ids == tcfg.default_aux_layer_ids() and d.draft_vocab_size == tcfg.vocab_size


@pytest.mark.parametrize("overrides, message", [
    (["learning_rate=1e-4"], "unknown key 'learning_rate' \\(did you mean 'lr'\\?\\); valid keys: target, out_dir, data"),
    (["max_length=512"], "unknown key 'max_length' \\(did you mean 'max_len'\\?\\)"),
    (["epochs=3"], "unknown key 'epochs'; valid keys"),
    (["total_step=10"], "unknown key 'total_step' \\(did you mean 'total_steps'\\?\\)"),
    (["draft.hiden_size=64"], "draft: unknown key 'hiden_size'"),
    (["batch_size=2.5"], "batch_size: expected an integer, found float 2.5"),
    (["lr=fast"], "lr: expected a number, found str 'fast'"),
    (["betas=[0.9]"], "betas: expected a list of 2 values"),
    (["aux_layer_ids=[0, one]"], r"aux_layer_ids\[1\]: expected an integer"),
    (["ttt_steps=true"], "ttt_steps: expected an integer, found bool"),
])
def test_unknown_keys_and_wrong_types(files, no_compute, overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.load(files[0], overrides)


@pytest.mark.parametrize("overrides, message", [
    (["data=/nonexistent/data.jsonl"], "data file /nonexistent/data.jsonl does not exist"),
    (["aux_layer_ids=[0, 1, 4]"], r"\[4\] outside the target's layers 0..3"),
    (["aux_layer_ids=[-1, 1, 2]"], r"\[-1\] outside"),
    (["target=/nonexistent/target"], "no config.json"),
    (["draft_vocab_size=100000"], "draft_vocab_size=100000 must lie in"),
    (["draft.hidden_size=32"], "draft.hidden_size=32 but the target's hidden_size is 64"),
    (["draft.num_key_value_heads=3"], "not a multiple of num_key_value_heads=3"),
    (["batch_size=3", "mesh=data=2"], "batch_size=3 is not divisible by the mesh's data axis"),
    (["hidden_source=offline", "offline_dir=/nonexistent/off"], "no prepared hidden states"),
    (["mode=prepare"], "offline_dir is required"),
    (["mode=sample"], "mode 'sample' is not one of"),
    (["eval_every=10"], "eval_every > 0 needs eval_prompts"),
    (["warmup_ratio=1.5"], r"warmup_ratio must lie in \[0, 1\)"),
    (["dtype=float8"], "dtype 'float8' is not supported"),
    (["total_steps=0"], "total_steps must be >= 1"),
    (["loss_convention=eagle"], "loss_convention 'eagle' is not one of"),
    (["lk_loss_type=beta"], "lk_loss_type 'beta' is not one of"),
    (["attention=flash"], "attention 'flash' is not one of"),
    (["loss_chunk=0"], "loss_chunk"),
])
def test_bad_values_fail_before_compute(files, no_compute, overrides, message):
    cfg = TrainConfig.load(files[0], overrides)
    with pytest.raises(ConfigError, match=message):
        cfg.resolve()
    with pytest.raises(ConfigError, match=message):
        trainer_lib.Trainer(cfg, progress=False)


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.load(bad)
    with pytest.raises(ConfigError, match="'target'.*is required"):
        TrainConfig.load(None, ["lr=1e-3"])
    with pytest.raises(ConfigError, match="not key=value"):
        TrainConfig.load(None, ["lr"])


def test_cli_reports_config_errors(files):
    out = _train_py("--config", str(files[0]), "--no-progress", "lr_max=1")
    assert out.returncode == 2
    assert "error:" in out.stderr and "unknown key 'lr_max'" in out.stderr


@pytest.mark.parametrize("name", ["kimi_k25", "deepseek_v3"])
def test_shipped_configs_fit_their_targets(name):
    cfg = TrainConfig.load(REPO / f"configs/train/{name}.yaml")
    tcfg = e3.TargetConfig.from_path(REPO / f"configs/models/{name}.json")
    d = draft_config(cfg, tcfg)
    assert d.hidden_size == tcfg.hidden_size == 7168
    assert d.num_attention_heads * d.head_dim == 7168 and d.head_dim % 2 == 0
    assert all(0 <= i < tcfg.num_hidden_layers for i in cfg.resolved_aux_ids(tcfg))
    assert d.draft_vocab_size == 32000 and d.vocab_size == tcfg.vocab_size


def test_override_errors_name_the_command_line_not_the_file(files):
    with pytest.raises(ConfigError, match=r"^command line batch_size=lots: batch_size: expected an integer"):
        TrainConfig.load(files[0], ["batch_size=lots"])
    files[0].write_text(files[0].read_text() + "batch_size: lots\n")
    with pytest.raises(ConfigError, match=rf"^--config {files[0]}: batch_size: expected an integer"):
        TrainConfig.load(files[0])


def test_serve_result_lines_are_refused_as_training_data(tiny_target_dir, tmp_path):
    from eagle3_jax.train import data as data_lib

    tok = data_lib.load_tokenizer(tiny_target_dir)
    served = tmp_path / "served.jsonl"
    served.write_text(json.dumps({"id": "a", "text": "the answer", "num_tokens": 3, "finish_reason": "eos",
                                  "accept_length": 2.5}) + "\n")
    with pytest.raises(ConfigError, match=r"served.jsonl:1: this is a serve.py result line .*--emit training"):
        data_lib.read_examples(str(served), tok, 32, 256)
    # a plain text record (no serve keys) is still training data
    assert data_lib.encode_record(tok, {"text": "the answer"}, "x").loss_mask.all()


def _train_py(*args):
    """train.py's main() in this process (a new interpreter would cost a JAX start-up per call):
    returns its exit status and what it printed, as a finished subprocess would."""
    import contextlib
    import io
    import types

    import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = train.main(list(args))
        except SystemExit as e:   # argparse's --help and usage errors
            code = e.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_train_py_help_usage_and_exit_codes(files, tmp_path):
    out = _train_py("--help")
    assert out.returncode == 0
    for line in ("  total_steps: 1000", "  lr: 0.0001", "  target: (required)", "  log_every: 50",
                 '{"messages": [{"role": "user"', '{"text": "..."}', '{"input_ids": [...]', "--emit training"):
        assert line in out.stdout, line
    out = _train_py()
    assert out.returncode == 2 and "--config configs/train/NAME.yaml" in out.stderr
    # a bad value (not only a bad key) is a bad config: exit 2, nothing run
    out = _train_py("--config", str(files[0]), "--no-progress", "total_steps=0")
    assert out.returncode == 2 and "train.py: error: total_steps must be >= 1" in out.stderr


def test_missing_demo_data_says_how_to_make_it(tiny_target_dir, tmp_path, no_compute):
    cfg = TrainConfig.load(REPO / "configs/train/demo.yaml",
                           [f"target={tiny_target_dir}", f"data={tmp_path / 'regenerated.jsonl'}",
                            f"eval_prompts={REPO / 'demo/prompts.jsonl'}", "aux_layer_ids=[0, 1, 2]"])
    with pytest.raises(ConfigError, match=r"regenerated.jsonl does not exist. .*serve.py .*--emit training.*"
                                          r"stage 4 of `python tools/make_demo.py`"):
        cfg.resolve()


def test_a_new_run_never_exports_over_an_existing_draft(files, tmp_path, no_compute):
    shipped = tmp_path / "shipped_draft"
    shipped.mkdir()
    (shipped / "config.json").write_text("{}")
    cfg = TrainConfig.load(files[0], [f"export_dir={shipped}"])
    with pytest.raises(ConfigError, match=rf"export_dir {shipped} already exists .* never writes over a draft"):
        cfg.resolve()
    TrainConfig.load(files[0], [f"export_dir={tmp_path / 'new_draft'}"]).resolve()   # a new place is fine
    # a resumed run (checkpoints in out_dir) may find its own export there: the trainer leaves it be
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    cfg.resolve()
    # The shipped recipes name no export_dir over demo/: they export to out_dir/draft.
    for name in ("demo", "demo_quick", "peagle_demo"):
        recipe = TrainConfig.load(REPO / f"configs/train/{name}.yaml")
        assert not recipe.resolved_export_dir.startswith("demo/"), (name, recipe.resolved_export_dir)


def test_the_quick_recipe_passes_its_checks(tmp_path, no_compute):
    data = tmp_path / "regenerated.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "def f():"},
                                             {"role": "assistant", "content": "    pass"}]}) + "\n")
    cfg = TrainConfig.load(REPO / "configs/train/demo_quick.yaml",
                           [f"target={REPO / 'demo/target'}", f"data={data}", f"out_dir={tmp_path / 'run'}"])
    cfg.resolve()
    assert cfg.resolved_export_dir == str(tmp_path / "run" / "draft") and cfg.eval_every == 0
