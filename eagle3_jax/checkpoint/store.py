"""Our JAX checkpoint directory: orbax arrays + the Hugging Face config + a small metadata file.

Layout::

    DIR/
      config.json          the Hugging Face config, unchanged (so the model can be exported back)
      eagle3_jax.json      our metadata, written last: a directory without it is not a checkpoint
      params/part-00000/   orbax PyTree checkpoints of the flat parameter state, keyed by
      params/part-00001/   "layers.3.mlp.w_gate"-style names; each part holds whole parameters
      ...                  (tokenizer / generation_config files copied alongside, if any)

Why parts rather than one orbax checkpoint: an orbax save takes the whole tree in memory, and the
models are far bigger than host memory; orbax's incremental ("partial") saving rewrites its
metadata on every call and slows down with the number of calls. So parameters stream into parts of
a bounded size, each an ordinary orbax PyTree checkpoint; ``eagle3_jax.json`` says which holds which.

Restoring never builds a host copy of the model: on a mesh each part is restored by orbax straight
into the shardings (``sharding.state_shardings``) and dtypes of the abstract model state; without a
mesh, one part at a time passes through host memory onto the default device.

``eagle3_jax.json``::

    {"format": "eagle3-jax-checkpoint", "format_version": 1, "kind": "target" | "draft",
     "architecture": ..., "dtype": "source" | "bfloat16" | ...,
     "parts": ["part-00000", ...],
     "params": {name: {"path": [...], "shape": [...], "dtype": "bfloat16", "part": "part-00000"}},
     "hf": {...what the exporter needs to reproduce the Hugging Face tensors...}, ...}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from eagle3_jax.checkpoint.hf_loader import raise_mismatch
from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.errors import CheckpointError
from eagle3_jax.sharding import state_shardings

META_FILE = "eagle3_jax.json"
FORMAT = "eagle3-jax-checkpoint"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
# Default bound on the bytes buffered before a part is written. One part is written in the
# background while the next is assembled, so a conversion holds about two parts. Smaller parts pay
# orbax's per-save overhead more often, larger ones wait longer for the last write.
DEFAULT_PART_BYTES = 256 * 10**6
# zarr chunks within one array stay below this, so restoring a shard of a huge expert stack reads
# only the chunks that shard needs, not the whole array.
CHUNK_BYTES = 256 * 2**20


def param_name(path) -> str:
    return ".".join(str(p) for p in path)


def dtype_from_name(name: str) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError:
        raise CheckpointError(f"{META_FILE}: unknown dtype '{name}'") from None


def is_jax_checkpoint(path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path) -> dict:
    p = Path(path) / META_FILE
    if not p.is_file():
        raise CheckpointError(
            f"{path}: no {META_FILE}, so this is not a complete eagle3-jax checkpoint (an interrupted "
            "conversion leaves none); convert again with `python -m tools.convert to-jax`")
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e}); convert the checkpoint again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                              f"expected '{FORMAT}'")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{p}: format_version {meta.get('format_version')} is not the {FORMAT_VERSION} this version "
            "reads; convert the original checkpoint again with this version")
    return meta


def _checkpointer():
    # No compression: zstd saves little on weights and slows saving several times over.
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _writing_checkpointer():
    """Without orbax's defensive deep copy of host arrays (the writer never touches one again), and
    in the background: the next part is read and transposed while the previous one is written."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, th.ArrayHandler()),
    )
    return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry))


class StoreWriter:
    """Streams parameters into ``DIR/params/part-*``; ``close(meta)`` writes eagle3_jax.json last."""

    def __init__(self, directory, part_bytes: int = DEFAULT_PART_BYTES):
        self.directory = Path(directory)
        (self.directory / PARAMS_DIR).mkdir(parents=True, exist_ok=False)
        if part_bytes <= 0:
            raise ValueError(f"part_bytes must be positive, got {part_bytes}")
        self.part_bytes = part_bytes
        self.params: dict[str, dict] = {}
        self.parts: list[str] = []
        self._pending: dict[str, Any] = {}
        self._pending_bytes = 0
        self._ckpt = _writing_checkpointer()

    def _part_name(self) -> str:
        return f"part-{len(self.parts):05d}"

    def add(self, path, array) -> None:
        """``array``: numpy, or a jax.Array (already sharded: its shards set the chunk layout)."""
        name = param_name(path)
        if name in self.params:
            raise CheckpointError(f"parameter {name} added twice (internal)")
        nbytes = int(np.prod(array.shape)) * jnp.dtype(array.dtype).itemsize
        if self._pending and self._pending_bytes + nbytes > self.part_bytes:
            self.flush()
        self.params[name] = {"path": list(path), "shape": list(array.shape), "dtype": jnp.dtype(array.dtype).name,
                             "part": self._part_name()}
        self._pending[name] = array
        self._pending_bytes += nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        name = self._part_name()
        save_args = {k: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for k in self._pending}
        self._ckpt.wait_until_finished()  # at most one part in flight: memory stays ~2 parts
        self._ckpt.save((self.directory / PARAMS_DIR / name).absolute(),
                        args=ocp.args.PyTreeSave(self._pending, save_args=save_args))
        self.parts.append(name)
        self._pending = {}
        self._pending_bytes = 0

    def abort(self) -> None:
        """Stop cleanly after a failure: let an in-flight part finish before the caller deletes
        the directory; the directory is incomplete (no eagle3_jax.json) either way."""
        self._pending = {}
        try:
            self._ckpt.wait_until_finished()
        except Exception:  # the failure being handled is the one worth reporting
            pass
        self._ckpt.close()

    def close(self, meta: Mapping[str, Any]) -> dict:
        self.flush()
        self._ckpt.wait_until_finished()
        self._ckpt.close()
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta,
                "parts": list(self.parts), "params": self.params}
        write_json_atomic(self.directory / META_FILE, full)
        return full


