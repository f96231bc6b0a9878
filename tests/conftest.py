"""Test setup: 8 fake CPU devices (set before jax is imported anywhere), shared model fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from tests import hf_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def hf_target_dirs(tmp_path_factory):
    """name -> (checkpoint dir, torch model) for the parity configs, built once per session."""
    root = tmp_path_factory.mktemp("hf_targets")
    return {name: hf_fixtures.save_random_target(root / name, overrides, seed=i)
            for i, (name, overrides) in enumerate(hf_fixtures.PARITY_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_target_dir(hf_target_dirs):
    return hf_target_dirs["qlora_groups_yarn"][0]
