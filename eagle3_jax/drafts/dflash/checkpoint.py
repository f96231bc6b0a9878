"""SpecForge ``DFlashDraftModel`` tensors <-> our DFlash draft: the name table (exactly that class's
``state_dict()`` keys; no embedding, no head: the target's), loading, export, and the loaded draft.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint import store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.target_map import Rule, _linear, _linear_in, _same
from eagle3_jax.drafts.dflash.config import DFlashConfig
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.loaded import (LoadedDraft, build_draft, check_and_wire, draft_dtype, host_params, load_weights,
                                      n_aux_convert_table, open_reader, rule_tensors, write_staged)
from eagle3_jax.errors import CheckpointError, ConfigError
from eagle3_jax.sharding import mesh_context


def _bias(path, key, shape):
    return Rule(path, (key,), lambda a: a[0].reshape(shape), lambda w: [np.asarray(w).reshape(-1)])


def mla_rules(cfg: DFlashConfig, at: tuple, dat: str) -> list[Rule]:
    """One layer's MLA attention (ours under ``at``, on disk under ``dat``): SpecForge's names."""
    m, D, N = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    C, P, Z, Y = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
        rules = [_linear(at + ("q_proj",), dat + "q_proj.weight", D, (N, Z + P))]
        biases = [("q_bias", "q_proj", (N, Z + P))]
    else:
        Q = m.q_lora_rank
        rules = [_linear(at + ("q_a_proj",), dat + "q_a_proj.weight", D, (Q,)),
                 _same(at + ("q_a_layernorm", "weight"), dat + "q_a_layernorm.weight"),
                 _linear(at + ("q_b_proj",), dat + "q_b_proj.weight", Q, (N, Z + P))]
        biases = [("q_a_bias", "q_a_proj", (Q,)), ("q_b_bias", "q_b_proj", (N, Z + P))]
    rules += [_linear(at + ("kv_a_proj_with_mqa",), dat + "kv_a_proj_with_mqa.weight", D, (C + P,)),
              _same(at + ("kv_a_layernorm", "weight"), dat + "kv_a_layernorm.weight"),
              _linear(at + ("kv_b_proj",), dat + "kv_b_proj.weight", C, (N, Z + Y)),
              _linear_in(at + ("o_proj",), dat + "o_proj.weight", (N, Y), D)]
    if m.output_gate:
        rules.append(_linear(at + ("g_proj",), dat + "g_proj.weight", D, (N, Y)))
    if cfg.attention_bias:
        biases += [("kv_a_bias", "kv_a_proj_with_mqa", (C + P,)), ("kv_b_bias", "kv_b_proj", (N, Z + Y)),
                   ("o_bias", "o_proj", (D,))]
        rules += [_bias(at + (ours,), f"{dat}{disk}.bias", shape) for ours, disk, shape in biases]
    return rules


def dflash_rules(cfg: DFlashConfig, n_aux: int) -> list[Rule]:
    D, N, G, H, F = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.intermediate_size)
    rules = [
        _linear(("fc",), "fc.weight", n_aux * D, (D,)),
        _same(("hidden_norm", "weight"), "hidden_norm.weight"),
        _same(("norm", "weight"), "norm.weight"),
    ]
    for i in range(cfg.num_hidden_layers):
        ours, disk = ("layers", i), f"layers.{i}."
        at, dat = ours + ("self_attn",), disk + "self_attn."
        rules += [
            _same(ours + ("input_layernorm", "weight"), disk + "input_layernorm.weight"),
            _same(ours + ("post_attention_layernorm", "weight"), disk + "post_attention_layernorm.weight"),
            _linear(ours + ("mlp", "gate"), disk + "mlp.gate_proj.weight", D, (F,)),
            _linear(ours + ("mlp", "up"), disk + "mlp.up_proj.weight", D, (F,)),
            _linear(ours + ("mlp", "down"), disk + "mlp.down_proj.weight", F, (D,)),
        ]
        if cfg.mla is not None:
            rules += mla_rules(cfg, at, dat)
            continue
        rules += [
            _linear(at + ("q_proj",), dat + "q_proj.weight", D, (N, H)),
            _linear(at + ("k_proj",), dat + "k_proj.weight", D, (G, H)),
            _linear(at + ("v_proj",), dat + "v_proj.weight", D, (G, H)),
            _linear_in(at + ("o_proj",), dat + "o_proj.weight", (N, H), D),
            _same(at + ("q_norm", "weight"), dat + "q_norm.weight"),
            _same(at + ("k_norm", "weight"), dat + "k_norm.weight"),
        ]
        if cfg.attention_bias:
            heads = {"q": (N, H), "k": (G, H), "v": (G, H)}
            rules += [_bias(at + (f"{p}_bias",), f"{dat}{p}_proj.bias", shape) for p, shape in heads.items()]
            rules.append(_same(at + ("o_bias",), dat + "o_proj.bias"))
    return rules


class LoadedDFlash(LoadedDraft):
    """A DFlash draft wired to its target (a ``LoadedTarget``), which captures its ``aux_layer_ids``."""

    def __init__(self, model: DFlashDraft, target, aux_layer_ids: tuple[int, ...]):
        super().__init__(model, target, aux_layer_ids)
        self._blocks = jax.jit(_blocks_call, static_argnums=(0,))

    def forward(self, ids, aux_hidden):
        raise ConfigError("a DFlash draft has no one-step causal pass; use forward_blocks (blocks at anchors)")

    def forward_blocks(self, ids, aux_hidden, anchors, keep=None):
        """The blocks' outputs [B, N * block, D] and the target head's logits of them (float32), for
        blocks anchored at ``anchors`` [B, N] over a sequence ``ids`` [B, S] whose target states at
        the draft's layers are ``aux_hidden`` [B, S, n_aux * D]."""
        anchors = jnp.asarray(anchors, jnp.int32)
        keep = jnp.ones(anchors.shape, bool) if keep is None else jnp.asarray(keep, bool)
        t = self.target.model
        head_DV = t.embed_tokens[...].T if t.lm_head is None else t.lm_head[...]   # tied: the embedding
        with mesh_context(self.target.mesh):
            return self._blocks(self.graphdef, self.state, t.embed_tokens[...], head_DV, jnp.asarray(ids, jnp.int32),
                                jnp.asarray(aux_hidden), anchors, keep)


