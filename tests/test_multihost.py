"""2 processes x 4 CPU devices (gloo collectives) generate the tokens of target-only greedy decoding,
train to the same losses and write the same serve output as 1 process x 8."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import eagle3_jax as e3
from tests.conftest import suite_cache_env

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7], [100, 101, 102, 103, 104, 105, 106]]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (2, 2, 2) splits the batch, the experts and the heads across the two processes.
@pytest.mark.parametrize("mesh", ["data=2,expert=2,tensor=2"])
def test_two_processes_match_one(tiny_target, tiny_target_dir, trained_draft_dir, tmp_path, mesh):
    # The reference is the lossless law itself, target-only greedy decoding in this process (one
    # device: test_spec_lossless.py holds one process's 8-device meshes to the same tokens).
    expected = e3.Generator(tiny_target, None, max_len=40).generate(PROMPTS, 16).tokens

    port, out = _free_port(), tmp_path / "out.json"
    env = dict(os.environ, EAGLE3_TEST_PROMPTS=json.dumps(PROMPTS), PYTHONPATH=str(Path(__file__).parent.parent),
               **suite_cache_env())
    env.pop("XLA_FLAGS", None)
    worker = Path(__file__).with_name("multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(tiny_target_dir),
                               str(trained_draft_dir), mesh, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["spec"] == expected
    assert got["target_only"] == expected


# ---------------------------------------------------------------------- the command lines, 2 processes
REPO = Path(__file__).resolve().parent.parent


def _run_processes(argv_for, n=2, timeout=600) -> list[str]:
    """Runs ``argv_for(port, i)`` as process i of n (4 CPU devices each, gloo); returns their logs."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONPATH=str(REPO), TQDM_DISABLE="1", **suite_cache_env())
    procs = [subprocess.Popen([sys.executable, *argv_for(port, i)], env=env, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n\n".join(f"process {i}:\n{log[-4000:]}"
                                                                for i, log in enumerate(logs))
    return logs


def _dist_flags(port, i, n=2):
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]


def _train_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["step"] for r in rows], [r["loss"] for r in rows], [r["ploss"] for r in rows]


def test_train_two_processes_match_one(tiny_target_dir, tmp_path):
    """train.py as 2 processes x 4 devices: each loads its half of every batch (data=2), the losses
    equal one process x 8 devices, the checkpoints written together restore together."""
    from safetensors.numpy import load_file

    from eagle3_jax.train import TrainConfig, run

    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for _ in range(24):
            f.write(json.dumps({"input_ids": rng.integers(2, 256, size=16).tolist()}) + "\n")
    base = {"target": str(tiny_target_dir), "data": str(data), "aux_layer_ids": [0, 1, 2],
            "draft": {"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
            "max_len": 16, "batch_size": 4, "grad_accum": 2, "ttt_steps": 2, "draft_vocab_size": 128,
            "lr": 3e-3, "warmup_ratio": 0.0, "total_steps": 3, "save_every": 2, "seed": 0,
            "mesh": "data=2,expert=4,tensor=1"}
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(base))   # JSON is YAML

    one = tmp_path / "one"
    run(TrainConfig.load(config, [f"out_dir={one}"]), progress=False)
    two = tmp_path / "two"
    _run_processes(lambda port, i: ["train.py", "--config", str(config), f"out_dir={two}", *_dist_flags(port, i)])

    steps, losses, plosses = _train_losses(one)
    steps2, losses2, plosses2 = _train_losses(two)
    assert steps == steps2 == [1, 2, 3]
    np.testing.assert_allclose(losses2, losses, rtol=1e-4)
    np.testing.assert_allclose(plosses2, plosses, rtol=1e-4)
    assert sorted(os.listdir(two / "checkpoints")) == ["2", "3"]
    w1, w2 = load_file(one / "draft" / "model.safetensors"), load_file(two / "draft" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-4, atol=1e-6, err_msg=k)

    # Rerun: both processes restore step 3 from the shared checkpoints; the export of the restored
    # weights (into a new directory) is the one written at the end of training.
    _run_processes(lambda port, i: ["train.py", "--config", str(config), f"out_dir={two}",
                                    f"export_dir={tmp_path / 'again'}", *_dist_flags(port, i)])
    w3 = load_file(tmp_path / "again" / "model.safetensors")
    for k in w2:
        np.testing.assert_array_equal(w3[k], w2[k], err_msg=k)
    assert _train_losses(two)[0] == [1, 2, 3]


def test_serve_two_processes_match_one(tiny_target_dir, trained_draft_dir, tmp_path):
    """serve.py as 2 processes x 4 devices writes (from process 0 only) what one process x 8 writes."""
    from eagle3_jax.serve import cli

    inp = tmp_path / "in.jsonl"
    prompts = ["hello world", "the quick fox", "abc", "jumps over", "x"]
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))

    def args(out):
        return ["--target", str(tiny_target_dir), "--draft", str(trained_draft_dir), "--input", str(inp),
                "--output", str(out), "--max-new-tokens", "10", "--max-len", "40", "--batch-size", "2",
                "--num-draft-tokens", "3", "--dtype", "float32", "--mesh", "data=1,expert=4,tensor=2",
                "--metrics", str(out) + ".metrics.json"]

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert cli.main(args(one)) == 0
    # The 2-process run resumes a job whose first two prompts are done: process 0 tells process 1
    # which, so both generate the same other three; only process 0 appends, sidecar and metrics too.
    lines = one.read_text().splitlines(keepends=True)
    two.write_text("".join(lines[:2]))
    shutil.copy(tmp_path / "one.jsonl.settings.json", tmp_path / "two.jsonl.settings.json")
    logs = _run_processes(lambda port, i: ["serve.py", *args(two), *_dist_flags(port, i)])
    assert two.read_text().splitlines(keepends=True)[:2] == lines[:2]
    assert sorted(two.read_text().splitlines()) == sorted(one.read_text().splitlines())
    assert json.loads((tmp_path / "two.jsonl.metrics.json").read_text())["prompts"] == len(prompts) - 2
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    assert "serve summary" in logs[0] and "2 of 5 prompts already done" in logs[0]


@pytest.mark.parametrize("argv, message", [
    (["--process-id", "1"], "no coordinator"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "--process-id"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "must lie in [0, 2)"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
])
def test_bad_process_flags_explain_themselves(argv, message, capsys, monkeypatch):
    from eagle3_jax.serve import cli

    for var in ("EAGLE3_COORDINATOR", "EAGLE3_NUM_PROCESSES", "EAGLE3_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["--target", "x", "--input", "i.jsonl", "--output", "o.jsonl", *argv]) == 2
    assert message in capsys.readouterr().err


def test_process_flags_are_not_config_keys(tmp_path):
    from eagle3_jax.errors import ConfigError
    from eagle3_jax.serve.settings import read_yaml_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("process_id: 1\n")
    with pytest.raises(ConfigError, match="--process-id on the command line"):
        read_yaml_config(str(cfg))
