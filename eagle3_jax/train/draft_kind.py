"""Which draft a run trains (``draft_kind``: a kind registered in ``eagle3_jax.drafts``), and the
config.json it trains and exports. A ``draft_config_file`` (a draft config.json, e.g. SpecForge's
``configs/qwen3-8b-peagle.json``) gives the draft's sizes and, by its architecture, the kind; a
``draft_kind`` that disagrees with it is refused, so neither is silently ignored. Without a file the
sizes come from the ``draft:`` keys (an unset one: the target's) and the kind's own settings.
"""

from __future__ import annotations

import importlib
import json
import os

from eagle3_jax import drafts
from eagle3_jax.config import TargetConfig
from eagle3_jax.drafts import DraftConfig, DraftKind
from eagle3_jax.errors import SettingsError
from eagle3_jax.train.shapes import DraftShape


def read_draft_file(cfg) -> dict | None:
    """The draft_config_file's JSON (None without one)."""
    path = cfg.draft_config_file
    if path is None:
        return None
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise SettingsError(f"draft_config_file {path} does not exist; give a draft config.json or its directory")
    try:
        with open(p) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise SettingsError(f"draft_config_file {p} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise SettingsError(f"draft_config_file {p}: expected a JSON object, found {type(d).__name__}")
    return d


def _file_kind(d: dict, where: str) -> DraftKind:
    kind = drafts.for_architectures(d.get("architectures"))
    if kind is None:
        named = " nor ".join(f"{'an' if k.title[0] in 'AEIOU' else 'a'} {k.title} draft ({list(k.architectures)})"
                             for k in drafts.KINDS)
        raise SettingsError(f"draft_config_file {where}: architectures {d.get('architectures')} is neither {named}; "
                            "set architectures there")
    return kind


def resolve_kind(cfg, d: dict | None) -> DraftKind:
    """The draft_config_file's (``d``) architecture's kind, else ``draft_kind``'s, else the default."""
    if cfg.draft_kind is not None and cfg.draft_kind not in drafts.NAMES:
        raise SettingsError(f"draft_kind '{cfg.draft_kind}' is not one of {drafts.NAMES}")
    if d is None:
        return drafts.by_name(cfg.draft_kind) if cfg.draft_kind is not None else drafts.KINDS[0]
    kind = _file_kind(d, cfg.draft_config_file)
    if cfg.draft_kind is not None and cfg.draft_kind != kind.name:
        raise SettingsError(
            f"draft_kind is '{cfg.draft_kind}' but draft_config_file {cfg.draft_config_file} has architectures "
            f"{d.get('architectures')} (a {kind.name} draft); remove draft_kind (the file decides) or give a "
            f"{cfg.draft_kind} draft config")
    return kind


def trainer_class(kind: DraftKind):
    """The training loop the kind names (``module:Class`` in eagle3_jax.train)."""
    module, name = kind.trainer.split(":")
    return getattr(importlib.import_module(f"eagle3_jax.train.{module}"), name)


def check_draft_settings(cfg, tcfg: TargetConfig, kind: DraftKind, d: dict | None) -> None:
    """The draft-kind settings against each other and the target (the sizes are checked when
    ``build_draft_config`` parses the result)."""
    for other in drafts.KINDS:
        key = other.settings_key
        if other is not kind and key is not None and getattr(cfg, key) != type(getattr(cfg, key))():
            raise SettingsError(f"{key} settings ({getattr(cfg, key)}) apply to draft_kind: {other.name}, but this run "
                                f"trains an {kind.name} draft; remove them or set draft_kind: {other.name}")
    if d is not None:
        where = f"draft_config_file {cfg.draft_config_file}"
        if cfg.draft != DraftShape():
            raise SettingsError(f"both draft: ({cfg.draft}) and {where} give the draft's sizes; keep one of them")
        for key, ours in (("hidden_size", tcfg.hidden_size), ("vocab_size", tcfg.vocab_size)):
            if d.get(key) is not None and int(d[key]) != ours:
                raise SettingsError(f"{where}: {key}={d[key]} but the target's {key} is {ours}; the draft reads the "
                                    "target's tokens and states, so they must match")
        if d.get("target_hidden_size") is not None and int(d["target_hidden_size"]) != tcfg.hidden_size:
            raise SettingsError(f"{where}: target_hidden_size={d['target_hidden_size']} but the target's hidden_size "
                                f"is {tcfg.hidden_size}")
        W = cfg.draft_vocab_size
        if W is not None and d.get("draft_vocab_size") is not None and int(d["draft_vocab_size"]) != W:
            raise SettingsError(f"draft_vocab_size={W} but {where} says draft_vocab_size={d['draft_vocab_size']}; "
                                "set it in one place")
    kind.check_train(cfg, tcfg, d)


def build_draft_config(cfg, tcfg: TargetConfig, kind: DraftKind, d: dict | None,
                       aux_ids: tuple[int, ...]) -> DraftConfig:
    """The config (of ``kind``'s class) of the draft the run trains and exports."""
    from_file = d is not None
    where = "train config draft"
    if d is None:
        s = cfg.draft
        hidden = s.hidden_size or tcfg.hidden_size
        heads = s.num_attention_heads or tcfg.num_attention_heads
        d = {
            "architectures": [kind.architectures[0]], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "hidden_size": hidden,
            "intermediate_size": s.intermediate_size or tcfg.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": s.num_key_value_heads or heads,
            "head_dim": s.head_dim or hidden // heads,
            "vocab_size": tcfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size or tcfg.vocab_size,
            "target_hidden_size": tcfg.hidden_size,
            "rms_norm_eps": s.rms_norm_eps or tcfg.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position_embeddings or max(cfg.max_len + cfg.ttt_steps, 2048),
            "tie_word_embeddings": False,
        }
    else:
        where = f"draft_config_file {cfg.draft_config_file}"
        d = dict(d)
        d.setdefault("vocab_size", tcfg.vocab_size)
        d["target_hidden_size"] = tcfg.hidden_size
        d["draft_vocab_size"] = cfg.draft_vocab_size or d.get("draft_vocab_size") or tcfg.vocab_size
    d["eagle_config"] = {**(d.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": list(aux_ids),
                         "use_aux_hidden_state": True}
    return kind.train_config(d, cfg, from_file, where)
