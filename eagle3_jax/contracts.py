"""Checks that a draft and a target belong together, run before any token is generated: a draft
served with the wrong wiring does not crash, it just never gets a token accepted. Every mismatch
is an error naming both numbers and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import ConfigError

if TYPE_CHECKING:   # annotations only: importing the drafts package here would close a circle through it
    from eagle3_jax.drafts.eagle3.config import DraftConfig


def resolve_aux_ids(draft: DraftConfig, target: TargetConfig) -> tuple[int, ...]:
    """The layer ids the target must capture for this draft (from the draft's own config)."""
    ids = draft.aux_layer_ids if draft.aux_layer_ids is not None else target.default_aux_layer_ids()
    try:
        return target.check_aux_layer_ids(ids, where="draft eagle_config.eagle_aux_hidden_state_layer_ids")
    except ConfigError as e:
        raise ConfigError(f"{e}. Was this draft trained for a different target?") from None


def check_pairing(draft: DraftConfig, target: TargetConfig, fc_in_width: int, n_aux: int,
                  d2t: np.ndarray | None, own_embedding_width: int | None) -> None:
    H = target.hidden_size
    if not draft.use_aux_hidden_state:
        raise ConfigError(
            f"draft eagle_config.use_aux_hidden_state is false, but this is an EAGLE-3 draft whose fc takes "
            f"{fc_in_width} inputs (fused aux states). A draft that ignores the aux states would silently run "
            "without its fusion layer; set use_aux_hidden_state: true in the draft's config.json"
        )
    if draft.target_hidden_size != H:
        raise ConfigError(
            f"draft target_hidden_size={draft.target_hidden_size} but the target's hidden_size is {H}; "
            "this draft was trained for a different target"
        )
    expected = n_aux * H
    if fc_in_width != expected:
        raise ConfigError(
            f"draft fc.weight takes {fc_in_width} inputs but the target provides {expected} "
            f"({n_aux} captured layer(s) x hidden {H}). "
            + (f"fc expects {fc_in_width // H} layers: set eagle_config.eagle_aux_hidden_state_layer_ids to "
               f"{fc_in_width // H} ids (e.g. {list(target.default_aux_layer_ids())}) in the draft's config.json"
               if fc_in_width % H == 0 else "The fc width is not a multiple of the target hidden size: wrong target?")
        )
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"draft vocab_size={draft.vocab_size} but the target's vocab is {target.vocab_size}; "
            "the draft must be trained with the target's tokenizer"
        )
    if d2t is not None and len(d2t):
        mapped = np.arange(len(d2t)) + np.asarray(d2t)
        bad = np.flatnonzero((mapped < 0) | (mapped >= target.vocab_size))
        if bad.size:
            raise ConfigError(
                f"draft d2t maps draft id {int(bad[0])} to target id {int(mapped[bad[0]])}, outside the target "
                f"vocab [0, {target.vocab_size}) ({bad.size} ids bad); the vocab map belongs to another tokenizer"
            )
    if own_embedding_width is None and draft.hidden_size != H:
        raise ConfigError(
            f"draft has no embed_tokens, so it shares the target's embedding of width {H}, but the draft's "
            f"hidden_size is {draft.hidden_size}; ship the draft's own embed_tokens.weight or use a draft of width {H}"
        )
