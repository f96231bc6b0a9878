"""The training loop for ``draft_kind: peagle``: the EAGLE-3 Trainer (data, target states online or
offline, vocab map, AdamW and its schedule, checkpoints and resume, export) with a P-EAGLE draft,
COD-sampled rollouts added to each batch, and SpecForge's P-EAGLE loss (peagle_step.py).

The draft starts from the target's token embedding and trains it, as SpecForge does (its P-EAGLE
draft loads the target's embedding and leaves it trainable); the other weights start random. The
export is SpecForge's ``PEagleDraftModel`` layout with the aux ids and the MASK token id it was
trained with (save_draft finds the draft's kind in the registry).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.config import resolve_dtype
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.train.peagle_step import PEagleSpec, draw_rollouts, peagle_train_step
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.trainer import Trainer


class PEagleTrainer(Trainer):
    train_step = staticmethod(peagle_train_step)
    STEP_HEAD = ("lm_head_DV",)   # the draft holds its own copy of the embedding
    step_spec = staticmethod(PEagleSpec.from_config)
    draw_row = staticmethod(draw_rollouts)

    def _new_draft(self) -> PEagleDraft:
        cfg = self.cfg
        mask_id, source = resolve_mask_token_id(self.dcfg, self.mask_tokenizer())
        self.dcfg = dataclasses.replace(self.dcfg, mask_token_id=mask_id)
        _info("P-EAGLE draft: %d layers, MASK token id %d (%s)", self.dcfg.num_hidden_layers, mask_id, source)
        model = PEagleDraft(self.dcfg, len(self.aux_ids), resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))
        # A copy: the step donates the draft's params, and this buffer is also the target's embedding.
        model.embed_tokens[...] = jnp.array(self.embed_VD, model.dtype, copy=True)
        return model

    def run_step(self, batch: dict) -> dict:
        m, lr = self.apply_step(batch)
        total = np.asarray(m["acc_total"], np.int64)
        # acc[d]: top-1 agreement with the target at depth d of the sampled rollouts; count[d]: how many
        return {"step": self.step, "loss": float(m["loss"]),
                "acc": [float(x) for x in np.asarray(m["acc_sum"]) / np.maximum(total, 1)],
                "count": [int(x) for x in total], "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
