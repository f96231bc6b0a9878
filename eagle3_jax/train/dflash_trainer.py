"""The training loop for ``draft_kind: dflash``: the EAGLE-3 Trainer (data, target states online or
offline, AdamW and its schedule, checkpoints and resume, export) with a DFlash draft, blocks drawn
for each batch, and SpecForge's DFlash loss (dflash_step.py).

The draft reads the target's token embedding and head, frozen, as SpecForge's trainer does; its own
weights start random. It guesses over the target's whole vocab, so no vocab map is built. The
export is SpecForge's ``DFlashDraftModel`` layout with the target layers and the MASK token id it
was trained with (save_draft finds the draft's kind in the registry).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from eagle3_jax.config import resolve_dtype
from eagle3_jax.contracts import check_pairing
from eagle3_jax.drafts.dflash.checkpoint import LoadedDFlash
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.dflash.training import for_export
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.train.dflash_step import DFlashSpec, dflash_train_step, draw_blocks
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.trainer import Trainer


class DFlashTrainer(Trainer):
    train_step = staticmethod(dflash_train_step)
    step_spec = staticmethod(DFlashSpec.from_config)
    draw_row = staticmethod(draw_blocks)

    def _wired_draft(self) -> DFlashDraft:
        cfg, n_aux = self.cfg, len(self.aux_ids)
        mask_id, source = resolve_mask_token_id(self.dcfg, self.mask_tokenizer(), setting="dflash.mask_token_id")
        self.dcfg = for_export(self.dcfg, mask_id, self.tcfg.num_hidden_layers)
        _info("DFlash draft: %d layers, block %d, target layers %s, MASK token id %d (%s)",
              self.dcfg.num_hidden_layers, self.dcfg.block_size, list(self.aux_ids), mask_id, source)
        check_pairing(self.dcfg, self.tcfg, n_aux * self.tcfg.hidden_size, n_aux, None, None)
        return DFlashDraft(self.dcfg, n_aux, resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))

    def loaded_draft(self) -> LoadedDFlash:
        return LoadedDFlash(self.draft_model(), self.target, self.aux_ids)

    def run_step(self, batch: dict) -> dict:
        m, lr = self.apply_step(batch)
        hits, scored = (np.asarray(m[k], np.int64)[1:] for k in ("hits_K", "scored_K"))
        # acc[j - 1]: top-1 agreement with the row's token at block offset j; count[j - 1]: how many
        return {"step": self.step, "loss": float(m["loss"]), "accuracy": float(hits.sum() / max(scored.sum(), 1)),
                "acc": [float(x) for x in hits / np.maximum(scored, 1)], "count": [int(x) for x in scored],
                "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
