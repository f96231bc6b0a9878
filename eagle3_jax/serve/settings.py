"""Serve settings: defaults < YAML ``--config`` < command line, validated before anything loads.

The settings that decide *what* is generated (model, dtype, sampling, lengths, seed, output format,
stop ids) are the output file's fingerprint: resuming against an output written with a different
fingerprint is refused. The ones that only decide *how fast* (draft, num_draft_tokens, batch_size,
mesh) may change between runs: decoding is lossless, so a job can resume on another machine shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from eagle3_jax.config import read_yaml_mapping
from eagle3_jax.errors import ConfigError

EMIT_CHOICES = ("text", "training")
AUTO_OK = {"num_draft_tokens": " or 'auto'"}   # settings that also take the word auto


@dataclass
class ServeSettings:
    target: str | None = None
    draft: str | None = None
    input: str | None = None
    output: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # "auto": K chosen per batch from measured round costs and live acceptance (0 = target-only).
    num_draft_tokens: int | str = "auto"
    batch_size: int = 8
    max_len: int = 2048
    # "auto": every visible device on the expert axis (no mesh on a single device); "none": no mesh.
    mesh: str = "auto"
    seed: int = 0
    emit: str = "text"
    metrics: str | None = None
    overwrite: bool = False
    skip_bad_lines: bool = False
    # "auto": the checkpoint's torch_dtype (bfloat16 when it names none we support).
    dtype: str = "auto"
    # Multi-host (see eagle3_jax.distributed): per-process, command line / EAGLE3_* environment only,
    # never part of the fingerprint (a job may resume on another number of hosts).
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    # Settings that only the command line or the environment may give (not --config).
    PER_PROCESS = ("coordinator", "num_processes", "process_id")

    # Fields that change the generated text; see the module docstring.
    FINGERPRINT = ("max_new_tokens", "temperature", "top_p", "top_k", "max_len", "seed", "emit")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def merged(cls, yaml_values: Mapping[str, Any], cli_values: Mapping[str, Any]) -> "ServeSettings":
        """Defaults, then the YAML file's values, then every flag given on the command line."""
        values = dict(yaml_values)
        values.update({k: v for k, v in cli_values.items() if v is not None})
        s = cls(**values)
        s.coerce()
        return s

    def coerce(self) -> None:
        types = {"max_new_tokens": int, "top_k": int, "num_draft_tokens": int, "batch_size": int, "max_len": int,
                 "seed": int, "temperature": float, "top_p": float}
        for name, typ in types.items():
            v = getattr(self, name)
            if name == "num_draft_tokens" and v == "auto":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise ConfigError(f"setting {name}: expected a number{AUTO_OK.get(name, '')}, found {v!r}")
            try:
                converted = typ(v)
            except ValueError:
                raise ConfigError(f"setting {name}: expected {typ.__name__}{AUTO_OK.get(name, '')}, found {v!r}") from None
            if typ is int and isinstance(v, float) and v != converted:
                raise ConfigError(f"setting {name}: expected an integer, found {v!r}")
            setattr(self, name, converted)
        for name in ("overwrite", "skip_bad_lines"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"setting {name}: expected true or false, found {getattr(self, name)!r}")
        self.mesh = str(self.mesh)
        self.dtype = str(self.dtype)

    def validate(self) -> None:
        problems = []
        if not self.input:
            problems.append("--input PROMPTS.jsonl is required")
        if not self.output:
            problems.append("--output OUT.jsonl is required")
        if self.input and self.output and os.path.abspath(self.input) == os.path.abspath(self.output):
            problems.append("--output must differ from --input")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, found {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], found {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), found {self.top_k}")
        if self.draft and self.num_draft_tokens != "auto" and self.num_draft_tokens < 1:
            problems.append(f"num_draft_tokens must be >= 1 with a draft, found {self.num_draft_tokens}")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, found {self.batch_size}")
        if self.max_len < 2:
            problems.append(f"max_len must be >= 2, found {self.max_len}")
        if self.emit not in EMIT_CHOICES:
            problems.append(f"emit must be one of {', '.join(EMIT_CHOICES)}, found '{self.emit}'")
        if problems:
            raise ConfigError("invalid serve settings: " + "; ".join(problems))

    def fingerprint(self, dtype: str, eos_token_ids, tokenizer_kind: str) -> dict:
        fp = {"target": os.path.abspath(self.target) if self.target else None, "dtype": dtype,
              "tokenizer": tokenizer_kind, "eos_token_ids": list(eos_token_ids)}
        fp.update({k: getattr(self, k) for k in self.FINGERPRINT})
        return fp

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.field_names()}


def read_yaml_config(path: str) -> dict:
    """A YAML mapping of the same keys as the command line (dashes or underscores)."""
    data = read_yaml_mapping(path, where=f"--config {path}")
    known = set(ServeSettings.field_names())
    out, unknown = {}, []
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in ServeSettings.PER_PROCESS:
            raise ConfigError(
                f"--config {path}: '{k}' differs per process and is read before the config; pass "
                f"--{key.replace('_', '-')} on the command line (or EAGLE3_{key.upper()} in the environment) and "
                "remove it from the file")
        (out.__setitem__(key, v) if key in known else unknown.append(str(k)))
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {unknown}; known keys are {sorted(known)}")
    return out


def describe_difference(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    keys = list(dict.fromkeys(list(stored) + list(current)))
    return [f"{k}: output has {json.dumps(stored.get(k))}, this run has {json.dumps(current.get(k))}"
            for k in keys if stored.get(k) != current.get(k)]
