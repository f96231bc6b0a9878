"""What every kind's loader and exporter shares: a loaded draft bound to its target
(``LoadedDraft``), the wiring check run before a weight is placed, building, loading through a
name table, and the staged export."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint import store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.hf_loader import load_state
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
from eagle3_jax.checkpoint.staging import staged_dir, write_json_atomic
from eagle3_jax.config import resolve_dtype
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.errors import CheckpointError
from eagle3_jax.sharding import mesh_context, shard_state


@dataclass
class DraftOutput:
    logits: jax.Array   # [B, T, draft_vocab] float32
    hidden: jax.Array   # [B, T, D]


def _draft_call(graphdef, state, ids_BT, aux_BTX, embed_VD):
    draft = nnx.merge(graphdef, state)
    B, T = ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    step = draft(ids_BT, draft.fuse(aux_BTX), positions_BT, embed_VD, None)
    return step.logits_BTW, step.hidden_BTD


class LoadedDraft:
    """A draft of any kind checked against, and wired to, its target (a ``LoadedTarget``)."""

    def __init__(self, model, target, aux_layer_ids: tuple[int, ...]):
        self.model = model
        self.config = model.cfg
        self.target = target
        self.aux_layer_ids = aux_layer_ids
        self.graphdef, self.state = nnx.split(model)
        self._call = jax.jit(_draft_call, static_argnums=(0,))

    def forward(self, ids, aux_hidden) -> DraftOutput:
        """One causal pass (TTT step 0). ``ids[:, t]`` is the token after position t of ``aux_hidden``."""
        with mesh_context(self.target.mesh):
            logits, hidden = self._call(self.graphdef, self.state, jnp.asarray(ids, jnp.int32),
                                        jnp.asarray(aux_hidden), self.target.model.embed_tokens.value)
        return DraftOutput(logits=logits, hidden=hidden)


def check_and_wire(cfg, target, fc_in: int, d2t, own_embedding_width):
    """The draft's aux layer ids for ``target``, after every wiring contract is checked
    (``contracts.check_pairing``)."""
    ids = resolve_aux_ids(cfg, target.config)
    check_pairing(cfg, target.config, fc_in, len(ids), d2t, own_embedding_width)
    return ids


def draft_dtype(dtype, target):
    return resolve_dtype(dtype) if dtype is not None else target.dtype


def open_reader(path) -> CheckpointReader | None:
    """A reader of the draft's safetensors; None for a JAX checkpoint (``tools.convert``'s)."""
    return None if store.is_jax_checkpoint(path) else CheckpointReader(path)


def build_draft(module, cfg, target, dtype=None, seed: int = 0, own_embedding: bool = False, loaded=LoadedDraft):
    """A randomly initialised draft (``module(cfg, n_aux, dtype, rngs)``, with its own token embedding
    when ``own_embedding``) wired to ``target``, as ``loaded``."""
    dtype = draft_dtype(dtype, target)
    n_aux = len(resolve_aux_ids(cfg, target.config))
    ids = check_and_wire(cfg, target, n_aux * cfg.target_hidden_size, None, cfg.hidden_size if own_embedding else None)
    return loaded(placed(module(cfg, len(ids), dtype, nnx.Rngs(seed)), target.mesh), target, ids)


def load_weights(path, reader, abstract_model, rules, target, ids, fill=None, loaded=LoadedDraft):
    """``loaded`` holding the weights at ``path``: a JAX checkpoint's (``reader`` None) or the
    safetensors named by ``rules``; ``fill``: values of the tensors the checkpoint may omit."""
    graphdef, abstract = nnx.split(abstract_model)
    if reader is None:
        state = store.restore_state(path, abstract, target.mesh, kind="draft", fill=fill)
    else:
        state = load_state(reader, rules, abstract, mesh=target.mesh, where=os.fspath(path), fill=fill)
    return loaded(nnx.merge(graphdef, state), target, ids)


def ruled_table(rules, abstract_model) -> tuple[list, dict]:
    """(name table, our path -> abstract variable of each tensor it converts) for tools.convert. A
    tensor a draft may omit has no rule (the identity vocab map the model builds)."""
    ruled = {r.path for r in rules}
    return rules, {tuple(p): v for p, v in nnx.to_flat_state(nnx.split(abstract_model)[1]) if tuple(p) in ruled}


def n_aux_convert_table(module, rules):
    """The ``convert_table`` of a kind that stores every tensor, whose name table ``rules(cfg, n_aux)``
    needs only the number of fused states."""

    def convert_table(cfg, wiring: dict, dtype) -> tuple[list, dict]:
        n_aux = int(wiring["n_aux"])
        return ruled_table(rules(cfg, n_aux), nnx.eval_shape(lambda: module(cfg, n_aux, dtype, None)))

    return convert_table


def rule_tensors(rules, flat: Mapping[tuple, np.ndarray]):
    """Our params (path -> array) as checkpoint (name, array) pairs through the name table ``rules``."""
    for rule in rules:
        yield from zip(rule.hf_keys, rule.to_hf(np.asarray(flat[rule.path])))


def placed(model, mesh):
    """``model`` with its parameters laid out on ``mesh`` by their logical axes (as is without one)."""
    if mesh is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, shard_state(state, mesh))


def host_params(model) -> dict[tuple, np.ndarray]:
    """A draft module's state as our param path -> host array (the keys of the name tables)."""
    _, state = nnx.split(model)
    return {tuple(p): np.asarray(jax.device_get(v[...])) for p, v in nnx.to_flat_state(state)}


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
