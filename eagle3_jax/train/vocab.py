"""The draft vocabulary: the target tokens the draft can propose, chosen by frequency.

The draft's lm_head covers only ``draft_vocab_size`` target tokens (often 32000 of 160k), the ones
most frequent among the tokens training asks it to predict (the loss-masked ones). Draft ids are
those target ids in increasing order, so ``target_id(i) = i + d2t[i]`` (SpecForge / SGLang) and
``t2d[v]`` says whether target token v has a draft id.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from eagle3_jax.checkpoint.staging import atomic_file
from eagle3_jax.errors import ConfigError


@dataclass(frozen=True)
class VocabMap:
    d2t: np.ndarray         # int32 [W]: target id of draft id i minus i
    t2d: np.ndarray         # bool [V]
    counts: np.ndarray      # int64 [V]: the frequencies it was built from


def token_counts(examples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """How often each target token occurs where the loss is taken, over (ids, loss_mask) pairs."""
    counts = np.zeros((vocab_size,), np.int64)
    for ids, mask in examples:
        ids = np.asarray(ids)[np.asarray(mask, bool)]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ConfigError(f"token id {int(ids.max())} outside the target vocab [0, {vocab_size}); "
                              "the data was tokenized for another model")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> VocabMap:
    """The ``draft_vocab_size`` most frequent tokens (ties: lower id first), ordered by target id;
    with fewer distinct tokens than slots, unseen ids from the lowest up fill the rest."""
    counts = np.asarray(counts, np.int64)
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} must lie in [1, vocab {V}]")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    chosen = np.sort(order[:draft_vocab_size])
    d2t = (chosen - np.arange(draft_vocab_size)).astype(np.int32)
    t2d = np.zeros((V,), bool)
    t2d[chosen] = True
    return VocabMap(d2t=d2t, t2d=t2d, counts=counts)


def load_or_build(path: str | os.PathLike, counts_fn, vocab_size: int, draft_vocab_size: int) -> VocabMap:
    """Reuses the map saved at ``path`` (a resumed run must keep its vocabulary), else builds and saves it."""
    path = os.fspath(path)
    if os.path.exists(path):
        with np.load(path) as z:
            vocab = VocabMap(d2t=z["d2t"].astype(np.int32), t2d=z["t2d"].astype(bool), counts=z["counts"])
        if len(vocab.t2d) != vocab_size or len(vocab.d2t) != draft_vocab_size:
            raise ConfigError(
                f"{path} maps a {len(vocab.t2d)}-token vocab onto {len(vocab.d2t)} draft ids, but this run "
                f"has vocab {vocab_size} and draft_vocab_size {draft_vocab_size}; use another out_dir or delete it")
        return vocab
    vocab = build_vocab_map(counts_fn(), draft_vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_file(path, "wb") as f:
        np.savez(f, d2t=vocab.d2t, t2d=vocab.t2d, counts=vocab.counts)
    return vocab
