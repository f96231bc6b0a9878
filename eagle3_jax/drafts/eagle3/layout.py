"""What an EAGLE-3 draft directory holds, read once for the loader and the converter alike, and the
writer of the SpecForge / SGLang layout.

A draft's config.json does not say everything its wiring needs: the fc width (so the number of
target aux states it fuses), whether it ships its own embedding, and which vocab maps it stores
are facts of the tensors. :func:`read_draft_layout` reads them from either kind of draft directory
(Hugging Face / SpecForge safetensors, or one converted by ``tools.convert``, from its metadata)
without reading any weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from eagle3_jax.checkpoint import store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.drafts.eagle3.names import iter_draft_tensors
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
from eagle3_jax.checkpoint.staging import staged_dir, write_json_atomic
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


def write_draft(path: str | os.PathLike, cfg, flat: Mapping[tuple, np.ndarray], aux_layer_ids, own_embedding: bool,
                out_dtype=None, dtype_name: str | None = None, config_overrides: dict | None = None) -> None:
    """Writes a draft's parameters (``flat``: our param path -> host array) in the SpecForge / SGLang
    layout: config.json (recording ``aux_layer_ids``) + model.safetensors, staged beside ``path``.

    ``out_dtype`` casts floating-point weights and is recorded as ``torch_dtype`` = ``dtype_name``.
    """
    write_staged(path, cfg, flat, aux_layer_ids,
                 lambda cast: iter_draft_tensors(cfg, dict(cast), len(aux_layer_ids), own_embedding),
                 out_dtype, dtype_name, config_overrides)


def write_staged(path, cfg, flat: Mapping[tuple, np.ndarray], aux_layer_ids, tensors, out_dtype=None,
                 dtype_name: str | None = None, config_overrides: dict | None = None) -> None:
    """The export every draft kind shares: refuses an existing ``path``, records the aux ids (and
    ``torch_dtype`` when ``out_dtype`` casts the floating-point weights) in config.json, and writes
    ``tensors(flat)`` (checkpoint name, array) pairs into a directory renamed to ``path`` when complete."""
    path = os.fspath(path)
    if os.path.exists(path):
        raise CheckpointError(f"{path} already exists; remove it or choose another output directory")
    hf = cfg.to_hf_dict()
    hf.setdefault("eagle_config", {})
    hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    hf["eagle_config"].setdefault("use_aux_hidden_state", True)
    if out_dtype is not None:
        flat = {k: (v.astype(out_dtype) if np.issubdtype(v.dtype, np.floating) or v.dtype.name == "bfloat16" else v)
                for k, v in flat.items()}
        hf["torch_dtype"] = dtype_name
    hf.update(config_overrides or {})
    with staged_dir(path) as tmp:
        with CheckpointWriter(tmp) as writer:
            for name, arr in tensors(flat):
                writer.add(name, arr)
        write_json_atomic(tmp / "config.json", hf, fsync=False)
