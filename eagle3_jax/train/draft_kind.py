"""Which draft a run trains, and the config.json it trains and exports.

``draft_kind`` is ``eagle3`` (SpecForge's ``LlamaForCausalLMEagle3`` chain draft, trained by
training-time test) or ``peagle`` (parallel drafting, SpecForge's ``PEagleDraftModel``, trained on
COD-sampled rollouts). A ``draft_config_file`` (a draft config.json, e.g. SpecForge's
``configs/qwen3-8b-peagle.json``) gives the draft's sizes and, by its architecture, the kind; a
``draft_kind`` that disagrees with it is refused, so neither is silently ignored. Without a file
the sizes come from the ``draft:`` keys (an unset one: the target's) and ``peagle.*``.

The MASK token of a P-EAGLE draft, which SpecForge's trainer picks but does not write into
config.json (our export does): ``peagle.mask_token_id``, else the draft config file's, else the
tokenizer's mask token, else the first embedding row past the tokenizer's vocabulary (a row no
text uses), else the tokenizer's pad token, else its first end-of-sequence id (SpecForge's order).
"""

from __future__ import annotations

import json
import os

from eagle3_jax.config import DraftConfig, TargetConfig
from eagle3_jax.config.draft import DRAFT_ARCHITECTURES
from eagle3_jax.config.peagle import PEAGLE_ARCHITECTURES, PEagleConfig, is_peagle_config
from eagle3_jax.errors import ConfigError, SettingsError
from eagle3_jax.train.shapes import DraftShape, PEagleShape

DRAFT_KINDS = ("eagle3", "peagle")
DEFAULT_PEAGLE_LAYERS = 4   # SpecForge's P-EAGLE recipe (configs/qwen3-8b-peagle.json)


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


def _file_kind(d: dict, where: str) -> str:
    if is_peagle_config(d):
        return "peagle"
    if any(a in DRAFT_ARCHITECTURES for a in d.get("architectures") or []):
        return "eagle3"
    raise SettingsError(
        f"draft_config_file {where}: architectures {d.get('architectures')} is neither an EAGLE-3 draft "
        f"({list(DRAFT_ARCHITECTURES)}) nor a P-EAGLE one ({list(PEAGLE_ARCHITECTURES)}); set architectures there")


def resolve_kind(cfg) -> str:
    """``eagle3`` or ``peagle``: the draft_config_file's architecture, else ``draft_kind``, else eagle3."""
    if cfg.draft_kind is not None and cfg.draft_kind not in DRAFT_KINDS:
        raise SettingsError(f"draft_kind '{cfg.draft_kind}' is not one of {DRAFT_KINDS}")
    d = read_draft_file(cfg)
    if d is None:
        return cfg.draft_kind or "eagle3"
    kind = _file_kind(d, cfg.draft_config_file)
    if cfg.draft_kind is not None and cfg.draft_kind != kind:
        raise SettingsError(
            f"draft_kind is '{cfg.draft_kind}' but draft_config_file {cfg.draft_config_file} has architectures "
            f"{d.get('architectures')} (a {kind} draft); remove draft_kind (the file decides) or give a "
            f"{cfg.draft_kind} draft config")
    return kind


