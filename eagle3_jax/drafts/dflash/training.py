"""What a training run needs from the DFlash kind: its settings checks, the target layers it reads,
and the config it trains and exports, by SpecForge's recipe: one draft layer, ``block_size`` 16, one
target layer read per draft layer unless the draft config names them, and a MASK token (chosen as
P-EAGLE's) written into ``dflash_config.mask_token_id``.
"""

from __future__ import annotations

import dataclasses

from eagle3_jax.drafts.dflash.config import DFLASH_ARCHITECTURES, FULL, DFlashConfig, default_target_layer_ids
from eagle3_jax.errors import SettingsError

DEFAULT_DFLASH_LAYERS = 1    # SpecForge's target-derived DFlash config
DEFAULT_BLOCK_SIZE = 16      # the same


def _layers(cfg, file: dict | None) -> int:
    return cfg.dflash.num_hidden_layers or int((file or {}).get("num_hidden_layers") or DEFAULT_DFLASH_LAYERS)


def train_aux_ids(file: dict | None, cfg, tcfg) -> tuple[int, ...]:
    """The draft file's ``dflash_config.target_layer_ids``, else SpecForge's spread."""
    ids = ((file or {}).get("dflash_config") or {}).get("target_layer_ids")
    if ids is not None:
        return tuple(int(i) for i in ids)
    return default_target_layer_ids(tcfg.num_hidden_layers, _layers(cfg, file))


def check_train(cfg, tcfg, file: dict | None) -> None:
    """The run's ``dflash.*`` settings, and the settings of other objectives it cannot use."""
    s = cfg.dflash
    stored = (file or {}).get("num_hidden_layers")
    if s.num_hidden_layers is not None and stored is not None and int(stored) != s.num_hidden_layers:
        raise SettingsError(f"dflash.num_hidden_layers={s.num_hidden_layers} but draft_config_file "
                            f"{cfg.draft_config_file} says num_hidden_layers={stored}; set it in one place")
    if cfg.lk_loss_type is not None or cfg.loss_convention != "ours" or cfg.specforge_batch != 1:
        raise SettingsError("lk_loss_type, loss_convention and specforge_batch choose EAGLE-3's TTT loss; a DFlash "
                            "draft trains on SpecForge's DFlash loss (one convention: the weighted mean over the "
                            "batch's blocks). Leave them unset")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != tcfg.vocab_size:
        raise SettingsError(f"draft_vocab_size={cfg.draft_vocab_size}: a DFlash draft guesses through the target's "
                            f"own head, over its whole vocab ({tcfg.vocab_size}); leave draft_vocab_size unset")
    if s.num_hidden_layers is not None and s.num_hidden_layers < 1:
        raise SettingsError(f"dflash.num_hidden_layers must be >= 1, found {s.num_hidden_layers}")
    if s.block_size is not None and s.block_size < 2:   # the anchor's token and at least one guess
        raise SettingsError(f"dflash.block_size must be >= 2, found {s.block_size}")
    if s.num_anchors < 1 or s.objective_chunk_blocks < 0:
        raise SettingsError(f"dflash.num_anchors (blocks a row, {s.num_anchors}) must be >= 1 and "
                            f"dflash.objective_chunk_blocks ({s.objective_chunk_blocks}) >= 0")
    if s.loss_decay_gamma is not None and s.loss_decay_gamma < 0:
        raise SettingsError(f"dflash.loss_decay_gamma must be >= 0 (0 or unset: no decay), found {s.loss_decay_gamma}")
    block = s.block_size or int((file or {}).get("block_size") or DEFAULT_BLOCK_SIZE)
    if cfg.eval_every > 0 and cfg.eval_draft_tokens > block - 1:
        raise SettingsError(f"eval_draft_tokens={cfg.eval_draft_tokens}, but one block pass guesses at most "
                            f"block_size - 1 = {block - 1} tokens; lower eval_draft_tokens or raise dflash.block_size")
    if s.mask_token_id is not None and not 0 <= s.mask_token_id < tcfg.vocab_size:
        raise SettingsError(f"dflash.mask_token_id={s.mask_token_id} is outside the vocab [0, {tcfg.vocab_size})")


def train_config(d: dict, cfg, from_file: bool, where: str) -> DFlashConfig:
    """``d``: the draft config.json the run trains (the file's, or one made from the ``draft:`` keys),
    its ``eagle_config`` naming the run's aux ids: rewritten as SpecForge's DFlash config."""
    s = cfg.dflash
    ids = [int(i) for i in d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    d = {k: v for k, v in d.items() if k not in ("eagle_config", "draft_vocab_size", "target_hidden_size")}
    extra = dict(d.get("dflash_config") or {})
    layers = _layers(cfg, d if from_file else None)
    d["architectures"] = list(DFLASH_ARCHITECTURES)
    if not from_file:
        d.update(model_type="qwen3", layer_types=[FULL] * layers)
    d["num_hidden_layers"] = layers
    d["block_size"] = s.block_size or d.get("block_size") or extra.get("block_size") or DEFAULT_BLOCK_SIZE
    extra["target_layer_ids"] = ids
    if s.mask_token_id is not None:
        extra["mask_token_id"] = s.mask_token_id
    d["dflash_config"] = extra
    return DFlashConfig.from_hf_dict(d, where=where)


def for_export(dcfg: DFlashConfig, mask_token_id: int, num_target_layers: int) -> DFlashConfig:
    """``dcfg`` trained with ``mask_token_id`` for a target of ``num_target_layers`` layers, its
    config.json (``hf_config``) saying both: SpecForge's class reads ``num_target_layers`` even
    where ``target_layer_ids`` is given."""
    hf = dict(dcfg.hf_config, num_target_layers=int(num_target_layers))
    hf["dflash_config"] = {**(hf.get("dflash_config") or {}), "mask_token_id": int(mask_token_id)}
    return dataclasses.replace(dcfg, mask_token_id=int(mask_token_id), hf_config=hf)
