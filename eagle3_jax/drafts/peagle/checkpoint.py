"""SpecForge ``PEagleDraftModel`` tensors <-> our P-EAGLE draft: the name table, loading and export.

SpecForge persists the whole draft (P-EAGLE trains its embedding and mask state); the name table
is exactly that class's ``state_dict()`` keys, so an export loads there with ``strict=True``.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Mapping

import numpy as np
from flax import nnx

from eagle3_jax.checkpoint import store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.target_map import Rule, _linear, _linear_in, _same
from eagle3_jax.drafts.eagle3.names import _cast
from eagle3_jax.drafts.loaded import (LoadedDraft, build_draft, check_and_wire, draft_dtype, host_params, load_weights,
                                      n_aux_convert_table, open_reader, rule_tensors, write_staged)
from eagle3_jax.drafts.peagle.config import PEagleConfig
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.errors import CheckpointError


def peagle_rules(cfg: PEagleConfig, n_aux: int) -> list[Rule]:
    D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    W, F, X = cfg.draft_vocab_size, cfg.intermediate_size, n_aux * cfg.target_hidden_size
    rules = [
        _same(("embed_tokens",), "embed_tokens.weight"),
        _linear(("fc",), "fc.weight", X, (D,)),
        Rule(("mask_hidden",), ("mask_hidden",), lambda a: a[0].reshape(-1), lambda w: [np.asarray(w).reshape(1, 1, -1)]),
        _same(("norm", "weight"), "norm.weight"),
        _linear(("lm_head",), "lm_head.weight", D, (W,)),
        _cast(("d2t",), "d2t", np.int32, np.int64),
        _cast(("t2d",), "t2d", np.bool_, np.bool_),
    ]
    for i in range(cfg.num_hidden_layers):
        ours, disk = ("layers", i), f"layers.{i}."
        width = 2 * D if i == 0 else D
        at = ours + ("self_attn",)
        rules += [
            _same(ours + ("input_layernorm", "weight"), disk + "input_layernorm.weight"),
            _same(ours + ("post_attention_layernorm", "weight"), disk + "post_attention_layernorm.weight"),
            _linear(at + ("q_proj",), disk + "self_attn.q_proj.weight", width, (N, H)),
            _linear(at + ("k_proj",), disk + "self_attn.k_proj.weight", width, (G, H)),
            _linear(at + ("v_proj",), disk + "self_attn.v_proj.weight", width, (G, H)),
            _linear_in(at + ("o_proj",), disk + "self_attn.o_proj.weight", (N, H), D),
            _linear(ours + ("mlp", "gate"), disk + "mlp.gate_proj.weight", D, (F,)),
            _linear(ours + ("mlp", "up"), disk + "mlp.up_proj.weight", D, (F,)),
            _linear(ours + ("mlp", "down"), disk + "mlp.down_proj.weight", F, (D,)),
        ]
        if i == 0:
            rules.append(_same(ours + ("hidden_norm", "weight"), disk + "hidden_norm.weight"))
    return rules


def n_aux_of(reader: CheckpointReader, cfg: PEagleConfig, where: str) -> int:
    """How many target aux states ``fc`` fuses, read from its stored width."""
    if "fc.weight" not in reader or "mask_hidden" not in reader:
        raise CheckpointError(
            f"{where}: a P-EAGLE draft stores fc.weight and mask_hidden; found neither or one of them "
            f"({'fc.weight' in reader}, {'mask_hidden' in reader}). Is this a chain EAGLE-3 draft? Load it with load_draft")
    fc_in = reader.shape("fc.weight")[1]
    if fc_in % cfg.target_hidden_size:
        raise CheckpointError(
            f"{where}: fc.weight takes {fc_in} inputs, not a multiple of target_hidden_size={cfg.target_hidden_size}; "
            "fix target_hidden_size in config.json")
    return fc_in // cfg.target_hidden_size


def write_peagle(path: str | os.PathLike, cfg: PEagleConfig, flat: Mapping[tuple, np.ndarray], aux_layer_ids,
                 out_dtype=None, dtype_name: str | None = None, config_overrides: dict | None = None) -> None:
    """``write_staged`` in SpecForge's layout; config.json records the MASK token id too."""
    cfg.require_mask_token(os.fspath(path))
    write_staged(path, cfg, flat, aux_layer_ids, lambda cast: rule_tensors(peagle_rules(cfg, len(aux_layer_ids)), cast),
                 out_dtype, dtype_name, config_overrides)


def save(draft: LoadedDraft, path: str | os.PathLike, out_dtype=None, dtype_name: str | None = None,
         config_overrides: dict | None = None) -> None:
    write_peagle(path, draft.config, host_params(draft.model), draft.aux_layer_ids, out_dtype, dtype_name, config_overrides)


build_peagle_draft = partial(build_draft, PEagleDraft, own_embedding=True)


def load(path: str | os.PathLike, cfg: PEagleConfig, target, dtype=None) -> LoadedDraft:
    """A SpecForge-layout (or converted) P-EAGLE draft directory, checked against and wired to
    ``target`` (``check_and_wire``) before any weight is read."""
    where = os.fspath(path)
    cfg.require_mask_token(where)
    dtype = draft_dtype(dtype, target)
    reader = open_reader(path)
    n_aux = int(store.read_meta(path)["wiring"]["n_aux"]) if reader is None else n_aux_of(reader, cfg, where)
    if reader is None:
        d2t = store.restore_arrays(path, ["d2t"])["d2t"]
    else:   # a missing d2t is reported with every other missing tensor when the weights are read
        d2t = reader.read("d2t") if "d2t" in reader else None
    ids = check_and_wire(cfg, target, n_aux * cfg.target_hidden_size, d2t, cfg.hidden_size)
    if len(ids) != n_aux:
        raise CheckpointError(f"{where}: fc fuses {n_aux} aux states but the config names {len(ids)} layer ids {ids}")
    return load_weights(path, reader, nnx.eval_shape(lambda: PEagleDraft(cfg, n_aux, dtype, None)),
                        peagle_rules(cfg, n_aux), target, ids)


convert_table = n_aux_convert_table(PEagleDraft, peagle_rules)
