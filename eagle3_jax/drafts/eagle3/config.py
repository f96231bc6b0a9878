"""``DraftConfig``: an EAGLE-3 draft in the SGLang / SpecForge ``LlamaForCausalLMEagle3`` layout."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from eagle3_jax.errors import ConfigError
from eagle3_jax.config.common import _is_llama3_rope, _require
from eagle3_jax.config.target import RopeConfig


DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3Draft")
# The EAGLE-3.1 flags (model.py says what each does), read as SGLang and vLLM read them: at the top
# level, or inside eagle_config where NVIDIA's checkpoints put them.
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default ids
    use_aux_hidden_state: bool = True
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], where: str = "draft config.json") -> "DraftConfig":
        archs = d.get("architectures") or []
        if archs and not any(a in DRAFT_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{where}: architectures {archs} is not an EAGLE-3 draft; expected one of {list(DRAFT_ARCHITECTURES)}. "
                "EAGLE-1/2 drafts (no aux hidden states) cannot serve as EAGLE-3 drafts"
            )
        eagle = d.get("eagle_config") or {}
        flags = {f: bool(eagle.get(f, d.get(f, False))) for f in EAGLE31_FLAGS}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        hidden = int(_require(d, "hidden_size", where))
        heads = int(_require(d, "num_attention_heads", where))
        rope = RopeConfig.from_hf(d, where) if not _is_llama3_rope(d) else None
        if rope is None:
            raise ConfigError(f"{where}: rope type 'llama3' is not supported for drafts; expected default or yarn")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(_require(d, "vocab_size", where)),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            **flags,
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            rope=rope,
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hf_config=json.loads(json.dumps(dict(d))),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}")
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise ConfigError(f"{where}: draft_vocab_size={cfg.draft_vocab_size} exceeds vocab_size={cfg.vocab_size}")
        return cfg

    def to_hf_dict(self) -> dict:
        if self.hf_config:
            return json.loads(json.dumps(self.hf_config))
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eagle_config": {"use_aux_hidden_state": self.use_aux_hidden_state},
        }
        if self.aux_layer_ids is not None:
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        for flag in ("norm_before_residual",) + EAGLE31_FLAGS:
            if getattr(self, flag):
                d[flag] = True
        return d
