"""DFlash, block drafting (SpecForge ``DFlashDraftModel``): Qwen3-style layers over the target's
context states that guess a round's K tokens in one pass over a block of MASK tokens (``propose``),
read through the target's own head; SpecForge's objective in ``objective`` (no training loop yet)."""

from eagle3_jax.drafts.dflash import checkpoint
from eagle3_jax.drafts.dflash.config import DFLASH_ARCHITECTURES, DFlashConfig
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.dflash.propose import catch_up, propose_block
from eagle3_jax.drafts.kind import DraftKind
from eagle3_jax.errors import SettingsError


def _notes(cfg: DFlashConfig, where: str) -> list[str]:
    if cfg.mask_token_id is None:
        return [f"{where}: DFlash draft without dflash_config.mask_token_id: it cannot propose until one is set"]
    return []


def _train_config(d: dict, cfg, from_file: bool, where: str) -> DFlashConfig:
    return DFlashConfig.from_hf_dict(d, where=where)


def _check_train(cfg, tcfg, file: dict | None) -> None:
    raise SettingsError("training a DFlash draft is not implemented: its objective is (SpecForge's, "
                        "eagle3_jax/drafts/dflash/objective.py), a training loop over it is not; train it with "
                        "SpecForge and load the export with load_draft")


KIND = DraftKind(
    name="dflash", title="DFlash", architectures=DFLASH_ARCHITECTURES, config=DFlashConfig, module=DFlashDraft,
    load=checkpoint.load, build=checkpoint.build, save=checkpoint.save, wiring=checkpoint.wiring,
    convert_table=checkpoint.convert_table, propose=propose_block, catch_up=catch_up, seeded=False,
    trainer="", train_config=_train_config, check_train=_check_train, notes=_notes)
