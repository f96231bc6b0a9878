"""Draft training: records (data.py), the grain pipeline (pipeline.py), the target's hidden states
online or stored offline (offline.py), the training-time-test loss (ttt.py), the vocab map
(vocab.py), the loop with checkpoints and export (trainer.py), and its config (config.py); which
draft trains (draft_kind.py), and the P-EAGLE step and loop (peagle_step.py, peagle_trainer.py)."""

from eagle3_jax import preflight
from eagle3_jax.train.config import DraftShape, TrainConfig

__all__ = ["DraftShape", "TrainConfig", "check_setup", "run"]


def check_setup(cfg: TrainConfig) -> None:
    """The settings, then the target/draft pair they name, from config files and headers only, then
    the data's rendering against serve.py's (train_serve.py), all before any weight loads."""
    cfg.validate()
    preflight.check_pair(cfg.target, cfg.draft_config(), mesh=cfg.mesh, dtype=cfg.resolved_target_dtype,
                         weights="native")  # the trainer's load_target keeps quantized weights as stored
    if cfg.data is not None:
        from eagle3_jax.train.data import load_tokenizer
        from eagle3_jax.train_serve import check_rendering

        check_rendering(cfg.data, load_tokenizer(cfg.target))


def run(cfg: TrainConfig, progress: bool = True):
    """What ``python train.py`` does: ``mode=prepare`` writes offline hidden states, ``mode=train`` trains."""
    check_setup(cfg)
    if cfg.mode == "prepare":
        from eagle3_jax.train.offline import prepare_offline

        return prepare_offline(cfg, progress=progress)
    if cfg.resolved_draft_kind == "peagle":
        from eagle3_jax.train.peagle_trainer import PEagleTrainer as Trainer
    else:
        from eagle3_jax.train.trainer import Trainer

    trainer = Trainer(cfg, progress=progress)
    try:
        return trainer.train()
    finally:
        trainer.close()
