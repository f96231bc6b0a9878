"""SGLang / SpecForge ``LlamaForCausalLMEagle3`` tensor names <-> our draft parameters: one table
(target_map's ``Rule``s), used for loading and for export."""

from __future__ import annotations

import numpy as np

from eagle3_jax.checkpoint.target_map import Rule, _linear, _linear_in, _same
from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.drafts.loaded import rule_tensors


def _cast(path, key, mem_dtype, disk_dtype):
    """Vocab maps: int64 / bool on disk, int32 / bool in memory."""
    return Rule(path, (key,), lambda a: a[0].astype(mem_dtype), lambda w: [np.asarray(w).astype(disk_dtype)])


def draft_rules(cfg: DraftConfig, n_aux: int, own_embedding: bool, vocab_maps: tuple[str, ...] = ("d2t", "t2d")
                ) -> list[Rule]:
    """``vocab_maps``: which of d2t / t2d the checkpoint stores (both, in SpecForge exports)."""
    D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    W, F = cfg.draft_vocab_size, cfg.intermediate_size
    X = n_aux * cfg.target_hidden_size
    at = ("self_attn",)
    rules = [
        _linear(("fc",), "fc.weight", X, (D,)),
        _same(("input_layernorm", "weight"), "midlayer.input_layernorm.weight"),
        _same(("hidden_norm", "weight"), "midlayer.hidden_norm.weight"),
        _same(("post_attention_layernorm", "weight"), "midlayer.post_attention_layernorm.weight"),
        _linear(at + ("q_proj",), "midlayer.self_attn.q_proj.weight", 2 * D, (N, H)),
        _linear(at + ("k_proj",), "midlayer.self_attn.k_proj.weight", 2 * D, (G, H)),
        _linear(at + ("v_proj",), "midlayer.self_attn.v_proj.weight", 2 * D, (G, H)),
        _linear_in(at + ("o_proj",), "midlayer.self_attn.o_proj.weight", (N, H), D),
        _linear(("mlp", "gate"), "midlayer.mlp.gate_proj.weight", D, (F,)),
        _linear(("mlp", "up"), "midlayer.mlp.up_proj.weight", D, (F,)),
        _linear(("mlp", "down"), "midlayer.mlp.down_proj.weight", F, (D,)),
        _same(("norm", "weight"), "norm.weight"),
        _linear(("lm_head",), "lm_head.weight", D, (W,)),
    ]
    if cfg.norm_before_fc:
        rules.append(_same(("input_norm", "weight"), "input_norm.weight"))
    if cfg.fc_norm:   # ours stacks the per-state norms: [n_aux, target hidden]
        rules.append(Rule(("fc_norm",), tuple(f"fc_norm.{i}.weight" for i in range(n_aux)),
                          lambda a: np.stack(a), lambda w: list(w)))
    if "d2t" in vocab_maps:
        rules.append(_cast(("d2t",), "d2t", np.int32, np.int64))
    if "t2d" in vocab_maps:
        rules.append(_cast(("t2d",), "t2d", np.bool_, np.bool_))
    if own_embedding:
        rules.append(_same(("embed_tokens",), "embed_tokens.weight"))
    return rules


def iter_draft_tensors(cfg: DraftConfig, flat_params: dict, n_aux: int, own_embedding: bool):
    """Our draft params (path -> array) as SpecForge/SGLang (name, array) pairs."""
    return rule_tensors(draft_rules(cfg, n_aux, own_embedding), flat_params)
