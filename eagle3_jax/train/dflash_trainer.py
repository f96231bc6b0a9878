"""The training loop for ``draft_kind: dflash``: the Trainer with a DFlash draft, blocks drawn for
each batch (on the host: step.host_draws), and SpecForge's DFlash loss (drafts/dflash/objective.py).

The draft reads the target's token embedding and head, frozen, as SpecForge's trainer does; its own
weights start random; it guesses over the target's whole vocab, so no vocab map is built. The export
is SpecForge's ``DFlashDraftModel`` layout with the target layers and the MASK token id it was
trained with. Rows are what SpecForge's DFlash capture stores (token x_t and the target's states at
t, unshifted); micro-batches' losses are averaged, as its gradient accumulation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flax import nnx

from eagle3_jax.config import resolve_dtype
from eagle3_jax.contracts import check_pairing
from eagle3_jax.drafts.dflash.checkpoint import LoadedDFlash
from eagle3_jax.drafts.dflash.model import DFlashDraft
from eagle3_jax.drafts.dflash.objective import chunked_terms, sample_anchors_host, terms_loss
from eagle3_jax.drafts.dflash.training import for_export
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.step import OptimizerSpec, optimizer_step
from eagle3_jax.train.trainer import Trainer


@dataclass(frozen=True)
class DFlashSpec:
    """What one DFlash step computes; hashable (the compiled step depends on it)."""

    num_anchors: int
    decay_gamma: float | None = None
    chunk_blocks: int | None = None
    target_chunk: int | None = None

    @classmethod
    def from_config(cls, cfg) -> "DFlashSpec":
        s = cfg.dflash
        # a row of max_len tokens has at most max_len - 1 anchors: more would only add empty blocks
        return cls(min(s.num_anchors, cfg.max_len - 1), s.loss_decay_gamma, s.objective_chunk_blocks, cfg.target_chunk)


def draw_blocks(loss_mask_T: np.ndarray, spec: DFlashSpec, rng: np.random.Generator) -> dict:
    """{anchor, keep} [N] of a row's blocks (the trainer's ``draw_row``)."""
    anchor, keep = sample_anchors_host(loss_mask_T, spec.num_anchors, rng)
    return {"anchor": anchor, "keep": keep}


def block_loss(draft, embed_VD, lm_head_DV, aux_BSX, mb, spec: DFlashSpec):
    """(loss, {hits_K, scored_K}) of one micro-batch's blocks: what the step differentiates."""
    out_BTD = draft.forward_blocks(aux_BSX, embed_VD, mb["ids"], mb["anchor"], mb["keep"])
    t = chunked_terms(out_BTD, lm_head_DV, mb["ids"], mb["loss_mask"], mb["anchor"], mb["keep"], draft.cfg.block_size,
                      spec.decay_gamma, spec.chunk_blocks)
    return terms_loss(t), {"hits_K": t["hits_K"], "scored_K": t["scored_K"]}


def dflash_train_step(params, opt_state, rest, embed_VD, lm_head_DV, tstate, batch, lr, *, graphdef, tgraph,
                      opt_spec: OptimizerSpec, aux_ids, spec: DFlashSpec):
    """The DFlash optimizer step; the batch carries ``anchor`` / ``keep`` from draw_blocks."""

    def objective(p, mb, aux_BSX, _):
        return block_loss(nnx.merge(graphdef, p, rest), embed_VD, lm_head_DV, aux_BSX, mb, spec)

    return optimizer_step(objective, params, opt_state, tstate, batch, lr, tgraph, opt_spec, aux_ids, spec.target_chunk)


class DFlashTrainer(Trainer):
    train_step = staticmethod(dflash_train_step)
    step_spec = staticmethod(DFlashSpec.from_config)
    draw_row = staticmethod(draw_blocks)
    loaded_class = LoadedDFlash

    def _wired_draft(self) -> DFlashDraft:
        cfg, n_aux = self.cfg, len(self.aux_ids)
        mask_id, source = resolve_mask_token_id(self.dcfg, self.mask_tokenizer(), setting="dflash.mask_token_id")
        self.dcfg = for_export(self.dcfg, mask_id, self.tcfg.num_hidden_layers)
        _info("DFlash draft: %d layers, block %d, target layers %s, MASK token id %d (%s)",
              self.dcfg.num_hidden_layers, self.dcfg.block_size, list(self.aux_ids), mask_id, source)
        check_pairing(self.dcfg, self.tcfg, n_aux * self.tcfg.hidden_size, n_aux, None, None)
        return DFlashDraft(self.dcfg, n_aux, resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))

    def run_step(self, batch: dict) -> dict:
        m, lr = self.apply_step(batch)
        hits, scored = (np.asarray(m[k], np.int64)[1:] for k in ("hits_K", "scored_K"))
        # acc[j - 1]: top-1 agreement with the row's token at block offset j; count[j - 1]: how many
        return {"step": self.step, "loss": float(m["loss"]), "accuracy": float(hits.sum() / max(scored.sum(), 1)),
                "acc": [float(x) for x in hits / np.maximum(scored, 1)], "count": [int(x) for x in scored],
                "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
