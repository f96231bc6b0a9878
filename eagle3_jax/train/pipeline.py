"""The grain input pipeline: padded rows -> ``shuffle(seed) -> repeat -> batch`` -> arrays on the mesh.

One conversation a row, right-padded (id 0, mask 0), with its length. Rows are not packed: the
target's attention has no document boundaries, so a packed row would let one conversation's tokens
shape another's hidden states. The iterator's state (a position) is saved with each checkpoint.
"""

from __future__ import annotations

import functools
from typing import Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.errors import ConfigError
from eagle3_jax.sharding import DATA_AXIS
from eagle3_jax.train.data import Example


class TokenizedSource:
    """Padded rows from tokenized examples (random access, for grain)."""

    def __init__(self, examples: Sequence[Example], max_len: int):
        self.examples = examples
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        ids = np.zeros((self.max_len,), np.int32)
        mask = np.zeros((self.max_len,), bool)
        ids[:len(ex.ids)] = ex.ids
        mask[:len(ex.loss_mask)] = ex.loss_mask
        # the row's own length: SpecForge's loss convention divides by the longest row of a batch
        return {"index": np.int32(i), "ids": ids, "loss_mask": mask, "length": np.int32(len(ex.ids))}

    def iter_tokens(self):
        for ex in self.examples:
            yield ex.ids, ex.loss_mask


def make_dataset(source, batch_size: int, seed: int, rows: tuple[int, int] | None = None) -> grain.MapDataset:
    """Deterministic per-epoch shuffle, endless epochs, fixed-size batches, over row indices: every
    process walks the same global batches and reads only its ``rows=(lo, hi)`` of each (default: all)."""
    if len(source) == 0:
        raise ConfigError("the training data is empty")
    lo, hi = rows if rows is not None else (0, batch_size)
    if not 0 <= lo < hi <= batch_size:
        raise ConfigError(f"rows {lo}:{hi} are not a slice of a {batch_size}-row batch")
    batches = grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(None).batch(batch_size,
                                                                                          drop_remainder=True)
    return batches.map(functools.partial(_read_rows, source, lo, hi))


def _read_rows(source, lo: int, hi: int, indices: np.ndarray) -> dict:
    rows = [source[int(i)] for i in indices[lo:hi]]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_iterator(dataset: grain.MapDataset, prefetch: int = 4):
    """An iterator with ``get_state()`` / ``set_state()``, reading a few batches ahead (grain's
    default would hold hundreds of batches of aux states in memory when they come from disk)."""
    options = grain.ReadOptions(num_threads=min(4, prefetch), prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


# ---------------------------------------------------------------------- batches on the mesh
def check_process_mesh(mesh) -> None:
    if jax.process_count() == 1:
        return
    n = jax.device_count()
    if mesh is None or mesh.devices.size != n:
        found = "no mesh" if mesh is None else f"mesh {dict(mesh.shape)} ({mesh.devices.size} devices)"
        raise ConfigError(
            f"a {jax.process_count()}-process run trains on one mesh over all {n} devices, found {found}; set "
            f"mesh: data=D,expert=E,tensor=T with D*E*T = {n}")


def local_rows(mesh, batch_size: int, grad_accum: int) -> tuple[int, int]:
    """The rows [lo, hi) of each batch that this process's devices hold (all of them in one process)."""
    B = batch_size
    if mesh is None or jax.process_count() == 1:
        return 0, B
    rows = set()
    for index in NamedSharding(mesh, P(None, DATA_AXIS)).addressable_devices_indices_map((grad_accum, B)).values():
        rows.update(range(*index[1].indices(B)))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError(f"process {jax.process_index()}'s devices hold rows {sorted(rows)} of each batch, not "
                          "one contiguous block; order the mesh's devices by process (make_mesh does)")
    return lo, hi


def replicated(x, mesh):
    if mesh is None:
        return x
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def device_batch(rows: list[dict], mesh, batch_size: int) -> dict:
    """[grad_accum, this process's rows, ...] arrays -> the global [grad_accum, batch_size, ...] ones,
    rows on the mesh's ``data`` axis."""
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "index"}
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    sharding = NamedSharding(mesh, P(None, DATA_AXIS))
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0], batch_size) + v.shape[2:])
            for k, v in batch.items()}
