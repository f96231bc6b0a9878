"""DFlash, block drafting (SpecForge ``DFlashDraftModel``): Qwen3-style layers over the target's
context states that guess a round's K tokens in one pass over a block of MASK tokens (``propose``),
read through the target's own head; trained on SpecForge's objective (``objective``, ``training``,
loop ``train.dflash_trainer``)."""

from eagle3_jax.drafts.dflash import checkpoint, training
from eagle3_jax.drafts.dflash.config import DFLASH_ARCHITECTURES, DFlashConfig
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.dflash.propose import catch_up, propose_block
from eagle3_jax.drafts.kind import DraftKind


def _notes(cfg: DFlashConfig, where: str) -> list[str]:
    if cfg.mask_token_id is None:
        return [f"{where}: DFlash draft without dflash_config.mask_token_id: it cannot propose until one is set"]
    return []


KIND = DraftKind(
    name="dflash", title="DFlash", architectures=DFLASH_ARCHITECTURES, config=DFlashConfig, module=DFlashDraft,
    load=checkpoint.load, build=checkpoint.build, save=checkpoint.save, wiring=checkpoint.wiring,
    convert_table=checkpoint.convert_table, propose=propose_block, catch_up=catch_up, seeded=False,
    trainer="dflash_trainer:DFlashTrainer", train_config=training.train_config, check_train=training.check_train,
    settings_key="dflash", train_aux_ids=training.train_aux_ids, notes=_notes)
