"""An EAGLE-3 draft directory: its layout, loader and writer (SpecForge / SGLang layout).

Some wiring facts are facts of the tensors, not of config.json: the fc width (so the number of aux
states fused), an own embedding, the stored vocab maps. :func:`read_draft_layout` reads them from
safetensors headers or a converted checkpoint's metadata, without reading any weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
from flax import nnx

from eagle3_jax.checkpoint import store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.drafts.eagle3.names import draft_rules, iter_draft_tensors
from eagle3_jax.drafts.loaded import (LoadedDraft, build_draft, check_and_wire, draft_dtype, host_params, load_weights,
                                      open_reader, ruled_table, write_staged)
from eagle3_jax.errors import CheckpointError

VOCAB_MAPS = ("d2t", "t2d")


@dataclass(frozen=True)
class DraftLayout:
    """The wiring facts of a draft's stored tensors."""

    where: str
    fc_out: int                      # fc.weight is [fc_out, fc_in]
    fc_in: int                       # n_aux x target hidden
    own_embedding: bool              # ships embed_tokens (else shares the target's)
    embed_width: int | None          # embed_tokens' width when it has one
    vocab_maps: tuple[str, ...]      # which of d2t / t2d are stored
    _read: Callable[[str], np.ndarray] = field(repr=False, compare=False)

    def d2t(self) -> np.ndarray | None:
        """The stored draft -> target id offsets (None without one); reads that one small tensor."""
        return self._read("d2t") if "d2t" in self.vocab_maps else None

    def wiring(self, target_hidden_size: int) -> dict:
        """JSON-able {n_aux, own_embedding, vocab_maps}: what the rule tables need to be rebuilt."""
        if self.fc_in % target_hidden_size:
            raise CheckpointError(
                f"{self.where}: fc.weight is [{self.fc_out}, {self.fc_in}] but {self.fc_in} is not a multiple of "
                f"target_hidden_size={target_hidden_size}; fc must take n_aux x target hidden inputs. Fix "
                "target_hidden_size in config.json")
        return {"n_aux": self.fc_in // target_hidden_size, "own_embedding": self.own_embedding,
                "vocab_maps": list(self.vocab_maps)}


def _no_fc(where) -> CheckpointError:
    return CheckpointError(
        f"{where}: no fc.weight, so this is not an EAGLE-3 draft (EAGLE-3 fuses the target's aux hidden states "
        "with fc); an EAGLE-1/2 draft cannot be served or converted as EAGLE-3")


def read_draft_layout(path: str | os.PathLike, reader: CheckpointReader | None = None) -> DraftLayout:
    """The layout of the draft at ``path``: a JAX (orbax) checkpoint from its metadata, otherwise its
    safetensors (through ``reader`` when the caller has one open, else a new one)."""
    where = os.fspath(path)
    if store.is_jax_checkpoint(path):
        stored = store.read_meta(path)["params"]
        if "fc" not in stored:
            raise _no_fc(where)
        fc_out, fc_in = stored["fc"]["shape"][1], stored["fc"]["shape"][0]  # ours is [in, out]
        embed = stored.get("embed_tokens")
        return DraftLayout(where, fc_out, fc_in, embed is not None, embed["shape"][1] if embed else None,
                           tuple(m for m in VOCAB_MAPS if m in stored),
                           lambda name: store.restore_arrays(path, [name])[name])
    reader = reader if reader is not None else CheckpointReader(path)
    if "fc.weight" not in reader:
        raise _no_fc(where)
    fc_out, fc_in = reader.shape("fc.weight")
    own = "embed_tokens.weight" in reader
    return DraftLayout(where, fc_out, fc_in, own, reader.shape("embed_tokens.weight")[1] if own else None,
                       tuple(m for m in VOCAB_MAPS if m in reader), reader.read)


def load(path: str | os.PathLike, cfg: DraftConfig, target, dtype=None) -> LoadedDraft:
    """The draft at ``path`` (config ``cfg``, already read and preflighted) for ``target``, every
    wiring contract (``check_and_wire``) checked before a single weight is placed."""
    path = os.fspath(path)
    dtype = draft_dtype(dtype, target)
    reader = open_reader(path)
    layout = read_draft_layout(path, reader)
    own_embedding, maps, d2t = layout.own_embedding, layout.vocab_maps, layout.d2t()
    ids = check_and_wire(cfg, target, layout.fc_in, d2t, layout.embed_width)
    fill = {}   # a missing d2t is the identity map: preflight refused one missing with draft_vocab_size < vocab_size
    if "d2t" not in maps:
        fill[("d2t",)] = np.zeros((cfg.draft_vocab_size,), np.int32)
    if "t2d" not in maps:
        t2d = np.zeros((cfg.vocab_size,), bool)
        t2d[np.arange(cfg.draft_vocab_size) + (d2t if d2t is not None else 0)] = True
        fill[("t2d",)] = t2d
    abstract = nnx.eval_shape(lambda: Draft(cfg, len(ids), dtype, None, own_embedding=own_embedding))
    return load_weights(path, reader, abstract, draft_rules(cfg, len(ids), own_embedding, maps), target, ids, fill)


build = partial(build_draft, Draft)


def save(draft: LoadedDraft, path: str | os.PathLike, out_dtype=None, dtype_name: str | None = None,
         config_overrides: dict | None = None) -> None:
    """``write_staged`` in the SpecForge / SGLang layout."""
    own_embedding, n_aux = draft.model.embed_tokens is not None, len(draft.aux_layer_ids)
    write_staged(path, draft.config, host_params(draft.model), draft.aux_layer_ids,
                 lambda cast: iter_draft_tensors(draft.config, dict(cast), n_aux, own_embedding),
                 out_dtype, dtype_name, config_overrides)


def wiring(path, reader: CheckpointReader, cfg: DraftConfig) -> dict:
    """What tools.convert records beside the config to rebuild the name table (``DraftLayout.wiring``)."""
    return read_draft_layout(path, reader).wiring(cfg.target_hidden_size)


def convert_table(cfg: DraftConfig, wiring: dict, dtype) -> tuple[list, dict]:
    """(name table, our path -> abstract variable) of the tensors a stored draft with ``wiring`` has."""
    n_aux, own = int(wiring["n_aux"]), bool(wiring["own_embedding"])
    return ruled_table(draft_rules(cfg, n_aux, own, tuple(wiring["vocab_maps"])),
                       nnx.eval_shape(lambda: Draft(cfg, n_aux, dtype, None, own_embedding=own)))
