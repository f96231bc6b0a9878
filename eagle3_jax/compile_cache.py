"""JAX's persistent compilation cache under the project's cache directory: a second run of the same
pair reads its compiled programs from disk. Under ``num_draft_tokens: auto`` the chooser's
measurements are kept beside them (``calibration_dir``), so a second run starts from them too.
"""

from __future__ import annotations

import os

_enabled: str | None = None   # the directory enable() pointed JAX at

OFF_ENV = "EAGLE3_JAX_COMPILE_CACHE"   # "0" / "off": leave JAX's cache settings alone
CACHE_ENV = "EAGLE3_JAX_CACHE"          # the project's cache directory (default ~/.cache/eagle3_jax)


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "eagle3_jax")


def enable(path: str | None = None) -> str | None:
    """Points JAX's persistent cache at ``path`` (default: ``<cache_dir()>/xla``) and caches every
    program however quickly it compiled; returns the directory, or None when turned off."""
    global _enabled
    if os.environ.get(OFF_ENV, "").lower() in ("0", "off", "false", "no"):
        return None
    import jax

    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = path
    return path


def calibration_dir() -> str | None:
    """Where auto's measurements are kept: beside the compile cache, once ``enable`` turned it on."""
    return os.path.join(os.path.dirname(_enabled), "autodraft") if _enabled else None