def _blocks_call(graphdef, state, embed_VD, head_DV, ids_BS, aux_BSX, anchor_BN, keep_BN):
    draft = nnx.merge(graphdef, state)
    out_BTD = draft.forward_blocks(aux_BSX, embed_VD, ids_BS, anchor_BN, keep_BN)
    return out_BTD, jnp.einsum("btd,dv->btv", out_BTD, head_DV).astype(jnp.float32)


build = partial(build_draft, DFlashDraft, loaded=LoadedDFlash)


def load(path: str | os.PathLike, cfg: DFlashConfig, target, dtype=None) -> LoadedDFlash:
    """A SpecForge-layout (or converted) DFlash draft directory, checked against and wired to
    ``target`` (the pair preflighted by ``load_draft``) before any weight is placed."""
    where = os.fspath(path)
    dtype = draft_dtype(dtype, target)
    reader = open_reader(path)
    fc_in = (int(store.read_meta(path)["wiring"]["n_aux"]) * target.config.hidden_size if reader is None
             else _fc_in(where, reader))
    ids = check_and_wire(cfg, target, fc_in, None, None)
    return load_weights(path, reader, nnx.eval_shape(lambda: DFlashDraft(cfg, len(ids), dtype, None)),
                        dflash_rules(cfg, len(ids)), target, ids, loaded=LoadedDFlash)


def save(draft: LoadedDraft, path: str | os.PathLike, out_dtype=None, dtype_name: str | None = None,
         config_overrides: dict | None = None) -> None:
    """config.json (recording the target layers read) + model.safetensors in SpecForge's layout."""
    cfg, ids = draft.config, [int(i) for i in draft.aux_layer_ids]
    overrides = {"dflash_config": {**(cfg.to_hf_dict().get("dflash_config") or {}), "target_layer_ids": ids},
                 **(config_overrides or {})}
    write_staged(path, cfg, host_params(draft.model), ids, lambda cast: rule_tensors(dflash_rules(cfg, len(ids)), cast),
                 out_dtype, dtype_name, overrides)


def _fc_in(path, reader: CheckpointReader) -> int:
    if "fc.weight" not in reader:
        raise CheckpointError(f"{os.fspath(path)}: no fc.weight; a DFlash draft fuses the target's states with fc")
    return reader.shape("fc.weight")[1]


def wiring(path, reader: CheckpointReader, cfg: DFlashConfig) -> dict:
    """What tools.convert records beside the config to rebuild the name table: the fused states' count."""
    return {"n_aux": _fc_in(path, reader) // cfg.hidden_size}


convert_table = n_aux_convert_table(DFlashDraft, dflash_rules)
