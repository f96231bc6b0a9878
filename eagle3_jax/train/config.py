"""The training configuration: YAML + ``key=value`` overrides -> a frozen, validated ``TrainConfig``,
checked without running a model, so a typo or a wrong layer id fails in a second, not an hour into a run."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from eagle3_jax import settings_io
from eagle3_jax.config import DTYPES, MeshConfig, TargetConfig
from eagle3_jax.drafts import DraftConfig, DraftKind
from eagle3_jax.errors import ConfigError, SettingsError
from eagle3_jax.settings_io import Layer
from eagle3_jax.train.shapes import DFlashShape, DraftShape, PEagleShape

MODES = ("train", "prepare")
HIDDEN_SOURCES = ("online", "offline")
ATTENTIONS = ("efficient", "blockwise")
LIKE_TARGET = "like_target"
DATA_FORMATS = """\
One JSON object a line, one of:
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
      the chat template is applied; the loss is on the assistant turns
  {"text": "..."}                              plain text; the loss is on every token
  {"input_ids": [...], "loss_mask": [...]}     already tokenized (loss_mask optional: all 1)"""
HOW_TO_MAKE_DATA = (
    "Make training data from the target's own answers with `python serve.py --target TARGET --input "
    "PROMPTS.jsonl --output DATA.jsonl --emit training` (lines of {\"messages\": ...}); for the demo, "
    "stage 4 of `python tools/make_demo.py` (regenerate) writes build/demo_work/regenerated.jsonl")


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out_dir: str | None = None
    data: str | None = None
    # a name in eagle3_jax.drafts.NAMES; None: draft_config_file's architecture's, else the default (EAGLE-3)
    draft_kind: str | None = None
    draft_config_file: str | None = None   # a draft config.json whose architecture and sizes the run takes
    draft: DraftShape = field(default_factory=DraftShape)
    peagle: PEagleShape = field(default_factory=PEagleShape)
    dflash: DFlashShape = field(default_factory=DFlashShape)
    aux_layer_ids: tuple[int, ...] | None = None
    draft_vocab_size: int | None = None
    max_len: int = 2048
    batch_size: int = 8
    grad_accum: int = 1
    ttt_steps: int = 7
    loss_decay: float = 0.8
    # The loss (ttt.py's docstring): its convention, SpecForge's LK objective and its lambda weight
    # kl_scale * exp(-kl_decay * acceptance), the unroll's attention core ("blockwise": attention_block
    # keys a block, memory linear in the row; "efficient": whole rows) and positions per chunk of the
    # head and loss (None: whole rows). specforge_batch: with loss_convention=specforge, the rows
    # SpecForge collates on one device (its training.batch_size).
    loss_convention: str = "ours"
    specforge_batch: int = 1
    lk_loss_type: str | None = None
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    attention: str = "blockwise"
    attention_block: int = 512
    loss_chunk: int | None = 2048
    target_chunk: int | None = 2048     # online: positions per call of the frozen target (its scores [chunk, T])
    remat: bool = True                  # recompute each TTT step's decoder layer in the backward pass
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
    log_every: int = 50        # a log line every N steps when there is no progress bar
    keep: int = 3
    eval_every: int = 0
    eval_prompts: str | None = None
    eval_new_tokens: int = 64
    eval_draft_tokens: int = 4
    # the eval stops training below this share of the tokens the accuracies imply (train_serve.py); 0: off
    eval_min_accept_share: float = 0.25
    mode: str = "train"
    hidden_source: str = "online"
    offline_dir: str | None = None
    offline_dtype: str | None = None    # stored states: float32, bfloat16, float16, float8_e4m3fn; None = target dtype
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

    def _draft_file_and_kind(self):
        from eagle3_jax.train.draft_kind import read_draft_file, resolve_kind

        file = read_draft_file(self)
        return file, resolve_kind(self, file)

    def resolved_aux_ids(self, tcfg: TargetConfig | None = None, file: dict | None = None) -> tuple[int, ...]:
        """``aux_layer_ids``, else the draft kind's rule (``train_aux_ids``: the draft_config_file's ids,
        ``file`` its JSON, else the kind's default for the target)."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        from eagle3_jax.train.draft_kind import read_draft_file, resolve_kind

        file = file if file is not None else read_draft_file(self)
        return tuple(resolve_kind(self, file).train_aux_ids(file, self, tcfg or self.target_config()))

    @property
    def resolved_draft_kind(self) -> str:
        return self._draft_file_and_kind()[1].name

    def to_dict(self, draft_kind: str | None = None) -> dict:
        """The settings as a checkpoint records them, ``draft_kind`` resolved (unset and the default
        kind are one kind to a resumed run)."""
        d = json.loads(json.dumps(dataclasses.asdict(self)))
        d["draft_kind"] = draft_kind or self.resolved_draft_kind
        return d

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_layers(cls, layers: Sequence[Layer]) -> "TrainConfig":
        """Defaults < each (source, mapping) layer in turn; errors name the key and the layer's source."""
        return settings_io.from_layers(cls, layers, CONVERTERS, required={
            "target": "the target checkpoint directory; set target: in the --config file or pass target=DIR"},
            aliases=ALIASES)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "train config") -> "TrainConfig":
        return cls.from_layers([(where, raw)])

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> "TrainConfig":
        """Reads a YAML file (or none) and applies ``key=value`` overrides (``draft.hidden_size=64``)."""
        layers = [settings_io.yaml_layer(os.fspath(path))] if path is not None else []
        layers += settings_io.override_layers(overrides, example="lr=1e-4 or draft.hidden_size=64")
        return cls.from_layers(layers)

    # ------------------------------------------------------------------ validation
    def resolve(self) -> "TrainPlan":
        """Every check that needs no model: files, ranges, the target's config.json and the draft's
        kind and config, each file read once; the run's ``TrainPlan``."""
        positive = ("max_len", "batch_size", "specforge_batch", "grad_accum", "ttt_steps", "total_steps", "save_every",
                    "log_every", "keep", "eval_new_tokens", "eval_draft_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, found {getattr(self, name)}")
        from eagle3_jax.train.offline import STORAGE_DTYPES
        from eagle3_jax.train.ttt import CONVENTIONS, LK_LOSS_TYPES

        for name, allowed in (("mode", MODES), ("hidden_source", HIDDEN_SOURCES), ("loss_convention", CONVENTIONS),
                              ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise SettingsError(f"{name} '{getattr(self, name)}' is not one of {allowed}")
        for name in ("dtype", "target_dtype", "export_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPES:
                raise SettingsError(f"{name} '{v}' is not supported; use one of {DTYPES}")
        for ok, problem in (
                (self.max_len >= 3, f"max_len must be >= 3 (a token, its successor and one to predict), found "
                                    f"{self.max_len}"),
                (self.eval_every >= 0, f"eval_every must be >= 0 (0 turns evaluation off), found {self.eval_every}"),
                (0 <= self.eval_min_accept_share <= 1, "eval_min_accept_share must be in [0, 1] (0 turns the check "
                                                       f"off), found {self.eval_min_accept_share}"),
                (self.offline_dtype in (None,) + STORAGE_DTYPES,
                 f"offline_dtype '{self.offline_dtype}' is not one of {STORAGE_DTYPES}"),
                (self.lr > 0, f"lr must be > 0, found {self.lr}"),
                (0 <= self.warmup_ratio < 1, f"warmup_ratio must lie in [0, 1), found {self.warmup_ratio}"),
                (self.grad_clip >= 0 and self.weight_decay >= 0,
                 f"grad_clip ({self.grad_clip}) and weight_decay ({self.weight_decay}) must be >= 0"),
                (0 < self.loss_decay <= 1, f"loss_decay must lie in (0, 1], found {self.loss_decay}"),
                (self.batch_size % self.specforge_batch == 0, f"specforge_batch={self.specforge_batch} "
                 f"(SpecForge's rows per device) must divide batch_size={self.batch_size}"),
                (self.lk_loss_type in (None,) + LK_LOSS_TYPES, f"lk_loss_type '{self.lk_loss_type}' is not one of "
                 f"{LK_LOSS_TYPES} (or unset: the soft-label cross-entropy alone)"),
                (self.kl_scale >= 0 and self.kl_decay >= 0,
                 f"kl_scale ({self.kl_scale}) and kl_decay ({self.kl_decay}) must be >= 0"),
                (self.target_chunk is None or self.target_chunk >= 1,
                 f"target_chunk must be >= 1 (or unset: whole rows), found {self.target_chunk}"),
                (self.attention_block >= 1 and (self.loss_chunk is None or self.loss_chunk >= 1),
                 f"attention_block ({self.attention_block}) and loss_chunk ({self.loss_chunk}) must be >= 1 "
                 "(loss_chunk may be unset: whole rows)"),
                (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"betas must be two numbers in [0, 1), found {list(self.betas)}")):
            if not ok:
                raise SettingsError(problem)

        needs_data = self.mode == "prepare" or self.hidden_source == "online"
        if needs_data and self.data is None:
            raise SettingsError("data (a JSONL file of {\"messages\": ...} / {\"text\": ...} records) is required. "
                                + HOW_TO_MAKE_DATA)
        if self.data is not None and not os.path.isfile(self.data):
            raise SettingsError(f"data file {self.data} does not exist. {HOW_TO_MAKE_DATA}")
        if self.mode == "prepare" or self.hidden_source == "offline":
            if self.offline_dir is None:
                raise SettingsError(
                    "offline_dir is required with mode=prepare or hidden_source=offline "
                    "(where the target's hidden states are written / read)")
            if self.mode == "train" and not os.path.isfile(os.path.join(self.offline_dir, "meta.json")):
                raise SettingsError(
                    f"hidden_source=offline but {self.offline_dir} holds no prepared hidden states (no meta.json); "
                    "run the same config with mode=prepare first")
        if self.mode == "train" and self.out_dir is None:
            raise SettingsError("out_dir (checkpoints, metrics and the exported draft go there) is required")
        if self.mode == "train" and os.path.exists(self.resolved_export_dir) and not os.path.isdir(
                os.path.join(self.out_dir, "checkpoints")):
            # A new run would train for hours and then find the place taken (an export never writes
            # over a draft): the shipped demo/draft, say, stays as it is unless removed on purpose.
            raise SettingsError(
                f"export_dir {self.resolved_export_dir} already exists and {self.out_dir} holds no run that wrote "
                f"it; train.py never writes over a draft. Pass a new export_dir=DIR (unset: {self.out_dir}/draft), "
                f"or remove {self.resolved_export_dir} first if replacing it is what you want")
        if self.eval_every > 0:
            if self.eval_prompts is None:
                raise SettingsError("eval_every > 0 needs eval_prompts (a JSONL file of held-out prompts)")
            if not os.path.isfile(self.eval_prompts):
                raise SettingsError(f"eval_prompts file {self.eval_prompts} does not exist")
            if self.hidden_source == "offline":
                raise SettingsError(
                    "eval_every > 0 runs the target with the draft, but hidden_source=offline trains without the "
                    "target in memory; set eval_every=0 and measure the exported draft with the Generator instead")

        if self.mesh is not None:
            mesh = MeshConfig.parse(self.mesh)
            if self.batch_size % mesh.data:
                raise SettingsError(
                    f"batch_size={self.batch_size} is not divisible by the mesh's data axis ({mesh.data}); "
                    "each data-parallel device needs the same number of rows")

        tcfg = self.target_config()
        from eagle3_jax.train.draft_kind import build_draft_config, check_draft_settings

        file, kind = self._draft_file_and_kind()
        check_draft_settings(self, tcfg, kind, file)
        try:
            ids = tcfg.check_aux_layer_ids(self.resolved_aux_ids(tcfg, file), where="aux_layer_ids")
        except ConfigError as e:
            raise SettingsError(str(e)) from None
        if not ids:
            raise SettingsError("aux_layer_ids is empty; EAGLE-3 fuses at least one target layer (usually three)")
        W = self.draft_vocab_size
        if W is not None and not 1 <= W <= tcfg.vocab_size:
            raise SettingsError(f"draft_vocab_size={W} must lie in [1, target vocab {tcfg.vocab_size}]")
        s = self.draft
        if s.hidden_size is not None and s.hidden_size != tcfg.hidden_size:
            raise SettingsError(
                f"draft.hidden_size={s.hidden_size} but the target's hidden_size is {tcfg.hidden_size}; the draft "
                "reads the target's token embedding, so their widths must match (leave it unset)")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(s, name)
            if v is not None and v < 1:
                raise SettingsError(f"draft.{name} must be >= 1, found {v}")
        dcfg = build_draft_config(self, tcfg, kind, file, ids)  # heads vs kv heads, vocab sizes
        if dcfg.head_dim % 2:
            raise SettingsError(f"draft head_dim must be even for rotary pairs, found {dcfg.head_dim}")
        return TrainPlan(self, tcfg, kind, dcfg, ids)


@dataclass(frozen=True)
class TrainPlan:
    """A training run resolved once, at its start (``TrainConfig.resolve``): everything downstream
    reads these instead of reading the config files again."""

    settings: TrainConfig
    target: TargetConfig
    kind: DraftKind
    draft: DraftConfig
    aux_ids: tuple[int, ...]

    def to_dict(self) -> dict:
        return self.settings.to_dict(self.kind.name)


# ---------------------------------------------------------------------- reading helpers
def _draft_value(value: Any) -> Any:
    """``draft: like_target`` is the target's sizes; so is ``like_target`` for one draft key."""
    if isinstance(value, str) and value == LIKE_TARGET:
        return None
    if isinstance(value, Mapping):
        return {k: None if v == LIKE_TARGET else v for k, v in value.items()}
    return value


CONVERTERS = {"draft": _draft_value, "mesh": settings_io.mesh_text}
# SpecForge's and Hugging Face trainers' names for our keys: "did you mean" where spelling is no guide.
ALIASES = {"learning_rate": "lr", "max_length": "max_len", "ttt_length": "ttt_steps", "max_grad_norm": "grad_clip",
           "accumulation_steps": "grad_accum", "gradient_accumulation_steps": "grad_accum",
           "max_steps": "total_steps", "output_dir": "out_dir", "train_data_path": "data",
           "target_model_path": "target"}
