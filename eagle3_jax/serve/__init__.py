"""The batch generation job behind ``python serve.py``: settings, inputs, output, report, progress
and cli (the job itself)."""

from eagle3_jax.serve.cli import main, run
from eagle3_jax.serve.settings import ServeSettings

__all__ = ["ServeSettings", "main", "run"]
