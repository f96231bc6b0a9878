"""Multi-process (multi-host) start-up: one JAX process per host, one mesh over all their devices.

Settings come from flags or the ``EAGLE3_*`` environment, so the same command line runs on every
host. Every process runs the same program on the same inputs; process 0 alone writes outputs, logs
and progress (``is_writer``). Files that several processes read back (training checkpoints, the
vocab map) must live on a filesystem all hosts share. ``jax`` is imported lazily.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import numpy as np

from eagle3_jax.errors import ConfigError

ENV_COORDINATOR = "EAGLE3_COORDINATOR"
ENV_NUM_PROCESSES = "EAGLE3_NUM_PROCESSES"
ENV_PROCESS_ID = "EAGLE3_PROCESS_ID"


def add_flags(parser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id`` on an argparse parser (default None)."""
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: HOST:PORT of process 0's "
                        f"coordinator, the same on every process (env {ENV_COORDINATOR}); omit for a single process")
    parser.add_argument("--num-processes", type=int, metavar="N",
                        help=f"multi-host: how many processes (one per host) take part (env {ENV_NUM_PROCESSES})")
    parser.add_argument("--process-id", type=int, metavar="I",
                        help=f"multi-host: this process's id in [0, N); 0 writes the outputs (env {ENV_PROCESS_ID})")


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> tuple[str, int, int] | None:
    """The (coordinator, num_processes, process_id) to join, from arguments then the environment;
    None for a single-process run. Raises ConfigError on an incomplete or inconsistent set."""
    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    raw_n = num_processes if num_processes is not None else env.get(ENV_NUM_PROCESSES) or None
    raw_i = process_id if process_id is not None else env.get(ENV_PROCESS_ID) or None
    if not coordinator:
        given = [name for name, v in (("--num-processes", raw_n), ("--process-id", raw_i)) if v is not None]
        if given:
            raise ConfigError(
                f"{' and '.join(given)} given (flag or EAGLE3_* environment) but no coordinator: a multi-process run "
                f"needs --coordinator HOST:PORT (or {ENV_COORDINATOR}) on every process too; for a single process "
                "drop them")
        return None
    missing = [f"{flag} (or {var})" for flag, var, v in (("--num-processes", ENV_NUM_PROCESSES, raw_n),
                                                          ("--process-id", ENV_PROCESS_ID, raw_i)) if v is None]
    if missing:
        raise ConfigError(
            f"coordinator {coordinator!r} is set but {' and '.join(missing)} is not; a multi-process run needs the "
            "coordinator address, the number of processes and this process's id on every process")
    try:
        n, i = int(raw_n), int(raw_i)
    except ValueError:
        raise ConfigError(f"number of processes and process id must be integers, found {raw_n!r} and {raw_i!r}") \
            from None
    if ":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit():
        raise ConfigError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:8476), found {coordinator!r}")
    if n < 1:
        raise ConfigError(f"number of processes must be >= 1, found {n}")
    if not 0 <= i < n:
        raise ConfigError(f"process id must lie in [0, {n}) for {n} processes, found {i}")
    return coordinator, n, i


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins the process group when a coordinator is configured; returns True if multi-process.

    Must run before anything touches JAX's devices (the mesh then spans every process's devices)."""
    spec = resolve(coordinator, num_processes, process_id)
    if spec is None:
        return False
    coordinator, num_processes, process_id = spec
    import jax

    if jax.distributed.is_initialized():
        return True
    if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    except RuntimeError as e:
        raise ConfigError(f"cannot join the process group at {coordinator} as process {process_id} of "
                          f"{num_processes}: {e}") from None
    # Leave together: the coordinator lives in process 0, which must not vanish under the others.
    atexit.register(jax.distributed.shutdown)
    return True


def is_multi_process() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def is_writer() -> bool:
    """Only one process (0) writes outputs and logs. Never starts a JAX backend by itself."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return True
    return jax.process_index() == 0


def broadcast_json(obj=None):
    """Process 0's JSON-able ``obj`` on every process (the others pass anything, e.g. None)."""
    if not is_multi_process():
        return obj
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode("utf-8"), np.uint8) if is_writer() else np.zeros((0,), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros((n,), np.uint8)
    buf[:data.size] = data
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes().decode("utf-8"))


def fetch(x) -> np.ndarray:
    """A global array's full value on every process (device_get alone fails across processes).

    With several processes every process must call this for the same arrays (it may be a collective)."""
    import jax

    if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fetch_all(*xs) -> list[np.ndarray]:
    """``fetch`` of several arrays; on one process in a single device-to-host transfer (one sync)."""
    import jax

    if jax.process_count() == 1 or all(getattr(x, "is_fully_addressable", True) for x in xs):
        return [np.asarray(v) for v in jax.device_get(xs)]
    return [fetch(x) for x in xs]
