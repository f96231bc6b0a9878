"""``TargetConfig``: a DeepSeek-V3-architecture model (DeepSeek-V3/R1, Kimi-K2, the language model of
Kimi-K2.5) from its Hugging Face ``config.json``. Every shape and routing constant the model code uses
lives here; ``models/`` never hardcodes one."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from eagle3_jax.errors import ConfigError
from eagle3_jax.config.common import _require

log = logging.getLogger(__name__)

# Architectures whose weights we can read as a target, and where their LM fields live.
TARGET_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "",
    "KimiK25ForConditionalGeneration": "language_model.",
}
TARGET_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
NESTED_TEXT_MODEL_TYPES = ("kimi_k25",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: plain RoPE or YaRN (DeepSeek-V3 / Kimi style)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None and 0 mean "not given": YaRN's attention factor then comes from ``factor`` alone.
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], where: str = "config") -> "RopeConfig":
        """Reads either the older ``rope_scaling`` + ``rope_theta`` fields or transformers 5's
        ``rope_parameters`` dict (which carries the theta itself)."""
        src = next((dict(m) for m in (d.get("rope_parameters"), d.get("rope_scaling")) if isinstance(m, Mapping) and m),
                   {})
        theta = src.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = src.get("rope_type", src.get("type", "default")) or "default"
        if rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"{where}: rope type '{rope_type}' is not supported; expected 'default' or 'yarn' "
                "(DeepSeek-V3, Kimi-K2 and Kimi-K2.5 use 'yarn')"
            )
        if rope_type == "default":
            return cls(theta=float(theta))
        factor = float(_require(src, "factor", f"{where}.rope_scaling"))
        if factor < 1.0:
            raise ConfigError(f"{where}: YaRN factor must be >= 1, found {factor}")
        return cls(
            theta=float(theta),
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=src.get("original_max_position_embeddings"),
            beta_fast=float(src.get("beta_fast") or 32.0),
            beta_slow=float(src.get("beta_slow") or 1.0),
            mscale=None if src.get("mscale") is None else float(src["mscale"]),
            mscale_all_dim=None if src.get("mscale_all_dim") is None else float(src["mscale_all_dim"]),
            attention_factor=src.get("attention_factor"),
            truncate=bool(src.get("truncate", True)),
        )


@dataclass(frozen=True)
class TargetConfig:
    """A DeepSeek-V3-architecture MoE language model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    # The q/kv latent norms inside MLA use their own epsilon in the reference implementations
    # (the RMSNorm default), not rms_norm_eps.
    latent_rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    model_type: str = "deepseek_v3"
    # Key prefix of the language model's tensors on disk ("language_model." for Kimi-K2.5).
    weight_prefix: str = ""
    # The config.json this was read from, kept so a converted checkpoint can write it back.
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def check_aux_layer_ids(self, aux_layer_ids, where: str = "aux layer ids") -> tuple[int, ...]:
        """The ids as a tuple, or a ConfigError when one names no layer of this model."""
        L = self.num_hidden_layers
        ids = tuple(int(i) for i in aux_layer_ids)
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            raise ConfigError(
                f"{where} {list(ids)}: {bad} outside the target's layers 0..{L - 1}. Id i means the output of "
                f"layer i (SGLang/SpecForge convention); for this {L}-layer target the default is "
                f"{list(self.default_aux_layer_ids())}"
            )
        return ids

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        """SGLang/SpecForge default: outputs of layers 1, L//2-1, L-4 (streams entering 2, L//2, L-3)."""
        L = self.num_hidden_layers
        return (1, L // 2 - 1, L - 4)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], where: str = "config.json") -> "TargetConfig":
        archs = d.get("architectures") or []
        outer_type = d.get("model_type")
        prefix = ""
        text = d
        if "text_config" in d and (
            outer_type in NESTED_TEXT_MODEL_TYPES or "KimiK25ForConditionalGeneration" in archs
        ):
            text = dict(d["text_config"])
            prefix = TARGET_ARCHITECTURES["KimiK25ForConditionalGeneration"]
            if d.get("vision_config") is not None:
                log.info("%s: vision tower present; skipped (only the language model is served)", where)
            where = f"{where}.text_config"
        elif "text_config" in d:
            raise ConfigError(
                f"{where}: nested text_config under model_type '{outer_type}' is not a known layout; "
                "expected model_type 'kimi_k25' or architecture KimiK25ForConditionalGeneration"
            )
        model_type = text.get("model_type", outer_type)
        if model_type not in TARGET_MODEL_TYPES:
            raise ConfigError(
                f"{where}: model_type '{model_type}' is not a DeepSeek-V3-architecture model; "
                f"expected one of {TARGET_MODEL_TYPES} (or 'kimi_k25' with a nested text_config)"
            )

        def get(key, default=None, required=False):
            if required:
                return _require(text, key, where)
            v = text.get(key, default)
            return default if v is None else v

        eos = get("eos_token_id", d.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),)
        )
        n_heads = int(get("num_attention_heads", required=True))
        n_kv = int(get("num_key_value_heads", n_heads))
        if n_kv != n_heads:
            raise ConfigError(
                f"{where}: num_key_value_heads={n_kv} differs from num_attention_heads={n_heads}; "
                "MLA expands every head from the shared latent, so they must be equal"
            )
        def ints(defaults: dict) -> dict:   # a default of None: required
            return {k: int(get(k, v, required=v is None)) for k, v in defaults.items()}

        cfg = cls(
            **ints({"vocab_size": None, "hidden_size": None, "intermediate_size": None, "moe_intermediate_size": None,
                    "num_hidden_layers": None, "first_k_dense_replace": 0, "n_routed_experts": 0,
                    "n_shared_experts": 0, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}),
            num_attention_heads=n_heads,
            q_lora_rank=None if text.get("q_lora_rank") is None else int(text["q_lora_rank"]),
            **ints(dict.fromkeys(("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))),
            scoring_func=str(get("scoring_func", "sigmoid")),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            moe_layer_freq=int(get("moe_layer_freq", 1)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(text, where),
            rope_interleave=bool(get("rope_interleave", True)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
            bos_token_id=get("bos_token_id", d.get("bos_token_id")),
            eos_token_ids=eos_ids,
            hidden_act=str(get("hidden_act", "silu")),
            model_type=str(model_type),
            weight_prefix=prefix,
            hf_config=json.loads(json.dumps(dict(d))),
        )
        cfg.validate(where)
        return cfg

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "TargetConfig":
        """Reads ``config.json`` from a checkpoint directory (or the file itself)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.isfile(p):
            raise ConfigError(f"no config.json at {p}; point at a Hugging Face checkpoint directory")
        try:
            with open(p) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d, where=p)

    def to_hf_dict(self) -> dict:
        """The config.json this config came from (or an equivalent one for configs built in code)."""
        if self.hf_config:
            return json.loads(json.dumps(self.hf_config))
        ours = ("latent_rms_norm_eps", "rope", "eos_token_ids", "weight_prefix", "hf_config")   # not HF's as they are
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ours}
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["num_key_value_heads"] = self.num_attention_heads
        d["topk_method"] = "noaux_tc"
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        d["rope_theta"] = self.rope.theta
        if self.rope.rope_type == "yarn":
            r = self.rope
            d["rope_scaling"] = {
                "type": "yarn", "rope_type": "yarn", "factor": r.factor,
                "original_max_position_embeddings": r.original_max_position_embeddings,
                "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "mscale": r.mscale,
                "mscale_all_dim": r.mscale_all_dim,
            }
        else:
            d["rope_scaling"] = None
        return d

    def replace(self, **changes) -> "TargetConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self, where: str = "TargetConfig") -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                    "num_experts_per_tok", "n_group", "topk_group", "moe_layer_freq")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{where}: {name} must be a positive integer, found {v!r}")
        moe, per_group = self.n_routed_experts > 0, self.n_routed_experts // self.n_group
        for ok, problem in (
                (self.qk_rope_head_dim % 2 == 0,
                 f"qk_rope_head_dim must be even for rotary pairs, found {self.qk_rope_head_dim}"),
                (self.q_lora_rank is None or self.q_lora_rank > 0,
                 f"q_lora_rank must be null or positive, found {self.q_lora_rank}"),
                (0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                 f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
                 f"[0, num_hidden_layers={self.num_hidden_layers}]"),
                (self.scoring_func in ("sigmoid", "softmax"),
                 f"scoring_func '{self.scoring_func}' unsupported; expected 'sigmoid' or 'softmax'"),
                (self.hidden_act == "silu", f"hidden_act '{self.hidden_act}' unsupported; expected 'silu'"),
                (not moe or self.moe_intermediate_size > 0,
                 f"moe_intermediate_size must be positive, found {self.moe_intermediate_size}"),
                (not moe or self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}"),
                (not moe or self.topk_group <= self.n_group,
                 f"topk_group={self.topk_group} exceeds n_group={self.n_group}"),
                (not moe or self.n_group == 1 or per_group >= 2,
                 "group-limited routing scores a group by its top-2 experts, so each of the "
                 f"{self.n_group} groups needs >= 2 experts; found {per_group}"),
                (not moe or self.num_experts_per_tok <= self.topk_group * per_group,
                 f"num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                 f"{self.topk_group} x {per_group} experts the group limit leaves"),
                *((0 <= t < self.vocab_size, f"eos_token_id {t} lies outside the vocab [0, {self.vocab_size})")
                  for t in self.eos_token_ids)):
            if not ok:
                raise ConfigError(f"{where}: {problem}")
