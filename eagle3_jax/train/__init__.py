"""Draft training: records (data.py), the grain pipeline (pipeline.py), the target's hidden states
online or stored offline (offline.py), the training-time-test loss (ttt.py) and step (step.py), the
vocab map (vocab.py), the loop with checkpoints and export (trainer.py), and its config and plan
(config.py); which draft trains (draft_kind.py, through the registry eagle3_jax.drafts), and the
P-EAGLE and DFlash loops (peagle_trainer.py, dflash_trainer.py)."""

from eagle3_jax import preflight
from eagle3_jax.train.config import DraftShape, TrainConfig, TrainPlan

__all__ = ["DraftShape", "TrainConfig", "TrainPlan", "check_setup", "run"]


def check_setup(cfg: TrainConfig) -> TrainPlan:
    """The settings, then the target/draft pair they name, from config files (each read once) and
    headers only, then the data's rendering against serve.py's (train_serve.py); the run's plan, all
    before any weight loads."""
    plan = cfg.resolve()
    preflight.check_pair(cfg.target, plan.draft, mesh=cfg.mesh, dtype=cfg.resolved_target_dtype,
                         weights="native",   # the trainer's load_target keeps quantized weights as stored
                         target_config=plan.target)
    if cfg.data is not None:
        from eagle3_jax.train.data import load_tokenizer
        from eagle3_jax.train_serve import check_rendering

        check_rendering(cfg.data, load_tokenizer(cfg.target))
    return plan


def run(cfg: TrainConfig, progress: bool = True, plan: TrainPlan | None = None):
    """What ``python train.py`` does: ``mode=prepare`` writes offline hidden states, ``mode=train``
    trains. ``plan``: what ``check_setup(cfg)`` returned, when the caller ran it already."""
    plan = plan if plan is not None else check_setup(cfg)
    if cfg.mode == "prepare":
        from eagle3_jax.train.offline import prepare_offline

        return prepare_offline(cfg, progress=progress, plan=plan)
    from eagle3_jax.train.draft_kind import trainer_class

    trainer = trainer_class(plan.kind)(cfg, progress=progress, plan=plan)
    try:
        return trainer.train()
    finally:
        trainer.close()
