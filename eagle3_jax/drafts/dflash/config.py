"""``DFlashConfig``: a DFlash block draft in SpecForge's ``DFlashDraftModel`` layout (a Qwen3 config).

What config.json carries beyond Qwen3's fields:
- ``block_size`` (top level or in dflash_config): tokens per block; one pass guesses ``block_size - 1``;
- ``dflash_config.target_layer_ids``: the target layers read, in the EAGLE-3 aux convention; absent,
  SpecForge spreads them over ``num_target_layers`` (:func:`default_target_layer_ids`);
- ``dflash_config.mask_token_id``: the token fed at the positions still to be guessed;
- ``layer_types`` (``full_attention`` / ``sliding_attention``) with ``sliding_window``;
- ``dflash_config.attention_mode``: ``gqa`` (the default; ``mha`` is the same layer) or ``mla``, the
  DeepSeek-V3 parameterization from the top-level ``q_lora_rank`` .. ``v_head_dim`` (:class:`DFlashMLA`).
The draft reads the target's ``embed_tokens`` and ``lm_head``; variants with a head of their own
(``dflash_config.projector_type``: Domino, DSpark) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from eagle3_jax.config.common import _require
from eagle3_jax.config.target import RopeConfig
from eagle3_jax.errors import ConfigError

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
FULL, SLIDING = "full_attention", "sliding_attention"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """SpecForge's spread: one id per draft layer, evenly from layer 1 to L - 3 (the middle for one)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashMLA:
    """The MLA shape of a DFlash draft with ``attention_mode: mla``."""

    q_lora_rank: int | None   # None: the queries are one projection of the layer input
    kv_lora_rank: int
    qk_nope_head_dim: int     # may be 0: every q.k dimension rotated
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True
    output_gate: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], extra: Mapping[str, Any], where: str) -> "DFlashMLA":
        """The fields SpecForge's MLA attention reads, with its rules (checked before any weight)."""
        dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in dims if d.get(k) is None]
        if missing:
            raise ConfigError(f"{where}: dflash_config.attention_mode='mla' needs {list(dims)} (and q_lora_rank, "
                              f"null for a direct query projection); missing {missing}: add them to config.json")
        q = d.get("q_lora_rank")
        mla = cls(q_lora_rank=None if q is None else int(q), **{k: int(d[k]) for k in dims},
                  rope_interleaved=bool(extra.get("mla_rope_interleaved", d.get("rope_interleave", True))),
                  output_gate=bool(extra.get("mla_use_output_gate", d.get("mla_use_output_gate", False))))
        bad = [f"q_lora_rank={q} (positive or null)"] if q is not None and mla.q_lora_rank <= 0 else []
        bad += [f"{k}={getattr(mla, k)} (positive)" for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
                if getattr(mla, k) <= 0]
        bad += [f"qk_nope_head_dim={mla.qk_nope_head_dim} (0 or more)"] if mla.qk_nope_head_dim < 0 else []
        bad += [f"qk_rope_head_dim={mla.qk_rope_head_dim} (even: rotary pairs)"] if mla.qk_rope_head_dim % 2 else []
        if bad:
            raise ConfigError(f"{where}: MLA dimensions out of range: {', '.join(bad)}; fix them in config.json")
        return mla

    def to_hf(self) -> tuple[dict, dict]:
        """(top-level fields, dflash_config fields) as SpecForge writes them."""
        return ({"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                 "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                 "v_head_dim": self.v_head_dim},
                {"attention_mode": "mla", "mla_rope_interleaved": self.rope_interleaved,
                 "mla_use_output_gate": self.output_gate})


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    block_size: int
    aux_layer_ids: tuple[int, ...]   # dflash_config.target_layer_ids (or SpecForge's spread over num_target_layers)
    mask_token_id: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    mla: DFlashMLA | None = None    # set: the layers attend with MLA, not GQA
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # What the shared wiring contracts read (contracts.check_pairing, preflight): the draft reads the
    # target's states at its own width and guesses target ids through the target's head.
    use_aux_hidden_state = True

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a q.k head: the whole head, or MLA's rope part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], where: str = "draft config.json") -> "DFlashConfig":
        if not any(a in DFLASH_ARCHITECTURES for a in d.get("architectures") or []):
            raise ConfigError(f"{where}: architectures {d.get('architectures')} is not a DFlash draft; "
                              f"expected {list(DFLASH_ARCHITECTURES)}")
        extra = d.get("dflash_config") or {}
        if extra.get("projector_type") is not None:
            raise ConfigError(
                f"{where}: dflash_config.projector_type={extra['projector_type']!r} is a DFlash variant with a head "
                "of its own (Domino, DSpark), which is not implemented here; only plain DFlash drafts load")
        mode = str(extra.get("attention_mode", "gqa")).lower()
        if mode not in ("gqa", "mha", "mla"):
            raise ConfigError(f"{where}: dflash_config.attention_mode={extra['attention_mode']!r}; expected 'gqa' "
                              "(the default), 'mha' or 'mla'")
        mla = DFlashMLA.from_hf(d, extra, where) if mode == "mla" else None
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act={d['hidden_act']!r}; DFlash layers are SwiGLU (silu)")
        hidden = int(_require(d, "hidden_size", where))
        heads = int(_require(d, "num_attention_heads", where))
        layers = int(_require(d, "num_hidden_layers", where))
        types = tuple(d.get("layer_types") or (FULL,) * layers)
        if len(types) != layers or set(types) - {FULL, SLIDING}:
            raise ConfigError(f"{where}: layer_types {list(types)} must name {layers} layers, each "
                              f"{FULL!r} or {SLIDING!r}")
        window = d.get("sliding_window")
        if SLIDING in types and not (window and int(window) > 0):
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window, found {window}")
        ids = extra.get("target_layer_ids")
        if ids is None and d.get("num_target_layers"):
            ids = default_target_layer_ids(int(d["num_target_layers"]), layers)
        if ids is None:   # SpecForge's class cannot be built without one of them either
            raise ConfigError(f"{where}: neither dflash_config.target_layer_ids nor num_target_layers is set, so "
                              "which target layers the draft reads is unknown; add dflash_config.target_layer_ids")
        mask = extra.get("mask_token_id")
        cfg = cls(
            hidden_size=hidden, intermediate_size=int(_require(d, "intermediate_size", where)),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads), num_hidden_layers=layers,
            vocab_size=int(_require(d, "vocab_size", where)),
            block_size=int(_require({"block_size": d.get("block_size") or extra.get("block_size")}, "block_size",
                                    where)),
            aux_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=None if mask is None else int(mask), layer_types=types,
            sliding_window=int(window) if SLIDING in types else None,
            attention_bias=bool(d.get("attention_bias", False)), rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            rope=RopeConfig.from_hf(d, where), max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            mla=mla, hf_config=json.loads(json.dumps(dict(d))),
        )
        if mla is None and cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={cfg.num_key_value_heads}")
        if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ConfigError(f"{where}: dflash_config.mask_token_id={cfg.mask_token_id} outside the vocab "
                              f"0..{cfg.vocab_size - 1}")
        if cfg.block_size < 2:
            raise ConfigError(f"{where}: block_size={cfg.block_size}; a block is its known token plus at least "
                              "one guess, so it must be >= 2")
        if mla is None and cfg.head_dim % 2:
            raise ConfigError(f"{where}: head_dim={cfg.head_dim} must be even for rotary pairs")
        return cfg

    def require_mask_token(self) -> int:
        if self.mask_token_id is None:
            raise ConfigError("this DFlash draft names no dflash_config.mask_token_id; the block's guessed "
                              "positions are fed that token, so set it in config.json (SpecForge's trainer does)")
        return self.mask_token_id

    def to_hf_dict(self) -> dict:
        if self.hf_config:
            return json.loads(json.dumps(self.hf_config))
        d = {
            "architectures": list(DFLASH_ARCHITECTURES), "model_type": "qwen3", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": self.num_hidden_layers, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope.theta, "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings, "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None, "sliding_window": self.sliding_window,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.aux_layer_ids)},
        }
        if self.mla is not None:
            top, extra = self.mla.to_hf()
            d.update(top)
            d["dflash_config"].update(extra)
        return d

