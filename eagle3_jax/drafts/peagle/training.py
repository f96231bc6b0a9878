"""What a training run needs from the P-EAGLE kind: its settings checks, the config it trains and
exports, and the MASK token it trains with, in SpecForge's order: ``peagle.mask_token_id``, else
the draft config file's, else the tokenizer's mask token, else the first embedding row past the
tokenizer's vocabulary (a row no text uses), else its pad token, else its first end-of-sequence id.
"""

from __future__ import annotations

from eagle3_jax.drafts.peagle.config import PEAGLE_ARCHITECTURES, PEagleConfig
from eagle3_jax.errors import ConfigError, SettingsError

DEFAULT_PEAGLE_LAYERS = 4   # SpecForge's P-EAGLE recipe (configs/qwen3-8b-peagle.json)


def check_train(cfg, tcfg, file: dict | None) -> None:
    """The run's ``peagle.*`` settings (and the EAGLE-3 loss settings it cannot use)."""
    s = cfg.peagle
    stored = (file or {}).get("num_hidden_layers")
    if s.num_hidden_layers is not None and stored is not None and int(stored) != s.num_hidden_layers:
        raise SettingsError(f"peagle.num_hidden_layers={s.num_hidden_layers} but draft_config_file "
                            f"{cfg.draft_config_file} says num_hidden_layers={stored}; set it in one place")
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


def train_config(d: dict, cfg, from_file: bool, where: str) -> PEagleConfig:
    """``d``: the draft config.json the run trains (the file's, or one made from the ``draft:`` keys)."""
    d["architectures"] = list(PEAGLE_ARCHITECTURES)
    file_layers = d.get("num_hidden_layers") if from_file else None
    d["num_hidden_layers"] = cfg.peagle.num_hidden_layers or file_layers or DEFAULT_PEAGLE_LAYERS
    return PEagleConfig.from_hf_dict(d, where=where, mask_token_id=cfg.peagle.mask_token_id)


def resolve_mask_token_id(dcfg, tokenizer, setting: str = "peagle.mask_token_id") -> tuple[int, str]:
    """(id, where it came from) of the MASK token of a draft config (``mask_token_id``, ``vocab_size``),
    by the module docstring's order; ``setting``: the key that sets it."""
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
    raise ConfigError(f"no MASK token id for the draft: none of {[s for s, _ in candidates]} gives one in "
                      f"[0, {V}); set {setting}")
