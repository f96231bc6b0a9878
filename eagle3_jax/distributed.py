"""Multi-process (multi-host) start-up: one JAX process per host, one mesh over all their devices.

Settings come from arguments or the environment (``EAGLE3_COORDINATOR`` host:port,
``EAGLE3_NUM_PROCESSES``, ``EAGLE3_PROCESS_ID``), so the same command line runs on every host.
On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from eagle3_jax.errors import ConfigError

ENV_COORDINATOR = "EAGLE3_COORDINATOR"
ENV_NUM_PROCESSES = "EAGLE3_NUM_PROCESSES"
ENV_PROCESS_ID = "EAGLE3_PROCESS_ID"


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins the process group when a coordinator is configured; returns True if multi-process."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if not coordinator:
        return False
    try:
        num_processes = int(num_processes if num_processes is not None else os.environ[ENV_NUM_PROCESSES])
        process_id = int(process_id if process_id is not None else os.environ[ENV_PROCESS_ID])
    except KeyError as e:
        raise ConfigError(
            f"coordinator {coordinator!r} is set but {e.args[0]} is not; multi-process runs need the coordinator "
            "address, the number of processes and this process's id (flags or EAGLE3_* environment)") from None
    except ValueError as e:
        raise ConfigError(f"number of processes and process id must be integers ({e})") from None
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"process id {process_id} must lie in [0, {num_processes})")
    if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


def is_writer() -> bool:
    """Only one process writes outputs and logs."""
    return jax.process_index() == 0


def fetch(x) -> np.ndarray:
    """A global array's full value on every process (device_get alone fails across processes)."""
    if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
