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
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import distributed
from eagle3_jax.config import resolve_dtype
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.sharding import mesh_context
from eagle3_jax.train import data as data_lib
from eagle3_jax.train.peagle_step import PEagleSpec, compiled_peagle_step, sample_rollouts
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.trainer import Trainer


class PEagleTrainer(Trainer):
    @functools.cached_property
    def spec(self) -> PEagleSpec:
        return PEagleSpec.from_config(self.cfg)

    def _new_draft(self) -> PEagleDraft:
        cfg = self.cfg
        # Offline runs hold no tokenizer; the target directory's one names the MASK candidates.
        tokenizer = self.tokenizer if self.tokenizer is not None else data_lib.load_tokenizer(cfg.target)
        mask_id, source = resolve_mask_token_id(self.dcfg, tokenizer)
        self.dcfg = dataclasses.replace(self.dcfg, mask_token_id=mask_id)
        _info("P-EAGLE draft: %d layers, MASK token id %d (%s)", self.dcfg.num_hidden_layers, mask_id, source)
        model = PEagleDraft(self.dcfg, len(self.aux_ids), resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))
        # A copy: the step donates the draft's params, and this buffer is also the target's embedding.
        model.embed_tokens[...] = jnp.array(self.embed_VD, model.dtype, copy=True)
        return model

    STEP_HEAD = ("lm_head_DV",)   # the draft holds its own copy of the embedding

    @classmethod
    def jitted_step(cls, cfg, graphdef, tgraph, opt_spec, aux_ids, sharding_leaves: tuple, sharding_tree):
        return compiled_peagle_step(graphdef, tgraph, opt_spec, aux_ids, PEagleSpec.from_config(cfg),
                                    sharding_leaves, sharding_tree)

    @classmethod
    def draws(cls, cfg, loss_mask_ABT, step: int = 0, first_row: int = 0) -> dict:
        return sample_rollouts(loss_mask_ABT, PEagleSpec.from_config(cfg), cfg.seed, step, first_row)

    def run_step(self, batch: dict) -> dict:
        tstate = self.target.state if self.target is not None else None
        lr = self.schedule(self.step)
        with mesh_context(self.mesh):
            self.params, self.opt_state, m = self._step(self.params, self.opt_state, self.rest, self.lm_head_DV,
                                                        tstate, batch, jnp.asarray(lr, jnp.float32))
        m = jax.tree.map(distributed.fetch, m)
        self.step += 1
        total = np.asarray(m["acc_total"], np.int64)
        # acc[d]: top-1 agreement with the target at depth d of the sampled rollouts; count[d]: how many
        return {"step": self.step, "loss": float(m["loss"]),
                "acc": [float(x) for x in np.asarray(m["acc_sum"]) / np.maximum(total, 1)],
                "count": [int(x) for x in total], "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
