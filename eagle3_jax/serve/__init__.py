"""The batch generation job behind ``python serve.py``.

  settings.py  ServeSettings: defaults < YAML --config < flags; the output's settings fingerprint
  inputs.py    prompt JSONL reading and validation (line-numbered errors)
  output.py    ResumableOutput: append + fsync per result, partial-line repair, settings sidecar, lock
  report.py    live tok/s and tau, the acceptance watchdog, the final table, --metrics JSON
  cli.py       argument parsing and the job itself (tokenize -> engine -> output)
"""

from eagle3_jax.serve.cli import main, run
from eagle3_jax.serve.settings import ServeSettings

__all__ = ["ServeSettings", "main", "run"]
