"""On a host without a TPU, nothing of libtpu's start-up reaches the user: a command run as a user
runs it (no JAX_PLATFORMS in the environment) prints none of libtpu's failed initialization, while
the deviceless TPU compiles still load libtpu."""

import os
import subprocess
import sys

import pytest

from eagle3_jax import backends
from tests.serve_fixtures import REPO

pytestmark = pytest.mark.skipif(not backends.libtpu_installed() or backends.tpu_attached(),
                                reason="needs libtpu installed on a host without a TPU (the case this guards)")

# What libtpu 0.0.42 prints when it starts without a TPU, one fragment per line it writes.
LIBTPU_NOISE = ("Failed to find host bounds", "TPU_WORKER_HOSTNAMES", "Source Location Trace", "libtpu_init_utils")


def run_as_user(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    # libtpu gives up quietly, before printing anything, while another process holds its lock
    # (/tmp/libtpu_lockfile: a parallel test's TPU compile); without the lock it prints every time.
    env.update(PYTHONPATH=str(REPO), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(f in line for f in LIBTPU_NOISE)]


def test_no_libtpu_start_up_errors_without_a_tpu():
    bare = run_as_user("import jax; print(jax.default_backend())")
    if not noise(bare.stderr):
        pytest.skip("plain JAX prints nothing of libtpu here, so there is nothing to keep quiet")
    # Ours: the serve CLI's imports, JAX's backend, then a deviceless TPU slice's devices.
    ours = run_as_user(
        "from eagle3_jax.serve import cli\n"
        "import jax\n"
        "print(jax.default_backend(), jax.device_count())\n"
        "from tools import tpu\n"
        "print(len(tpu.topology_devices('v5p:2x2x2')))\n")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.split() == ["cpu", "1", "8"], ours.stdout
    assert not noise(ours.stderr), ours.stderr


def test_an_explicit_platform_choice_is_left_alone():
    # JAX_PLATFORMS='' is JAX's own "choose every backend": that includes starting libtpu.
    out = run_as_user("import os; os.environ['JAX_PLATFORMS'] = ''\n"
                      "import jax, eagle3_jax\n"
                      "print(repr(jax.config.jax_platforms), jax.default_backend())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["''", "cpu"]
