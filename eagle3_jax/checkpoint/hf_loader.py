"""Apply a rule table (target_map, or a draft kind's name table) to a safetensors checkpoint, producing
an nnx State placed on a mesh, one parameter's tensors at a time (host memory: about the largest
parameter, one layer's expert stack)."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.errors import CheckpointError
from eagle3_jax.sharding import sharding_for

log = logging.getLogger(__name__)


def load_state(
    reader: CheckpointReader,
    rules: Iterable,
    abstract_state: nnx.State,
    *,
    prefix: str = "",
    ignore: Callable[[str], bool] = lambda key: False,
    read: Callable[[CheckpointReader, str], np.ndarray] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    where: str = "",
    fill: dict | None = None,
) -> nnx.State:
    """Fills ``abstract_state`` (from ``nnx.eval_shape``) with tensors named by ``rules``; every
    missing, unexpected or mis-shaped tensor is reported in one CheckpointError, so a bad checkpoint
    is fixed in one pass. ``fill`` gives values (path -> array) for parameters it may omit."""
    read = read or (lambda r, key: r.read(key))
    rules = list(rules)
    flat = {tuple(path): var for path, var in nnx.to_flat_state(abstract_state)}
    bad_shape = []
    skipped = check_keys(reader.keys(), rules, prefix=prefix, ignore=ignore, where=where)
    if skipped:
        log.info("%s: skipped %d tensors not used for serving (e.g. %s)", where, len(skipped), skipped[:3])

    values = {}
    for rule in rules:
        var = flat.get(rule.path)
        if var is None:
            raise CheckpointError(f"{where}: rule for {rule.path} has no matching model parameter (internal)")
        arrays = [read(reader, prefix + k) for k in rule.hf_keys]
        try:
            value = rule.to_ours(arrays)
        except ValueError as e:
            bad_shape.append(f"{rule.hf_keys[0]}: {[a.shape for a in arrays[:2]]} cannot form {var.value.shape} ({e})")
            continue
        if value.shape != var.value.shape:
            bad_shape.append(
                f"{prefix + rule.hf_keys[0]}: found {tuple(arrays[0].shape)}, "
                f"config implies {tuple(var.value.shape)} in our layout")
            continue
        dtype = var.value.dtype
        if mesh is not None:
            sharding = sharding_for(mesh, getattr(var, "axes", None), value.shape)
            values[rule.path] = jax.device_put(value.astype(dtype), sharding)
        else:
            values[rule.path] = jnp.asarray(value, dtype=dtype)
    if bad_shape:
        raise CheckpointError(
            f"{where}: {len(bad_shape)} tensor(s) have shapes that disagree with config.json: "
            + "; ".join(bad_shape[:5]) + ". Use the config.json that came with these weights.")
    for path, value in (fill or {}).items():
        if path not in values:
            values[path] = jnp.asarray(value, dtype=flat[path].value.dtype)
    if len(values) != len(flat):
        left = sorted(set(flat) - set(values), key=str)
        raise CheckpointError(f"{where}: no tensor rule for parameters {left[:5]} (internal)")
    for path, var in flat.items():
        var.value = values[path]
    return nnx.from_flat_state(list(flat.items()))


def check_keys(on_disk: Iterable[str], rules: Iterable, *, prefix: str = "",
               ignore: Callable[[str], bool] = lambda key: False, where: str = "") -> list[str]:
    """Raises one CheckpointError listing every missing and unexpected tensor; returns the
    on-disk tensors ``ignore`` skipped (not used by the model)."""
    on_disk = set(on_disk)
    used: set[str] = set()
    missing = []
    for rule in rules:
        keys = [prefix + k for k in rule.hf_keys]
        used.update(keys)
        missing += [k for k in keys if k not in on_disk and k + "_packed" not in on_disk]
    # A quantized weight is stored as several tensors (weight + scales); those count as used.
    for k in list(on_disk):
        base = _quantized_base(k)
        if base is not None and base in used:
            used.add(k)
    unexpected = sorted(k for k in on_disk - used if not ignore(k))
    raise_mismatch(where or "checkpoint", "tensor", missing, unexpected, [],
                   ". The tensors do not match config.json: check that the config belongs to these weights "
                   "(layer count, q_lora_rank, expert count, first_k_dense_replace)")
    return sorted(on_disk - used)


def raise_mismatch(where, noun: str, missing: list, unexpected: list, more: list[str], fix: str) -> None:
    """Raises one CheckpointError listing every missing and unexpected ``noun`` (then ``more``), if any."""
    parts = [f"{len(names)} {what} {noun}(s), e.g. {names[:5]}"
             for what, names in (("missing", missing), ("unexpected", unexpected)) if names] + more
    if parts:
        raise CheckpointError(f"{where}: " + "; ".join(parts) + fix)


QUANT_SUFFIXES = ("_scale_inv", "_packed", "_scale", "_shape", "_zero_point")


def _quantized_base(key: str) -> str | None:
    for suffix in QUANT_SUFFIXES:
        if key.endswith("weight" + suffix):
            return key[: -len(suffix)]
    return None
