"""Test setup: 8 fake CPU devices (set before jax is imported anywhere), shared model fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

import eagle3_jax as e3  # noqa: E402

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


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return e3.load_target(tiny_target_dir)


def _shared_dir(tmp_path_factory):
    """A directory shared by all pytest-xdist workers of this run (one build, many readers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def trained_draft_dir(tiny_target_dir, tiny_target, tmp_path_factory):
    """A draft trained on the tiny target's own outputs, saved in the SpecForge layout.

    The tiny target is rebuilt bit-identically by every worker (fixed seed), so the draft trained
    by whichever worker gets here first serves them all.
    """
    from filelock import FileLock

    from tests import spec_fixtures

    path = _shared_dir(tmp_path_factory) / "trained_draft"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            cfg = spec_fixtures.tiny_draft_config(tiny_target.config)
            draft = e3.build_draft(cfg, tiny_target, seed=0)
            seqs = spec_fixtures.target_greedy_corpus(tiny_target)
            trained, _ = spec_fixtures.train_draft_on_target(tiny_target, draft, seqs)
            e3.save_draft(trained, path)
    return path


@pytest.fixture(scope="session")
def random_draft_dir(tiny_target, tmp_path_factory):
    from tests import spec_fixtures

    draft = e3.build_draft(spec_fixtures.tiny_draft_config(tiny_target.config, draft_vocab=64), tiny_target, seed=7)
    # a non-trivial vocab map: draft id i -> target id 2i + 1
    draft.state["d2t"].value = jax.numpy.arange(64, dtype=jax.numpy.int32) + 1
    path = tmp_path_factory.mktemp("drafts") / "random"
    e3.save_draft(draft, path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Each test file's compiled programs are dropped when it ends: a worker that keeps every program
    of the suite runs out of memory mappings (vm.max_map_count, 65530 by default) and XLA:CPU's
    code allocator then crashes the worker (seen once with the 24-layer demo pair)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
