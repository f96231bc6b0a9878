"""Compiling for TPU on a machine without one: topologies, meshes, and the TPU compiler's numbers.

libtpu (the ``tpu`` extra) can compile for a TPU slice that is not attached: the devices of
``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)`` describe the
slice, a mesh built from them gives shardings, and ``jax.jit(f).lower(*ShapeDtypeStructs).compile()``
runs the real TPU compiler (deviceless ahead-of-time compilation). ``memory_analysis()`` and
``cost_analysis()`` of the result are that compiler's own per-chip figures. This works in a process
whose JAX runs on the CPU (``JAX_PLATFORMS=cpu``, fake host devices included): nothing here touches
the default backend.

Names accepted by libtpu 0.0.42: ``v4:2x2x1``, ``v5e:2x4``, ``v5p:2x2x1``, ``v5p:2x2x2``, ``v5p:2x2x4``,
``v6e:2x4``, ``v6e:4x4``, ... (``generation:AxBxC``, chips per dimension).

Everything here is "compiled for", never "ran on": no figure comes from a TPU executing anything.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from eagle3_jax import backends
from eagle3_jax.errors import ConfigError

# The TPU compiler's message when a program does not fit, e.g. "... the total memory required for HLO
# temporaries (122.66G) exceeds available HBM (95.74G)": G there is 2^30 bytes.
_OOM = re.compile(r"required for .*?\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)")
_UNIT = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


@contextlib.contextmanager
def held_stderr():
    """Holds back what native code writes to stderr (fd 2) inside the block, and shows it if the
    block raises: libtpu prints its failed start-up there when it loads on a host without a TPU."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
    """The TPU devices (one per chip) of a slice such as ``v5p:2x2x2``, for compiling only."""
    if not backends.libtpu_installed():
        raise ConfigError(f"compiling for TPU topology '{topology}' needs libtpu; install the tpu extra "
                          "(pip install -e '.[tpu]')")
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for processes that own TPU
    # chips; compiling only owns none, and parallel test workers (or two planners) each load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        # Without a TPU, loading libtpu prints its failed start-up (no host bounds, no worker
        # hostnames), which compiling does not need: held back unless the load fails.
        with contextlib.nullcontext() if backends.tpu_attached() else held_stderr():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu raises a plain runtime error for unknown names
        raise ConfigError(f"TPU topology '{topology}' is not known to the installed libtpu ({e}); expected a "
                          "name such as v5p:2x2x2, v5e:2x4 or v6e:2x4") from e
    return tuple(desc.devices)


def topology_mesh(topology: str, spec: str | None = None) -> jax.sharding.Mesh:
    """A (data, expert, tensor) mesh over a topology's devices, from ``data=1,expert=8,tensor=1``
    (default: every chip on the expert axis), built by the same ``sharding.make_mesh`` as serving."""
    from eagle3_jax.sharding import make_mesh

    return make_mesh(spec, topology_devices(topology))


def chips(topology: str) -> int:
    return len(topology_devices(topology))


def device_kind(topology: str) -> str:
    return topology_devices(topology)[0].device_kind


@functools.lru_cache(maxsize=None)
def chip_hbm_bytes(topology: str) -> int:
    """HBM per chip as the TPU compiler counts it when deciding whether a program fits.

    Read from the compiler itself (deviceless devices report no memory stats): a program that
    cannot fit is compiled and the available HBM it names is parsed, so the figure is the one the
    compiler's own verdicts use (v5p: 95.74 GiB, v6e: 31.25 GiB with libtpu 0.0.42).
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(list(topology_devices(topology))[:1], ("chip",))
    too_big = jax.jit(lambda: jnp.zeros((2 ** 40,), jnp.int8), out_shardings=NamedSharding(mesh, P()))
    try:
        too_big.lower().compile()
    except Exception as e:  # noqa: BLE001 - the message is what we read
        m = _OOM.search(str(e))
        if m:
            return int(float(m.group(3)) * _UNIT[m.group(4)])
        raise RuntimeError(f"could not read the HBM size of {topology} from the TPU compiler: {e}") from e
    raise RuntimeError(f"the TPU compiler accepted a 1 TiB buffer on one {topology} chip; cannot read its HBM")


@dataclass
class CompiledStats:
    """One program compiled for one platform: bytes per chip (device), the cost analysis, times.

    ``fits`` is False when the compiler refused the program for lack of HBM; then only ``peak``
    (what the compiler said it needed) and ``hbm`` are known and the other byte counts are None.
    """

    name: str
    platform: str
    lower_s: float
    compile_s: float
    fits: bool
    argument: int | None = None
    output: int | None = None
    alias: int | None = None
    temp: int | None = None
    code: int | None = None
    peak: int | None = None
    hbm: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    estimated_seconds: float | None = None   # the compiler's "optimal_seconds": an estimate, not a run
    error: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per computation
        cost = cost[0] if cost else {}
    return cost or {}


def compile_stats(fn, args: Sequence[Any], kwargs: dict | None = None, name: str = "program",
                  hbm: int | None = None, compiler_options: dict | None = None,
                  inspect: Callable[[Any], None] | None = None) -> CompiledStats:
    """Lowers and compiles a jitted ``fn`` on abstract ``args`` (ShapeDtypeStructs whose shardings
    name the target devices) and reads memory and cost per device.

    ``peak`` = arguments + outputs not aliased to (donated) arguments + temporaries: the bytes the
    program holds at once on one device. A TPU compile that runs out of HBM is returned with
    ``fits=False`` and the compiler's figure, not raised: not fitting is an answer. ``inspect``, if
    given, is called with the compiled program (to read its HLO, say) before it is dropped.
    """
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **(kwargs or {}))
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    except Exception as e:  # noqa: BLE001 - only the out-of-memory refusal is an answer
        m = _OOM.search(str(e))
        if not m:
            raise
        return CompiledStats(name, _platform(args), t1 - t0, time.perf_counter() - t1, False,
                             peak=int(float(m.group(1)) * _UNIT[m.group(2)]),
                             hbm=int(float(m.group(3)) * _UNIT[m.group(4)]), error=str(e).splitlines()[0][:300])
    t2 = time.perf_counter()
    if inspect is not None:
        inspect(compiled)
    mem = compiled.memory_analysis()
    if mem is None:
        raise RuntimeError("this XLA backend reports no memory analysis for compiled programs")
    cost = _cost(compiled)
    arg, out, alias, temp = (int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                             int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes))
    peak = arg + max(0, out - alias) + temp
    return CompiledStats(
        name, _platform(args), t1 - t0, t2 - t1, hbm is None or peak <= hbm, arg, out, alias, temp,
        int(mem.generated_code_size_in_bytes), peak, hbm,
        flops=_num(cost.get("flops")), bytes_accessed=_num(cost.get("bytes accessed")),
        estimated_seconds=_duration(cost.get("optimal_seconds")))


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _duration(v) -> float | None:
    """The cost model's time estimate, or None where it gives none. For some programs it returns a
    negative figure, a sentinel and not a time: the tiny config's chunked prefill -7.0 s, the demo
    target's decode loop, Kimi-K2.5's full 61-layer decode and prefill about -120 s each."""
    v = _num(v)
    return v if v is not None and v > 0 else None


def _platform(args) -> str:
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()
