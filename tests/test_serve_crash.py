"""kill -9 in the middle of a real ``python serve.py`` run, then the same command again: every id
exactly once, and the file identical (as records) to an uninterrupted run's."""

import os
import re
import signal
import subprocess
import sys
import time

from tests.serve_fixtures import REPO, argv, read_jsonl, write_jsonl

N_PROMPTS = 40


def serve_env(cache_dir) -> dict:
    env = dict(os.environ)
    # One CPU device, as a plain run sees (the test session fakes eight).
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The reruns load the first run's compiled programs instead of compiling again.
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def complete_lines(path) -> int:
    try:
        return open(path, "rb").read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_then_rerun_completes_without_loss_or_duplicates(tmp_path, tiny_target_dir, trained_draft_dir):
    rows = [{"id": f"q{i}", "prompt": f"prompt {i}"} for i in range(N_PROMPTS)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    env = serve_env(tmp_path / "jax-cache")

    def command(output):
        # batch 2: the run finishes prompts two at a time, so there is time to kill it halfway
        return [sys.executable, str(REPO / "serve.py"), *argv(tiny_target_dir, inp, output, trained_draft_dir,
                                                                batch_size=2)]

    log_path = tmp_path / "killed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command(out), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if complete_lines(out) >= 2:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (
        f"serve.py was not killed mid-run (exit {proc.returncode}):\n{log_path.read_text()[-3000:]}")
    before = out.read_bytes()
    kept = before[: before.rfind(b"\n") + 1]
    assert 2 <= kept.count(b"\n") < N_PROMPTS

    rerun = subprocess.run(command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert out.read_bytes().startswith(kept)          # finished results are never rewritten
    records = read_jsonl(out)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(r["id"] for r in rows), "every id exactly once"

    whole = subprocess.run(command(ref), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert sorted(records, key=lambda r: r["id"]) == sorted(read_jsonl(ref), key=lambda r: r["id"])
