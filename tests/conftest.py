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

# The suite compiles hundreds of programs and runs each briefly: XLA:CPU's LLVM optimizations cost
# more compile time than they save in run time (about a quarter of a decode program's compile on the
# 2-core CPU, and the suite spends most of its time compiling). Unoptimized programs compute the
# same functions, rounded differently; the tests compare them with each other and with references as
# before. The files in OPTIMIZED compile as users do: they assert what the compiler reports (TPU
# compiles, memory analyses), or hold two computations to a margin set on the optimized kernels
# (test_train_dflash: parameters after two Adam steps on a mesh and on one device within 1e-5;
# unoptimized, one element of 12,288 differed by 1.6e-5). Child processes (serve.py, train.py, the
# multi-host workers, the README's commands) inherit their test file's setting through the
# environment, so what a child writes is compared with what was computed in-process alike.
# JAX_DISABLE_MOST_OPTIMIZATIONS set before the suite starts (0 or 1) decides for every file
# instead.
SUITE_PICKS_OPTIMIZATION = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") is None
OPTIMIZED = ("test_tpu_compile.py", "test_roofline.py", "test_plan.py", "test_plan_quant.py", "test_quant_native.py",
             "test_ttt.py", "test_train_dflash.py")

# A persistent compilation cache for the suite: each test file's in-memory programs are dropped when
# it ends (below), and pytest-xdist workers do not share memory, so without it every file and worker
# recompiles the shared shapes. EAGLE3_TEST_XLA_CACHE moves it; "off" disables it.
_CACHE = os.environ.get("EAGLE3_TEST_XLA_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "test-xla"))
if _CACHE.lower() != "off":
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)



def suite_cache_env() -> dict:
    """Environment that points a child process (the multi-host workers, train.py, serve.py) at the
    suite's compilation cache, so a rerun of the suite does not recompile what its children compiled."""
    if _CACHE.lower() == "off":
        return {"EAGLE3_JAX_COMPILE_CACHE": "off", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    return {"JAX_COMPILATION_CACHE_DIR": _CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "EAGLE3_JAX_COMPILE_CACHE": "off"}


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


@pytest.fixture(scope="session")
def trained_draft_dir():
    """A draft trained on the tiny target's own greedy outputs (SpecForge layout), shipped with the
    tests: see tests/data/build_trained_draft.py, which rebuilds it. Tests only read it."""
    from pathlib import Path

    return Path(__file__).resolve().parent / "data" / "trained_draft"


@pytest.fixture(scope="session")
def random_draft_dir(tiny_target, tmp_path_factory):
    from tests import spec_fixtures

    draft = e3.build_draft(spec_fixtures.tiny_draft_config(tiny_target.config, draft_vocab=64), tiny_target, seed=7)
    # a non-trivial vocab map: draft id i -> target id 2i + 1
    draft.state["d2t"].value = jax.numpy.arange(64, dtype=jax.numpy.int32) + 1
    path = tmp_path_factory.mktemp("drafts") / "random"
    e3.save_draft(draft, path)
    return path


# `make test` hands whole files to its two workers (pytest-xdist --dist loadfile) in collection
# order (--no-loadscope-reorder; xdist's own order, by number of tests, started the costliest files
# last, so one worker ran a long file while the other idled). The files that take longest from an
# empty compile cache go first; the rest keep their order. Measured cold (an empty compile cache),
# CPU seconds of the file alone on the 2-core machine: test_tpu_compile 337, test_multihost 265,
# test_doctor 172, test_demo 128, test_serve_crash 46, test_accept_expectation 30.
SLOWEST_FIRST = ("test_tpu_compile.py", "test_multihost.py", "test_doctor.py", "test_demo.py", "test_serve_crash.py",
                 "test_accept_expectation.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the order within a file is kept


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
    """Each test file's compiled programs are dropped when it ends: a worker that keeps every program
    of the suite runs out of memory mappings (vm.max_map_count, 65530 by default) and XLA:CPU's
    code allocator then crashes the worker (seen once with the 24-layer demo pair). A file starts
    with the compiler optimizing or not (OPTIMIZED, above)."""
    if SUITE_PICKS_OPTIMIZATION:
        optimize = request.path.name in OPTIMIZED
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if optimize else "1"   # for child processes
        jax.config.update("jax_disable_most_optimizations", not optimize)
    yield
    import gc

    jax.clear_caches()
    gc.collect()
