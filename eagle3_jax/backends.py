"""Which JAX backends start, and the compute dtype that suits the one that runs.

``quiet_without_tpu()`` runs first when ``eagle3_jax`` is imported. With libtpu installed and no
TPU attached, JAX's default start-up loads libtpu, which fails and prints errors that read as a
crash before anything of ours; we name the platforms that can run instead. A TPU host, a host
without libtpu and any explicit choice (``JAX_PLATFORMS``, ``JAX_FORCE_TPU_INIT``) are left alone.

``auto_dtype()``: XLA:CPU computes bfloat16 dots through float32 copies, so on a CPU host float32
is the faster compute dtype.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil

import jax

HALF_DTYPES = ("bfloat16", "float16")
CPU_HALF_NOTE = ("XLA:CPU computes bfloat16/float16 matmuls through float32 copies, so they run slower "
                 "than float32 here")


def tpu_attached() -> bool:
    """Whether this host has TPU chips, by JAX's own probe of the PCI bus (True where it cannot tell)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError, OSError):
        return True


def libtpu_installed() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _gpu_platforms() -> list[str]:
    """GPU platforms whose device nodes exist here and whose JAX plugin is installed."""
    plugins = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        import jax_plugins

        plugins |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    found = []
    # the device nodes JAX itself looks for before starting CUDA / ROCm
    if any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")) and \
            any("cuda" in p for p in plugins):
        found.append("cuda")
    if os.path.exists("/dev/kfd") and any("rocm" in p for p in plugins):
        found.append("rocm")
    return found


def quiet_without_tpu() -> str | None:
    """Leaves the TPU backend out of JAX's platforms where libtpu is installed but no TPU is
    attached; returns the platform list it set, or None where it changed nothing. Must run before
    any JAX backend starts (it does nothing once one has)."""
    from jax._src import xla_bridge

    if ("JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ or jax.config.jax_platforms
            or xla_bridge.backends_are_initialized() or not libtpu_installed() or tpu_attached()):
        return None
    platforms = ",".join(_gpu_platforms() + ["cpu"])
    jax.config.update("jax_platforms", platforms)
    return platforms


def auto_dtype(checkpoint_dtype: str, platform: str) -> tuple[str, str | None]:
    """(the compute dtype for ``--dtype auto``, why it differs from the checkpoint's, or None)."""
    if platform == "cpu" and checkpoint_dtype in HALF_DTYPES:
        return "float32", (f"computing in float32, not the checkpoint's {checkpoint_dtype}: {CPU_HALF_NOTE} "
                           f"(pass --dtype {checkpoint_dtype} to keep half the weight memory instead)")
    return checkpoint_dtype, None


def half_on_cpu_note(dtype: str, platform: str) -> str | None:
    """A one-line warning for an explicit half-precision compute dtype on a CPU host, else None."""
    if platform == "cpu" and dtype in HALF_DTYPES:
        return f"computing in {dtype} on a CPU host: {CPU_HALF_NOTE}; float32 is faster here"
    return None
