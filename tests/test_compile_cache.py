"""serve.py's persistent compilation cache: programs compiled by one process are read back by the next."""

import os
import subprocess
import sys

import pytest

from eagle3_jax import compile_cache

PROBE = """
import jax, jax.numpy as jnp
from eagle3_jax import compile_cache
print(compile_cache.enable())
print(jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0 + 1.25)(jnp.ones((5, 7))).sum())
"""


def _probe(env):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[0]


def test_compiled_programs_are_written_under_the_project_cache(tmp_path):
    env = {**os.environ, "EAGLE3_JAX_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop(compile_cache.OFF_ENV, None)
    assert _probe(env) == str(tmp_path / "xla")
    entries = os.listdir(tmp_path / "xla")
    assert any(e.startswith("jit_") for e in entries), entries


@pytest.mark.parametrize("value", ["off", "0"])
def test_cache_can_be_turned_off(tmp_path, value):
    env = {**os.environ, "EAGLE3_JAX_CACHE": str(tmp_path), compile_cache.OFF_ENV: value, "JAX_PLATFORMS": "cpu"}
    assert _probe(env) == "None"
    assert not (tmp_path / "xla").exists()


def test_a_second_identical_serve_run_compiles_nothing(tiny_target_dir, trained_draft_dir, tmp_path):
    """serve.py at its default K (auto), run twice on the same job in fresh processes: the second
    run's programs all come from the persistent cache, and its metrics say so, as they do
    what the first run compiled; both write the same texts."""
    import json

    from tests.serve_fixtures import prompt_rows, write_jsonl

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "EAGLE3_JAX_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1"}
    env.pop(compile_cache.OFF_ENV, None)
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows()[:4])

    def serve(name):
        out = tmp_path / f"{name}.jsonl"
        subprocess.run([sys.executable, os.path.join(repo, "serve.py"), "--target", str(tiny_target_dir),
                        "--draft", str(trained_draft_dir), "--input", str(inp), "--output", str(out),
                        "--max-new-tokens", "12", "--max-len", "64", "--batch-size", "2", "--dtype", "float32",
                        "--no-progress", "--metrics", str(out) + ".metrics.json"],
                       env=env, cwd=repo, check=True, capture_output=True, text=True, timeout=600)
        texts = sorted(json.loads(line)["text"] for line in out.read_text().splitlines())
        return texts, json.loads((tmp_path / f"{name}.jsonl.metrics.json").read_text())["compiles"]

    first_texts, first = serve("first")
    second_texts, second = serve("second")
    assert first["compiled"] > 0, first
    assert second["compiled"] == 0 and second["from_cache"] > 0, second
    assert second_texts == first_texts
