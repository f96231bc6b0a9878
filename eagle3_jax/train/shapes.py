"""The draft's sizes and each kind's settings as a training config gives them; a leaf, so that
``config.py`` and ``draft_kind.py`` both read them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


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
class PEagleShape:
    """``draft_kind: peagle``: the draft's decoder layers (None: 4, SpecForge's recipe, or the
    draft_config_file's), the MASK token fed at guessed positions (None: drafts/peagle/training.py's rule), and
    COD depth sampling (SpecForge's defaults)."""

    num_hidden_layers: int | None = None
    mask_token_id: int | None = None
    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2


@dataclass(frozen=True)
class DFlashShape:
    """``draft_kind: dflash``: the draft's layers (None: the draft_config_file's, else 1, SpecForge's
    target-derived default) and block (None: the file's, else 16), the MASK token (None:
    drafts/dflash/training.py's rule), and SpecForge's objective settings (its ``training.num_anchors``,
    ``training.loss_decay_gamma`` and ``training.objective_chunk_blocks``, with its defaults)."""

    num_hidden_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    num_anchors: int = 512
    loss_decay_gamma: float | None = None
    objective_chunk_blocks: int = 128   # blocks whose logits exist at once (0: all of a row's)
