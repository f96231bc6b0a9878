"""Hugging Face DeepseekV3 / Kimi tensor names <-> our target parameters.

One table of rules: each of our parameters names the on-disk tensors it comes from and how the
layout changes (HF linears are [out, in]; ours are einsum-ready [in, ..., out]; routed experts are
per-expert keys on disk and one stacked [E, ...] array here). The same rules run both ways, so
loading and exporting cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from eagle3_jax.config import TargetConfig

Path = tuple


@dataclass(frozen=True)
class Rule:
    path: Path                       # our nnx state path
    hf_keys: tuple[str, ...]         # on-disk names (without the weight prefix)
    to_ours: Callable[[Sequence[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


def _same(path, key):
    return Rule(path, (key,), lambda a: a[0], lambda w: [w])


def _linear(path, key, in_shape, out_shape):
    """HF [prod(out_shape), prod(in_shape)] -> ours [*in_shape, *out_shape] (an int: one axis)."""
    in_shape, out_shape = (tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in (in_shape, out_shape))
    n_in = math.prod(in_shape)
    return Rule(
        path, (key,),
        lambda a: np.ascontiguousarray(a[0].T).reshape(in_shape + out_shape),
        lambda w: [np.ascontiguousarray(w.reshape(n_in, -1).T)],
    )


_linear_in = _linear  # the draft tables' name for projections with several input axes, e.g. o_proj


def _experts(path, keys):
    """E per-expert [out, in] tensors -> ours [E, in, out]."""
    return Rule(
        path, tuple(keys),
        lambda a: np.stack([np.ascontiguousarray(x.T) for x in a]),
        lambda w: [np.ascontiguousarray(x.T) for x in w],
    )


def target_rules(cfg: TargetConfig) -> list[Rule]:
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    H, C, P = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    O = cfg.v_head_dim
    rules = [_same(("embed_tokens",), "model.embed_tokens.weight"), _same(("norm", "weight"), "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        rules.append(_linear(("lm_head",), "lm_head.weight", D, (V,)))
    for i in range(cfg.num_hidden_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "self_attn")
        rules += [
            _same(("layers", i, "input_layernorm", "weight"), pre + "input_layernorm.weight"),
            _same(("layers", i, "post_attention_layernorm", "weight"), pre + "post_attention_layernorm.weight"),
            _linear(at + ("kv_a_proj_with_mqa",), pre + "self_attn.kv_a_proj_with_mqa.weight", D, (C + P,)),
            _same(at + ("kv_a_layernorm", "weight"), pre + "self_attn.kv_a_layernorm.weight"),
            _linear(at + ("kv_b_proj",), pre + "self_attn.kv_b_proj.weight", C, (N, cfg.qk_nope_head_dim + O)),
            _linear(at + ("o_proj",), pre + "self_attn.o_proj.weight", (N, O), D),
        ]
        if cfg.q_lora_rank is None:
            rules.append(_linear(at + ("q_proj",), pre + "self_attn.q_proj.weight", D, (N, H)))
        else:
            Q = cfg.q_lora_rank
            rules += [
                _linear(at + ("q_a_proj",), pre + "self_attn.q_a_proj.weight", D, (Q,)),
                _same(at + ("q_a_layernorm", "weight"), pre + "self_attn.q_a_layernorm.weight"),
                _linear(at + ("q_b_proj",), pre + "self_attn.q_b_proj.weight", Q, (N, H)),
            ]
        mlp = ("layers", i, "mlp")
        if cfg.is_moe_layer(i):
            F, E = cfg.moe_intermediate_size, cfg.n_routed_experts
            rules += [
                _linear(mlp + ("gate",), pre + "mlp.gate.weight", D, (E,)),
                _same(mlp + ("e_score_correction_bias",), pre + "mlp.gate.e_score_correction_bias"),
                _experts(mlp + ("w_gate",), [f"{pre}mlp.experts.{e}.gate_proj.weight" for e in range(E)]),
                _experts(mlp + ("w_up",), [f"{pre}mlp.experts.{e}.up_proj.weight" for e in range(E)]),
                _experts(mlp + ("w_down",), [f"{pre}mlp.experts.{e}.down_proj.weight" for e in range(E)]),
            ]
            if cfg.n_shared_experts > 0:
                Fs = F * cfg.n_shared_experts
                rules += [
                    _linear(mlp + ("shared_experts", "gate"), pre + "mlp.shared_experts.gate_proj.weight", D, (Fs,)),
                    _linear(mlp + ("shared_experts", "up"), pre + "mlp.shared_experts.up_proj.weight", D, (Fs,)),
                    _linear(mlp + ("shared_experts", "down"), pre + "mlp.shared_experts.down_proj.weight", Fs, (D,)),
                ]
        else:
            F = cfg.intermediate_size
            rules += [
                _linear(mlp + ("gate",), pre + "mlp.gate_proj.weight", D, (F,)),
                _linear(mlp + ("up",), pre + "mlp.up_proj.weight", D, (F,)),
                _linear(mlp + ("down",), pre + "mlp.down_proj.weight", F, (D,)),
            ]
    return rules


def is_ignored_key(cfg: TargetConfig, key: str) -> bool:
    """On-disk tensors we knowingly skip: multi-token-prediction layers past num_hidden_layers
    (DeepSeek-V3's layer 61), rotary caches some exporters save, and Kimi-K2.5's vision side."""
    if cfg.weight_prefix and not key.startswith(cfg.weight_prefix):
        return True
    key = key[len(cfg.weight_prefix):]
    if key.startswith("model.layers."):
        try:
            layer = int(key.split(".")[2])
        except ValueError:
            return False
        if layer >= cfg.num_hidden_layers:
            return True
    return key.endswith("rotary_emb.inv_freq")


def iter_hf_tensors(cfg: TargetConfig, flat_params: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Our params (path -> array) as on-disk (name, array) pairs, in rule order."""
    for rule in target_rules(cfg):
        arrays = rule.to_hf(np.asarray(flat_params[rule.path]))
        for key, arr in zip(rule.hf_keys, arrays):
            yield cfg.weight_prefix + key, arr
