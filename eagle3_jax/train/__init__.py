"""Draft training: records (data.py), the grain pipeline (pipeline.py), the target's hidden states
online or stored offline (offline.py), the training-time-test loss (ttt.py), the vocab map
(vocab.py), the loop with checkpoints and export (trainer.py), and its config (config.py); which
draft trains (draft_kind.py), and the P-EAGLE step and loop (peagle_step.py, peagle_trainer.py)."""

from eagle3_jax import preflight
from eagle3_jax.train.config import DraftShape, TrainConfig

__all__ = ["DraftShape", "TrainConfig", "check_setup", "run"]


def check_setup(cfg: TrainConfig) -> None:
    """The settings, then the target/draft pair they name, from config files and headers only."""
    cfg.validate()
    preflight.check_pair(cfg.target, cfg.draft_config(), mesh=cfg.mesh, dtype=cfg.resolved_target_dtype,
                         weights="native")  # the trainer's load_target keeps quantized weights as stored


def run(cfg: TrainConfig, progress: bool = True):
    """What ``python train.py`` does: ``mode=prepare`` writes offline hidden states, ``mode=train`` trains."""
    check_setup(cfg)
    if cfg.mode == "prepare":
        from eagle3_jax.train.offline import prepare_offline

        return prepare_offline(cfg, progress=progress)
    from eagle3_jax.train.draft_kind import trainer_class

    trainer = trainer_class(cfg._draft_file_and_kind()[1])(cfg, progress=progress)
    try:
        return trainer.train()
    finally:
        trainer.close()
