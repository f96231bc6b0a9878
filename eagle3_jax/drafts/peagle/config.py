"""``PEagleConfig``: a parallel-drafting (P-EAGLE) draft in SpecForge's ``PEagleDraftModel`` layout:
the EAGLE-3 draft's config.json with ``num_hidden_layers`` decoder layers. Two facts of that class:

- its rotary embedding is built from ``rope_theta`` alone (``rope_scaling`` is never applied), so
  a draft trained there computes unscaled RoPE whatever its config says, and so do we;
- SpecForge's trainer picks the MASK token fed at the positions to guess and does not write it into
  config.json. Our exports write ``mask_token_id`` (SpecForge's LlamaConfig keeps unknown keys);
  without it the caller must name the id.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.config.target import RopeConfig
from eagle3_jax.errors import ConfigError

PEAGLE_ARCHITECTURES = ("PEagleDraftModel",)


@dataclass(frozen=True)
class PEagleConfig(DraftConfig):
    """The EAGLE-3 draft fields plus the number of decoder layers and the MASK token id."""

    num_hidden_layers: int = 4
    mask_token_id: int | None = None

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], where: str = "draft config.json",
                     mask_token_id: int | None = None) -> "PEagleConfig":
        if not any(a in PEAGLE_ARCHITECTURES for a in d.get("architectures") or []):
            raise ConfigError(
                f"{where}: architectures {d.get('architectures')} is not a P-EAGLE draft; expected "
                f"{list(PEAGLE_ARCHITECTURES)}. Load an EAGLE-3 chain draft with DraftConfig instead")
        layers = int(d.get("num_hidden_layers") or 0)
        if layers < 1:
            raise ConfigError(f"{where}: num_hidden_layers must be >= 1 for a P-EAGLE draft, found {layers}")
        theta = _rope_theta(d)
        # The EAGLE-3 reader parses the shared fields, without the rope entries P-EAGLE never applies.
        shared = {k: v for k, v in d.items() if k not in ("architectures", "rope_scaling", "rope_parameters")}
        base = DraftConfig.from_hf_dict(shared, where)
        stored = d.get("mask_token_id")
        if mask_token_id is not None and stored is not None and int(stored) != int(mask_token_id):
            raise ConfigError(
                f"{where}: mask_token_id {stored} in config.json but {mask_token_id} was passed; the draft was "
                "trained with one of them. Pass none (use the config's) or fix config.json")
        mask = mask_token_id if mask_token_id is not None else stored
        if mask is not None and not 0 <= int(mask) < base.vocab_size:
            raise ConfigError(f"{where}: mask_token_id {mask} is outside the draft embedding [0, {base.vocab_size})")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DraftConfig)}
        fields.update(rope=RopeConfig(theta=theta), hf_config=json.loads(json.dumps(dict(d))),
                      num_hidden_layers=layers, mask_token_id=None if mask is None else int(mask))
        return cls(**fields)

    def require_mask_token(self, where: str = "P-EAGLE draft") -> int:
        if self.mask_token_id is None:
            raise ConfigError(
                f"{where}: no mask_token_id. SpecForge picks it at training time (its trainer's mask_token_id, "
                "else the tokenizer's mask, else an unused embedding slot, else pad/eos/unk) and does not store "
                "it in config.json; pass the id the draft was trained with (mask_token_id=...) or add "
                "\"mask_token_id\" to its config.json")
        return self.mask_token_id

    def to_hf_dict(self) -> dict:
        d = json.loads(json.dumps(self.hf_config)) if self.hf_config else super().to_hf_dict()
        d["architectures"] = list(PEAGLE_ARCHITECTURES)
        d["num_hidden_layers"] = self.num_hidden_layers
        d["rope_theta"] = self.rope.theta
        if self.mask_token_id is not None:
            d["mask_token_id"] = self.mask_token_id
        d["norm_before_residual"] = self.norm_before_residual
        return d


def _rope_theta(d: Mapping[str, Any]) -> float:
    """transformers 5 moves ``rope_theta`` into ``rope_parameters``; SpecForge reads it from there first."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(d.get("rope_theta") or 10000.0)
