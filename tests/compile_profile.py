"""An opt-in pytest plugin: where the suite's time goes to JAX tracing, lowering and XLA compiling.

    make test PYTEST_ARGS="-p tests.compile_profile"
    python -m tests.compile_profile [DIR]      # the table, from what the workers wrote

Each worker (pytest-xdist) writes ``DIR/<worker>.json`` (DIR: $COMPILE_PROFILE_DIR, default
build/compile_profile): per test, the seconds and count of each jitted function's tracing,
lowering and XLA compilation, read from the timings JAX logs at DEBUG level. A program loaded from
the persistent compilation cache logs no compilation, so a cold run (empty cache) shows what a
fresh clone pays. Child processes (README commands, multi-host workers) are not seen. It slows
the run (JAX's DEBUG records are formatted, and pytest captures them): use its shares, not its
total time.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "build" / "compile_profile"
_STAGES = {"XLA compilation": "xla", "tracing": "trace", "jaxpr to MLIR module conversion": "lower"}
_LINE = re.compile(r"Finished (XLA compilation|tracing|jaxpr to MLIR module conversion) (?:of )?(.+?) "
                   r"(?:for \w+ )?in ([0-9.]+) sec")
_seconds: dict = collections.defaultdict(lambda: collections.defaultdict(float))
_counts: dict = collections.defaultdict(lambda: collections.defaultdict(int))
_test = ["(collection)"]


class _Timings(logging.Handler):
    def emit(self, record):
        m = _LINE.search(record.getMessage())
        if m:
            name = re.sub(r"^jit\((.*)\)$", r"\1", m.group(2))
            key = f"{_STAGES[m.group(1)]}:{name}"
            _seconds[_test[0]][key] += float(m.group(3))
            _counts[_test[0]][key] += 1


def pytest_configure(config):
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(_Timings())


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def pytest_sessionfinish(session):
    out = Path(os.environ.get("COMPILE_PROFILE_DIR", DEFAULT_DIR))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps({"seconds": _seconds, "counts": _counts}))


def report(directory: Path, top: int = 25) -> str:
    by_fn: dict = collections.defaultdict(lambda: collections.Counter())
    by_file: dict = collections.Counter()
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        for test, stages in data["seconds"].items():
            for key, sec in stages.items():
                stage, name = key.split(":", 1)
                by_fn[name][stage] += sec
                if stage == "xla":
                    by_fn[name]["n"] += data["counts"][test][key]
                by_file[test.split("::")[0]] += sec
    lines = [f"{'xla s':>8} {'programs':>8} {'lower s':>8} {'trace s':>8}  function"]
    for name, c in sorted(by_fn.items(), key=lambda kv: -kv[1]["xla"])[:top]:
        lines.append(f"{c['xla']:8.1f} {c['n']:8d} {c['lower']:8.1f} {c['trace']:8.1f}  {name}")
    total = collections.Counter()
    for c in by_fn.values():
        total.update(c)
    lines.append(f"{total['xla']:8.1f} {total['n']:8d} {total['lower']:8.1f} {total['trace']:8.1f}  (all)")
    lines.append("")
    lines.append(f"{'JAX s':>8}  test file (tracing + lowering + compiling)")
    lines += [f"{sec:8.1f}  {name}" for name, sec in by_file.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