def file_aux_ids(cfg) -> tuple[int, ...] | None:
    d = read_draft_file(cfg)
    ids = ((d or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else tuple(int(i) for i in ids)


def check_draft_settings(cfg, tcfg: TargetConfig) -> None:
    """The draft-kind settings against each other and the target (the sizes are checked when
    ``build_draft_config`` parses the result)."""
    kind = resolve_kind(cfg)
    d = read_draft_file(cfg)
    s = cfg.peagle
    if kind == "eagle3" and s != PEagleShape():
        raise SettingsError(f"peagle settings ({s}) apply to draft_kind: peagle, but this run trains an eagle3 draft; "
                            "remove them or set draft_kind: peagle")
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
        for key, ours in (("draft_vocab_size", cfg.draft_vocab_size), ("num_hidden_layers", s.num_hidden_layers)):
            if ours is not None and d.get(key) is not None and int(d[key]) != ours:
                name = key if key == "draft_vocab_size" else "peagle." + key
                raise SettingsError(f"{name}={ours} but {where} says {key}={d[key]}; set it in one place")
    if kind != "peagle":
        return
    if cfg.lk_loss_type is not None:
        raise SettingsError(f"lk_loss_type '{cfg.lk_loss_type}' is EAGLE-3's acceptance-aware TTT loss; a P-EAGLE "
                            "draft trains on SpecForge's soft-label cross-entropy. Unset lk_loss_type")
    if cfg.specforge_batch != 1:
        raise SettingsError(f"specforge_batch={cfg.specforge_batch}: SpecForge trains P-EAGLE one row a device, and "
                            "the specforge convention averages the rows' own losses; leave specforge_batch at 1")
    if s.num_hidden_layers is not None and s.num_hidden_layers < 1:
        raise SettingsError(f"peagle.num_hidden_layers must be >= 1, found {s.num_hidden_layers}")
    if s.num_depths < 1:
        raise SettingsError(f"peagle.num_depths must be >= 1 (depth 0 is the known positions), found {s.num_depths}")
    if not (0 < s.down_sample_ratio <= 1 and 0 <= s.down_sample_ratio_min <= 1):
        raise SettingsError(f"peagle.down_sample_ratio ({s.down_sample_ratio}) must lie in (0, 1] and "
                            f"peagle.down_sample_ratio_min ({s.down_sample_ratio_min}) in [0, 1]")
    if s.mask_token_id is not None and not 0 <= s.mask_token_id < tcfg.vocab_size:
        raise SettingsError(f"peagle.mask_token_id={s.mask_token_id} is outside the vocab [0, {tcfg.vocab_size})")


def build_draft_config(cfg, tcfg: TargetConfig) -> DraftConfig:
    kind = resolve_kind(cfg)
    aux_ids = list(cfg.resolved_aux_ids(tcfg))
    d = read_draft_file(cfg)
    where = "train config draft"
    if d is None:
        s = cfg.draft
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
    d["eagle_config"] = {**(d.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": aux_ids,
                         "use_aux_hidden_state": True}
    if kind == "eagle3":
        return DraftConfig.from_hf_dict(d, where=where)
    d["architectures"] = list(PEAGLE_ARCHITECTURES)
    file_layers = d.get("num_hidden_layers") if cfg.draft_config_file is not None else None
    d["num_hidden_layers"] = cfg.peagle.num_hidden_layers or file_layers or DEFAULT_PEAGLE_LAYERS
    return PEagleConfig.from_hf_dict(d, where=where, mask_token_id=cfg.peagle.mask_token_id)


def resolve_mask_token_id(dcfg: PEagleConfig, tokenizer) -> tuple[int, str]:
    """(id, where it came from) of the MASK token, by the module docstring's order."""
    from eagle3_jax.tokenizer import _token_content as _content

    V = dcfg.vocab_size
    candidates = [("the draft config", dcfg.mask_token_id)]
    if tokenizer is not None:
        conf = tokenizer.config or {}
        token_id = lambda key: (tokenizer.token_to_id(_content(conf.get(key)))  # noqa: E731
                                if _content(conf.get(key)) is not None else None)
        candidates += [("the tokenizer's mask token", token_id("mask_token")),
                       ("the first embedding row past the tokenizer's vocabulary",
                        tokenizer.vocab_size if tokenizer.vocab_size < V else None),
                       ("the tokenizer's pad token", token_id("pad_token")),
                       ("the tokenizer's end-of-sequence token",
                        tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)]
    for source, candidate in candidates:
        if candidate is not None and 0 <= int(candidate) < V:
            return int(candidate), source
    raise ConfigError(f"no MASK token id for the P-EAGLE draft: none of {[s for s, _ in candidates]} gives one in "
                      f"[0, {V}); set peagle.mask_token_id")
