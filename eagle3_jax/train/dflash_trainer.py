"""The training loop for ``draft_kind: dflash``: the EAGLE-3 Trainer (data, target states online or
offline, AdamW and its schedule, checkpoints and resume, export) with a DFlash draft, blocks drawn
for each batch, and SpecForge's DFlash loss (dflash_step.py).

The draft reads the target's token embedding and head, frozen, as SpecForge's trainer does; its own
weights start random. It guesses over the target's whole vocab, so no vocab map is built. The
export is SpecForge's ``DFlashDraftModel`` layout with the target layers and the MASK token id it
was trained with (save_draft finds the draft's kind in the registry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import distributed
from eagle3_jax.config import resolve_dtype
from eagle3_jax.contracts import check_pairing
from eagle3_jax.drafts.dflash.checkpoint import LoadedDFlash
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.dflash.training import for_export
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.sharding import mesh_context
from eagle3_jax.train import data as data_lib
from eagle3_jax.train.dflash_step import DFlashSpec, compiled_dflash_step, sample_blocks
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.trainer import Trainer


class DFlashTrainer(Trainer):
    @functools.cached_property
    def spec(self) -> DFlashSpec:
        return DFlashSpec.from_config(self.cfg, self.cfg.max_len)

    def _wired_draft(self) -> DFlashDraft:
        cfg, n_aux = self.cfg, len(self.aux_ids)
        # Offline runs hold no tokenizer; the target directory's one names the MASK candidates.
        tokenizer = self.tokenizer if self.tokenizer is not None else data_lib.load_tokenizer(cfg.target)
        mask_id, source = resolve_mask_token_id(self.dcfg, tokenizer, setting="dflash.mask_token_id")
        self.dcfg = for_export(self.dcfg, mask_id, self.tcfg.num_hidden_layers)
        _info("DFlash draft: %d layers, block %d, target layers %s, MASK token id %d (%s)",
              self.dcfg.num_hidden_layers, self.dcfg.block_size, list(self.aux_ids), mask_id, source)
        check_pairing(self.dcfg, self.tcfg, n_aux * self.tcfg.hidden_size, n_aux, None, None)
        return DFlashDraft(self.dcfg, n_aux, resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))

    @classmethod
    def jitted_step(cls, cfg, graphdef, tgraph, opt_spec, aux_ids, sharding_leaves: tuple, sharding_tree):
        return compiled_dflash_step(graphdef, tgraph, opt_spec, aux_ids, DFlashSpec.from_config(cfg, cfg.max_len),
                                    sharding_leaves, sharding_tree)

    @classmethod
    def draws(cls, cfg, loss_mask_ABT, step: int = 0, first_row: int = 0) -> dict:
        return sample_blocks(loss_mask_ABT, DFlashSpec.from_config(cfg, cfg.max_len), cfg.seed, step, first_row)

    def loaded_draft(self) -> LoadedDFlash:
        return LoadedDFlash(self.draft_model(), self.target, self.aux_ids)

    def run_step(self, batch: dict) -> dict:
        tstate = self.target.state if self.target is not None else None
        lr = self.schedule(self.step)
        with mesh_context(self.mesh):
            self.params, self.opt_state, m = self._step(self.params, self.opt_state, self.rest, self.embed_VD,
                                                        self.lm_head_DV, tstate, batch, jnp.asarray(lr, jnp.float32))
        m = jax.tree.map(distributed.fetch, m)
        self.step += 1
        hits, scored = (np.asarray(m[k], np.int64)[1:] for k in ("hits_K", "scored_K"))
        # acc[j - 1]: top-1 agreement with the row's token at block offset j; count[j - 1]: how many
        return {"step": self.step, "loss": float(m["loss"]), "accuracy": float(hits.sum() / max(scored.sum(), 1)),
                "acc": [float(x) for x in hits / np.maximum(scored, 1)], "count": [int(x) for x in scored],
                "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
