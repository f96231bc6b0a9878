"""Serve settings: defaults < YAML ``--config`` < command line, validated before anything loads.

The settings that decide *what* is generated (model, dtype, sampling, lengths, seed, output format,
stop ids) are the output file's fingerprint: resuming against an output written with a different
fingerprint is refused. The ones that only decide *how fast* (draft, num_draft_tokens, batch_size,
mesh) may change between runs: decoding is lossless, so a job can resume on another machine shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from eagle3_jax import settings_io
from eagle3_jax.errors import SettingsError

EMIT_CHOICES = ("text", "training")


def draft_tokens_setting(value: Any) -> Any:
    """``num_draft_tokens``: a whole number or the word ``auto`` (chosen from measured costs)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())   # a negative number reads as one and is refused by its range check
        except ValueError:
            pass
    raise SettingsError(f"num_draft_tokens: expected an integer or 'auto', found {type(value).__name__} {value!r}")


def k_table_setting(value: Any) -> str:
    """``k_table``: batch size -> the first K under auto, as ``1:0,8:2`` (checked, kept as text)."""
    parse_k_table(value)
    return str(value)


def parse_k_table(value: Any) -> dict[int, int]:
    try:
        table = {int(b): int(k) for b, k in (p.split(":") for p in str(value).split(",") if p.strip())}
    except ValueError:
        table = None
    if not table or any(b < 1 or k < 0 for b, k in table.items()):
        raise SettingsError(f"k_table: expected batch:K pairs such as 1:0,8:2 (batch >= 1, K >= 0), found {value!r}")
    return table


@dataclass
class ServeSettings:
    """A serve job's settings; the flags' help (cli.build_parser) says what each means."""

    target: str | None = None
    draft: str | None = None
    input: str | None = None
    output: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    num_draft_tokens: int | str = "auto"
    k_table: str | None = None
    batch_size: int = 8
    max_len: int = 2048
    admit_rows: int | None = None
    prefill_chunk: int | None = None
    mesh: str = "auto"
    seed: int = 0
    emit: str = "text"
    metrics: str | None = None
    overwrite: bool = False
    skip_bad_lines: bool = False
    dtype: str = "auto"
    no_progress: bool = False
    # Multi-host (see eagle3_jax.distributed): per-process, command line / EAGLE3_* environment only,
    # never part of the fingerprint (a job may resume on another number of hosts).
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    # Settings that only the command line or the environment may give (not --config).
    PER_PROCESS = ("coordinator", "num_processes", "process_id")

    # Fields that change the generated text; see the module docstring. Not max_len: it only decides
    # which prompts fit and where a row is cut, and the output file handles those rows (output.py).
    FINGERPRINT = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "emit")

    @classmethod
    def merged(cls, yaml_values: Mapping[str, Any], cli_values: Mapping[str, Any]) -> "ServeSettings":
        """Defaults, then the YAML file's values, then every flag given on the command line (not None)."""
        layers = [(getattr(yaml_values, "source", "--config"), yaml_values)]
        layers += [(f"--{k.replace('_', '-')}", {k: v}) for k, v in cli_values.items() if v is not None]
        return settings_io.from_layers(cls, layers, {"mesh": settings_io.mesh_text,
                                                     "num_draft_tokens": draft_tokens_setting,
                                                     "k_table": k_table_setting})

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
        for name in ("admit_rows", "prefill_chunk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (or unset), found {getattr(self, name)}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], found {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), found {self.top_k}")
        if self.num_draft_tokens != "auto" and self.num_draft_tokens < 0:
            problems.append(f"num_draft_tokens must be 'auto' or a whole number >= 0 (0: target-only), found "
                            f"{self.num_draft_tokens}")
        elif self.draft and self.num_draft_tokens != "auto" and self.num_draft_tokens < 1:
            problems.append(f"num_draft_tokens must be >= 1 with a draft, found {self.num_draft_tokens}")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, found {self.batch_size}")
        if self.max_len < 2:
            problems.append(f"max_len must be >= 2, found {self.max_len}")
        if self.emit not in EMIT_CHOICES:
            problems.append(f"emit must be one of {', '.join(EMIT_CHOICES)}, found '{self.emit}'")
        if problems:
            raise SettingsError("invalid serve settings: " + "; ".join(problems))

    def check_paths(self) -> None:
        """The paths the command line names exist (a typo is a bad command line, exit 2)."""
        missing = [f"{flag} {path} does not exist" for flag, path in
                   (("--target", self.target), ("--draft", self.draft), ("--input", self.input))
                   if path and not os.path.exists(path)]
        if missing:
            raise SettingsError("; ".join(missing))

    def fingerprint(self, dtype: str, eos_token_ids, tokenizer_kind: str) -> dict:
        fp = {"target": os.path.abspath(self.target) if self.target else None, "dtype": dtype,
              "tokenizer": tokenizer_kind, "eos_token_ids": list(eos_token_ids)}
        fp.update({k: getattr(self, k) for k in self.FINGERPRINT})
        return fp

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in settings_io.field_names(type(self))}


class FileValues(dict):
    """A settings file's values and the name of where they came from (``--config PATH``)."""

    def __init__(self, values: Mapping[str, Any], source: str):
        super().__init__(values)
        self.source = source


def read_yaml_config(path: str) -> FileValues:
    """A YAML mapping of the same keys as the command line (dashes or underscores)."""
    source, data = settings_io.yaml_layer(path)
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in ServeSettings.PER_PROCESS:
            raise SettingsError(
                f"{source}: '{k}' differs per process and is read before the config; pass "
                f"--{key.replace('_', '-')} on the command line (or EAGLE3_{key.upper()} in the environment) and "
                "remove it from the file")
        out[key] = v
    return FileValues(out, source)


def describe_difference(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    keys = list(dict.fromkeys(list(stored) + list(current)))
    return [f"{k}: output has {json.dumps(stored.get(k))}, this run has {json.dumps(current.get(k))}"
            for k in keys if stored.get(k) != current.get(k)]
