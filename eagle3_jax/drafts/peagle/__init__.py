"""P-EAGLE, parallel drafting (SpecForge ``PEagleDraftModel``): a stack of decoder layers that
guesses a round's K tokens in one pass over MASK positions (``propose``), trained on COD-sampled
rollouts (``objective``, loop ``train.peagle_trainer``)."""

from eagle3_jax.drafts.eagle3.layout import wiring
from eagle3_jax.drafts.kind import DraftKind, catch_up_by_rereading
from eagle3_jax.drafts.peagle import checkpoint, training
from eagle3_jax.drafts.peagle.config import PEAGLE_ARCHITECTURES, PEagleConfig
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.drafts.peagle.propose import propose_parallel


def _notes(cfg: PEagleConfig, where: str) -> list[str]:
    if cfg.mask_token_id is None:
        return [f"{where}: P-EAGLE draft without mask_token_id in config.json; pass the id it was trained with "
                "when loading it"]
    return []


KIND = DraftKind(
    name="peagle", title="P-EAGLE", architectures=PEAGLE_ARCHITECTURES, config=PEagleConfig, module=PEagleDraft,
    load=checkpoint.load, build=checkpoint.build_peagle_draft, save=checkpoint.save,
    wiring=wiring, convert_table=checkpoint.convert_table,
    propose=propose_parallel, catch_up=catch_up_by_rereading,
    trainer="peagle_trainer:PEagleTrainer", train_config=training.train_config, check_train=training.check_train,
    settings_key="peagle", notes=_notes)