def _restore_part(directory: Path, part: str, abstract: dict, restore_args: dict) -> dict:
    path = (directory / PARAMS_DIR / part).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{directory}: {META_FILE} names {PARAMS_DIR}/{part}, which is missing; "
                              "the checkpoint is incomplete: convert it again")
    try:
        return _checkpointer().restore(path, args=ocp.args.PyTreeRestore(abstract, restore_args=restore_args,
                                                                           partial_restore=True))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{path}: cannot restore {sorted(abstract)[:3]}...: {e}") from e


def _restore_host(directory: Path, part: str, dtypes: Mapping[str, Any], cast: bool = False) -> dict:
    """Parameters of one part (name -> dtype) as host numpy arrays, cast to those dtypes if ``cast``."""
    abstract = {n: np.empty((0,), dt) for n, dt in dtypes.items()}
    args = {n: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dt if cast else None) for n, dt in dtypes.items()}
    return _restore_part(directory, part, abstract, args)


def iter_params(directory, max_bytes: int = 256 * 2**20) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host numpy array) in the order written, restored a few at a time: each orbax call
    takes consecutive parameters of one part up to ``max_bytes`` (or one larger parameter), so
    host memory stays about one parameter whatever the part size was."""
    directory = Path(directory)
    meta = read_meta(directory)
    params = meta["params"]

    def nbytes(n):
        return int(np.prod(params[n]["shape"])) * dtype_from_name(params[n]["dtype"]).itemsize

    groups: list[list[str]] = []
    size = 0
    for name in params:
        if groups and params[groups[-1][0]]["part"] == params[name]["part"] and size + nbytes(name) <= max_bytes:
            groups[-1].append(name)
            size += nbytes(name)
        else:
            groups.append([name])
            size = nbytes(name)
    for names in groups:
        values = _restore_host(directory, params[names[0]]["part"],
                               {n: dtype_from_name(params[n]["dtype"]) for n in names})
        for n in names:
            yield n, values.pop(n)


def restore_arrays(directory, names) -> dict[str, np.ndarray]:
    """A few named parameters as host numpy arrays (e.g. a draft's vocab map, checked before loading)."""
    directory = Path(directory)
    meta = read_meta(directory)
    out = {}
    for part in dict.fromkeys(meta["params"][n]["part"] for n in names):
        out.update(_restore_host(directory, part, {n: dtype_from_name(meta["params"][n]["dtype"])
                                                   for n in names if meta["params"][n]["part"] == part}))
    return out


def restore_state(directory, abstract_state: nnx.State, mesh: jax.sharding.Mesh | None = None,
                  kind: str | None = None, fill: Mapping | None = None) -> nnx.State:
    """Fills ``abstract_state`` (from ``nnx.eval_shape``) from our checkpoint, in the model's dtypes
    (how: the module docstring). ``fill``: values (path -> array) for parameters it may omit."""
    directory = Path(directory)
    meta = read_meta(directory)
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"{directory}: holds a {meta.get('kind')} checkpoint, expected a {kind}")
    flat = {tuple(path): var for path, var in nnx.to_flat_state(abstract_state)}
    shardings = ({tuple(p): v.value for p, v in nnx.to_flat_state(state_shardings(abstract_state, mesh))}
                 if mesh is not None else None)
    stored = meta["params"]
    fill = {tuple(p): v for p, v in (fill or {}).items() if param_name(p) not in stored}
    for path, value in fill.items():
        value = jnp.asarray(value, flat[path].value.dtype)
        flat[path].value = jax.device_put(value, shardings[path]) if mesh is not None else value
    names = {param_name(p): p for p in flat if p not in fill}
    missing = sorted(set(names) - set(stored))
    unexpected = sorted(set(stored) - set(names))
    bad = [f"{n}: stored {tuple(stored[n]['shape'])}, config implies {tuple(flat[names[n]].value.shape)}"
           for n in sorted(set(names) & set(stored))
           if tuple(stored[n]["shape"]) != tuple(flat[names[n]].value.shape)]
    raise_mismatch(directory, "parameter", missing, unexpected,
                   [f"{len(bad)} shape mismatch(es): " + "; ".join(bad[:5])] if bad else [],
                   ". config.json and the stored arrays disagree: convert the checkpoint again")
    by_part: dict[str, list[str]] = {}
    for name in names:
        by_part.setdefault(stored[name]["part"], []).append(name)
    for part, part_names in by_part.items():
        if mesh is None:
            # One device: through host numpy like the Hugging Face loader, so both give the same
            # (uncommitted, default-device) arrays and share compiled code.
            values = _restore_host(directory, part, {n: flat[names[n]].value.dtype for n in part_names}, cast=True)
            for n in part_names:
                flat[names[n]].value = jnp.asarray(values.pop(n))
            continue
        abstract = {n: jax.ShapeDtypeStruct(flat[names[n]].value.shape, flat[names[n]].value.dtype,
                                            sharding=shardings[names[n]]) for n in part_names}
        values = _restore_part(directory, part, abstract, ocp.checkpoint_utils.construct_restore_args(abstract))
        for n in part_names:
            flat[names[n]].value = values[n]
    return nnx.from_flat_state(list(flat.items()))
