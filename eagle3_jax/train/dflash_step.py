"""The DFlash training step: the frozen target's states at the draft's layers (online, or stored
offline, as for EAGLE-3), blocks anchored where the host's draw put them, SpecForge's DFlash loss
(drafts/dflash/objective.py), and the shared AdamW update.

Pairing. The trainer's rows are what SpecForge's DFlash capture stores: token x_t and the target's
states at t, unshifted. A block anchored at a holds x_a and MASK tokens at a+1.., reads the context
before a, and offset j is scored against the row's own x_{a+j} (hard labels: the target's final
states and logits are not read). Which blocks count: anchors where x_a and x_{a+1} are both loss
tokens, up to ``dflash.num_anchors`` a row. The loss is SpecForge's over one device's batch: the
weighted mean over every scored token of the micro-batch's rows; micro-batches are averaged, as
its gradient accumulation does.

Anchors are drawn host-side before the batch goes to the devices, one generator per (seed, step,
micro-batch, global row): a resumed run draws what the uninterrupted one drew, and the draw does
not depend on which process reads the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flax import nnx

from eagle3_jax.drafts.dflash.objective import chunked_terms, sample_anchors_host, terms_loss
from eagle3_jax.train.step import OptimizerSpec, optimizer_step


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
    """The DFlash optimizer step (step.optimizer_step); the batch carries ``anchor`` / ``keep`` from
    draw_blocks."""

    def objective(p, mb, aux_BSX, _):
        return block_loss(nnx.merge(graphdef, p, rest), embed_VD, lm_head_DV, aux_BSX, mb, spec)

    params, opt_state, loss, metrics, grad_norm = optimizer_step(objective, params, opt_state, tstate, batch, lr,
                                                                 tgraph, opt_spec, aux_ids, spec.target_chunk)
    return params, opt_state, {"loss": loss, **metrics, "grad_norm": grad_norm}
