"""The training configuration: YAML + ``key=value`` overrides -> a frozen, validated ``TrainConfig``.

Everything that can be checked without running a model is checked here, so a typo or a wrong
layer id fails in a second with a message that names the key, not an hour into a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import yaml

from eagle3_jax.config import DraftConfig, MeshConfig, TargetConfig, read_yaml_mapping
from eagle3_jax.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")
MODES = ("train", "prepare")
HIDDEN_SOURCES = ("online", "offline")
LIKE_TARGET = "like_target"


@dataclass(frozen=True)
class DraftShape:
    """The draft's layer sizes; a field left as None takes the target's value."""

    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out_dir: str | None = None
    data: str | None = None
    draft: DraftShape = field(default_factory=DraftShape)
    aux_layer_ids: tuple[int, ...] | None = None
    draft_vocab_size: int | None = None
    max_len: int = 2048
    batch_size: int = 8
    grad_accum: int = 1
    ttt_steps: int = 7
    loss_decay: float = 0.8
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    total_steps: int = 1000
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    dtype: str = "float32"
    target_dtype: str | None = None
    seed: int = 0
    save_every: int = 500
    keep: int = 3
    eval_every: int = 0
    eval_prompts: str | None = None
    eval_new_tokens: int = 64
    eval_draft_tokens: int = 4
    mode: str = "train"
    hidden_source: str = "online"
    offline_dir: str | None = None
    mesh: str | None = None
    export_dir: str | None = None
    export_dtype: str | None = None     # the exported draft's weights; None = dtype

    # ------------------------------------------------------------------ derived
    @property
    def resolved_target_dtype(self) -> str:
        return self.target_dtype or self.dtype

    @property
    def resolved_export_dir(self) -> str:
        return self.export_dir or os.path.join(self.out_dir, "draft")

    def target_config(self) -> TargetConfig:
        return TargetConfig.from_path(self.target)

    def resolved_aux_ids(self, tcfg: TargetConfig | None = None) -> tuple[int, ...]:
        tcfg = tcfg or self.target_config()
        return self.aux_layer_ids if self.aux_layer_ids is not None else tcfg.default_aux_layer_ids()

    def draft_config(self, tcfg: TargetConfig | None = None) -> DraftConfig:
        """The EAGLE-3 draft config.json this run trains and exports."""
        tcfg = tcfg or self.target_config()
        s = self.draft
        hidden = s.hidden_size or tcfg.hidden_size
        heads = s.num_attention_heads or tcfg.num_attention_heads
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "hidden_size": hidden,
            "intermediate_size": s.intermediate_size or tcfg.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": s.num_key_value_heads or heads,
            "head_dim": s.head_dim or hidden // heads,
            "vocab_size": tcfg.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or tcfg.vocab_size,
            "target_hidden_size": tcfg.hidden_size,
            "rms_norm_eps": s.rms_norm_eps or tcfg.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position_embeddings or max(self.max_len + self.ttt_steps, 2048),
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.resolved_aux_ids(tcfg)),
                             "use_aux_hidden_state": True},
        }
        return DraftConfig.from_hf_dict(d, where="train config draft")

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "train config") -> "TrainConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping of keys to values, found {type(raw).__name__}")
        values = {}
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for key, value in raw.items():
            if key not in names:
                raise ConfigError(f"{where}: unknown key '{key}'{_suggest(key, names)}; valid keys: {', '.join(names)}")
            if key == "draft":
                values[key] = _draft_shape(value, f"{where}: draft")
            else:
                values[key] = _coerce(value, hints[key], f"{where}: {key}")
        if "target" not in values or values["target"] is None:
            raise ConfigError(f"{where}: 'target' (the target checkpoint directory) is required")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> "TrainConfig":
        """Reads a YAML file (or none) and applies ``key=value`` overrides (``draft.hidden_size=64``)."""
        raw: dict = {}
        where = "train config"
        if path is not None:
            path = os.fspath(path)
            where = path
            raw = read_yaml_mapping(path)
            if isinstance(raw.get("draft"), Mapping):
                raw["draft"] = dict(raw["draft"])
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' is not key=value (e.g. lr=1e-4 or draft.hidden_size=64)")
            key, text = item.split("=", 1)
            key = key.strip()
            value = _parse_scalar(key, text)
            if key.startswith("draft."):
                sub = raw.get("draft")
                if not isinstance(sub, dict):
                    sub = {}
                sub[key[len("draft."):]] = value
                raw["draft"] = sub
            else:
                raw[key] = value
        return cls.from_dict(raw, where)

    # ------------------------------------------------------------------ validation
    def validate(self) -> TargetConfig:
        """Every check that needs no model: files, ranges, and the target's config.json. Returns it."""
        positive = ("max_len", "batch_size", "grad_accum", "ttt_steps", "total_steps", "save_every", "keep",
                    "eval_new_tokens", "eval_draft_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, found {getattr(self, name)}")
        if self.max_len < 3:
            raise ConfigError(f"max_len must be >= 3 (a token, its successor and one to predict), found {self.max_len}")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0 (0 turns evaluation off), found {self.eval_every}")
        if self.mode not in MODES:
            raise ConfigError(f"mode '{self.mode}' is not one of {MODES}")
        if self.hidden_source not in HIDDEN_SOURCES:
            raise ConfigError(f"hidden_source '{self.hidden_source}' is not one of {HIDDEN_SOURCES}")
        for name in ("dtype", "target_dtype", "export_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPE_NAMES:
                raise ConfigError(f"{name} '{v}' is not supported; use one of {DTYPE_NAMES}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, found {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must lie in [0, 1), found {self.warmup_ratio}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"grad_clip ({self.grad_clip}) and weight_decay ({self.weight_decay}) must be >= 0")
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"loss_decay must lie in (0, 1], found {self.loss_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), found {list(self.betas)}")

        needs_data = self.mode == "prepare" or self.hidden_source == "online"
        if needs_data:
            if self.data is None:
                raise ConfigError("data (a JSONL file of {\"messages\": ...} / {\"text\": ...} records) is required")
            if not os.path.isfile(self.data):
                raise ConfigError(f"data file {self.data} does not exist")
        elif self.data is not None and not os.path.isfile(self.data):
            raise ConfigError(f"data file {self.data} does not exist")
        if self.mode == "prepare" or self.hidden_source == "offline":
            if self.offline_dir is None:
                raise ConfigError(
                    "offline_dir is required with mode=prepare or hidden_source=offline "
                    "(where the target's hidden states are written / read)")
            if self.mode == "train" and not os.path.isfile(os.path.join(self.offline_dir, "meta.json")):
                raise ConfigError(
                    f"hidden_source=offline but {self.offline_dir} holds no prepared hidden states (no meta.json); "
                    "run the same config with mode=prepare first")
        if self.mode == "train" and self.out_dir is None:
            raise ConfigError("out_dir (checkpoints, metrics and the exported draft go there) is required")
        if self.eval_every > 0:
            if self.eval_prompts is None:
                raise ConfigError("eval_every > 0 needs eval_prompts (a JSONL file of held-out prompts)")
            if not os.path.isfile(self.eval_prompts):
                raise ConfigError(f"eval_prompts file {self.eval_prompts} does not exist")
            if self.hidden_source == "offline":
                raise ConfigError(
                    "eval_every > 0 runs the target with the draft, but hidden_source=offline trains without the "
                    "target in memory; set eval_every=0 and measure the exported draft with the Generator instead")

        if self.mesh is not None:
            mesh = MeshConfig.parse(self.mesh)
            if self.batch_size % mesh.data:
                raise ConfigError(
                    f"batch_size={self.batch_size} is not divisible by the mesh's data axis ({mesh.data}); "
                    "each data-parallel device needs the same number of rows")

        tcfg = self.target_config()
        L = tcfg.num_hidden_layers
        ids = self.resolved_aux_ids(tcfg)
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            raise ConfigError(
                f"aux_layer_ids {list(ids)}: {bad} outside the target's layers 0..{L - 1}; id i means the output "
                f"of layer i (SGLang/SpecForge convention); the default for this target is "
                f"{list(tcfg.default_aux_layer_ids())}")
        if not ids:
            raise ConfigError("aux_layer_ids is empty; EAGLE-3 fuses at least one target layer (usually three)")
        W = self.draft_vocab_size
        if W is not None and not 1 <= W <= tcfg.vocab_size:
            raise ConfigError(f"draft_vocab_size={W} must lie in [1, target vocab {tcfg.vocab_size}]")
        s = self.draft
        if s.hidden_size is not None and s.hidden_size != tcfg.hidden_size:
            raise ConfigError(
                f"draft.hidden_size={s.hidden_size} but the target's hidden_size is {tcfg.hidden_size}; the draft "
                "reads the target's token embedding, so their widths must match (leave it unset)")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(s, name)
            if v is not None and v < 1:
                raise ConfigError(f"draft.{name} must be >= 1, found {v}")
        dcfg = self.draft_config(tcfg)  # heads vs kv heads, vocab sizes
        if dcfg.head_dim % 2:
            raise ConfigError(f"draft head_dim must be even for rotary pairs, found {dcfg.head_dim}")
        return tcfg


# ---------------------------------------------------------------------- helpers
def _suggest(key: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _parse_scalar(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"override {key}={text}: value is not valid YAML") from None


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, where: str) -> Any:
    """Checks ``value`` against a dataclass annotation; ints widen to floats, lists become tuples."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, found {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, found {len(value)}: {list(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, found {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, found {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, found {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping) and where.endswith(": mesh"):
            return ",".join(f"{k}={v}" for k, v in value.items())
        raise ConfigError(f"{where}: expected a string, found {type(value).__name__} {value!r}")
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def _draft_shape(value: Any, where: str) -> DraftShape:
    if isinstance(value, DraftShape):
        return value
    if value is None or value == LIKE_TARGET:
        return DraftShape()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected '{LIKE_TARGET}' or a mapping of draft sizes, found {value!r}")
    hints = typing.get_type_hints(DraftShape)
    names = [f.name for f in dataclasses.fields(DraftShape)]
    out = {}
    for k, v in value.items():
        if k not in names:
            raise ConfigError(f"{where}: unknown key '{k}'{_suggest(k, names)}; valid keys: {', '.join(names)}")
        out[k] = None if v == LIKE_TARGET else _coerce(v, hints[k], f"{where}.{k}")
    return DraftShape(**out)
