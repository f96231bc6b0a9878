"""What each kind of checkpoint (target, draft) needs for conversion: its config, its rule table
(the same tables the loaders use, so converting and loading cannot disagree), and the abstract
model state that gives every parameter's shape, logical axes and default dtype."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from eagle3_jax import drafts
from eagle3_jax.checkpoint.quant_native import native_rules
from eagle3_jax.checkpoint.target_map import is_ignored_key
from eagle3_jax.config import TARGET_ARCHITECTURES, TARGET_MODEL_TYPES, TargetConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.quantized import QuantLayout

TARGET, DRAFT = "target", "draft"


@dataclass
class ModelSpec:
    kind: str
    architecture: str
    cfg: Any                                  # TargetConfig | DraftConfig
    rules: list                               # [Rule], in export order
    prefix: str                               # on-disk key prefix ("language_model." for Kimi-K2.5)
    ignore: Callable[[str], bool]             # on-disk tensors the model does not use
    flat: dict                                # our param path -> abstract nnx.Variable
    wiring: dict = field(default_factory=dict)  # JSON-able facts needed to rebuild the rules
    quant: QuantLayout | None = None          # weights held quantized (targets only)

    @property
    def hf_config(self) -> dict:
        return self.cfg.to_hf_dict()


def detect_kind(hf: dict, where: str = "config.json") -> tuple[str, str]:
    """(kind, architecture) from config.json's ``architectures`` (then model_type / eagle_config)."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in TARGET_ARCHITECTURES:
            return TARGET, a
        if a in drafts.ARCHITECTURES:
            return DRAFT, a
    if archs:
        raise ConfigError(
            f"{where}: architectures {archs} is neither a target ({', '.join(TARGET_ARCHITECTURES)}) nor a "
            f"draft ({', '.join(drafts.ARCHITECTURES)}); this tool converts only those")
    if hf.get("model_type") in TARGET_MODEL_TYPES or "text_config" in hf:
        return TARGET, "DeepseekV3ForCausalLM"
    if "eagle_config" in hf or "draft_vocab_size" in hf:
        return DRAFT, drafts.KINDS[0].architectures[0]
    raise ConfigError(f"{where}: no architectures field and nothing else that says target or draft; "
                      "add \"architectures\": [\"DeepseekV3ForCausalLM\"] or [\"LlamaForCausalLMEagle3\"]")


def _flat(module_fn) -> dict:
    abstract = nnx.eval_shape(module_fn)
    _, state = nnx.split(abstract)
    return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def target_spec(hf: dict, architecture: str, dtype=jnp.float32, where: str = "config.json",
                quant: QuantLayout | None = None) -> ModelSpec:
    """``quant``: the weights kept quantized (their rules copy the stored tensors as they are)."""
    from eagle3_jax.models.target import Target

    cfg = TargetConfig.from_hf_dict(hf, where)
    return ModelSpec(TARGET, architecture, cfg, native_rules(cfg, quant), cfg.weight_prefix,
                     lambda k: is_ignored_key(cfg, k), _flat(lambda: Target(cfg, dtype, None, quant=quant)),
                     quant=quant)


def draft_spec(hf: dict, architecture: str, wiring: dict, dtype=jnp.float32,
               where: str = "config.json") -> ModelSpec:
    """A draft of the kind ``architecture`` names (the default kind's without one of ours)."""
    kind = drafts.for_architectures([architecture]) or drafts.KINDS[0]
    cfg = kind.config.from_hf_dict(hf, where)
    rules, flat = kind.convert_table(cfg, wiring, dtype)
    return ModelSpec(DRAFT, architecture, cfg, rules, "", lambda k: False, flat, dict(wiring))
