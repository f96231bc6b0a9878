"""What every config reader shares: YAML mappings, required fields, dtype names."""

from __future__ import annotations

import os
from typing import Any, Mapping

from eagle3_jax.errors import ConfigError


def read_yaml_mapping(path: str | os.PathLike, where: str | None = None) -> dict:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping); every
    settings file (serve, train, demo) is read through here so they fail the same way."""
    import yaml

    path = os.fspath(path)
    where = where or path
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: the file does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values at the top level, found "
                          f"{type(data).__name__}")
    return dict(data)


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: field '{key}' is required but missing; add it to config.json")
    return d[key]


def _is_llama3_rope(d: Mapping[str, Any]) -> bool:
    src = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return isinstance(src, Mapping) and src.get("rope_type", src.get("type")) == "llama3"


# Compute dtypes by the names users write (CLI flags, YAML, checkpoint torch_dtype).
DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype):
    """A dtype name ("float32", "bfloat16", "float16") or dtype object -> a numpy-compatible dtype."""
    import jax.numpy as jnp

    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not supported; use one of {sorted(DTYPES)}")
    return jnp.dtype(dtype)
