"""The grain input pipeline: padded rows -> ``shuffle(seed) -> repeat -> batch``.

One conversation a row, right-padded (id 0, mask 0), with its length. Rows are not packed: the
target's attention has no document boundaries, so a packed row would let one conversation's tokens
shape another's hidden states. Shuffling is per epoch and deterministic, and the iterator's state (a position) is
saved with each checkpoint.
"""

from __future__ import annotations

import functools
from typing import Sequence

import grain
import numpy as np

from eagle3_jax.errors import ConfigError
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
    """Deterministic per-epoch shuffle, endless epochs, fixed-size batches.

    The shuffle and batching run over row indices, so every process of a multi-process run walks the
    same global batches; ``rows=(lo, hi)`` then reads only rows ``lo:hi`` of each (this process's
    share of the ``data`` axis). The default reads whole batches.
    """
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
    """An iterator with ``get_state()`` / ``set_state()`` (saved with checkpoints).

    A few batches are read ahead on a few threads (grain's default, 500 elements on 16 threads, would
    hold hundreds of batches of aux states in memory when they come from disk).
    """
    options = grain.ReadOptions(num_threads=min(4, prefetch), prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))
