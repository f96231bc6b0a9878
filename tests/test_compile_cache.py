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
