"""The TPU compile tier's draft training step (online and offline hidden states), on both slices:
see test_tpu_compile.py, whose settings and fixtures it shares (a separate file, so that the suite's
two workers, which take whole files, share the tier)."""

import pytest

from tests.test_tpu_compile import TOPOLOGIES, product_precision, pytestmark, small_plan, tiny_configs  # noqa: F401


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("source", ["online", "offline"])
def test_tiny_train_step_compiles(tiny_configs, topology, source):
    p = small_plan(tiny_configs["float"], topology, programs=(), train=True, train_batch=2, train_len=16,
                   ttt_steps=2, hidden_source=source, train_dtype="bfloat16")
    assert p.train.program.platform == "tpu" and p.train.program.fits and p.train.program.temp is not None
