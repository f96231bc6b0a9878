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

import functools
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from eagle3_jax.drafts.dflash.objective import chunked_terms, sample_anchors_host, terms_loss
from eagle3_jax.train.step import OptimizerSpec, accumulate, apply_update, micro_features


@dataclass(frozen=True)
class DFlashSpec:
    """What one DFlash step computes; hashable (the compiled step depends on it)."""

    num_anchors: int
    decay_gamma: float | None = None
    chunk_blocks: int | None = None
    target_chunk: int | None = None

    @classmethod
    def from_config(cls, cfg, max_len: int) -> "DFlashSpec":
        s = cfg.dflash
        # a row of max_len tokens has at most max_len - 1 anchors: more would only add empty blocks
        return cls(min(s.num_anchors, max_len - 1), s.loss_decay_gamma, s.objective_chunk_blocks, cfg.target_chunk)


def sample_blocks(loss_mask_ABT: np.ndarray, spec: DFlashSpec, seed: int, step: int, first_row: int) -> dict:
    """{anchor, keep} [A, B, N] of one optimizer step's rows (``first_row``: the global index of this
    process's first row of each batch)."""
    A, B, _ = loss_mask_ABT.shape
    out = {"anchor": np.zeros((A, B, spec.num_anchors), np.int32), "keep": np.zeros((A, B, spec.num_anchors), bool)}
    for a in range(A):
        for b in range(B):
            rng = np.random.default_rng([seed, step, a, first_row + b])
            out["anchor"][a, b], out["keep"][a, b] = sample_anchors_host(np.asarray(loss_mask_ABT[a, b]),
                                                                         spec.num_anchors, rng)
    return out


def block_loss(draft, embed_VD, lm_head_DV, aux_BSX, mb, spec: DFlashSpec):
    """(loss, {hits_K, scored_K}) of one micro-batch's blocks: what the step differentiates."""
    out_BTD = draft.forward_blocks(aux_BSX, embed_VD, mb["ids"], mb["anchor"], mb["keep"])
    t = chunked_terms(out_BTD, lm_head_DV, mb["ids"], mb["loss_mask"], mb["anchor"], mb["keep"], draft.cfg.block_size,
                      spec.decay_gamma, spec.chunk_blocks)
    return terms_loss(t), {"hits_K": t["hits_K"], "scored_K": t["scored_K"]}


def dflash_train_step(params, opt_state, rest, embed_VD, lm_head_DV, tstate, batch, lr, *, graphdef, tgraph,
                      opt_spec: OptimizerSpec, aux_ids, spec: DFlashSpec):
    """One optimizer step at learning rate ``lr`` over batch arrays shaped [grad_accum, rows, ...]
    (the trainer's ids and loss mask, plus ``anchor`` / ``keep`` from sample_blocks)."""

    def micro(mb):
        aux_BSX, _ = micro_features(mb, tgraph, tstate, aux_ids, spec.target_chunk)

        def loss_fn(p):
            return block_loss(nnx.merge(graphdef, p, rest), embed_VD, lm_head_DV, aux_BSX, mb, spec)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, metrics, grads

    loss, metrics, grads = accumulate(micro, batch)
    params, opt_state, grad_norm = apply_update(params, opt_state, grads, lr, opt_spec)
    return params, opt_state, {"loss": loss, **metrics, "grad_norm": grad_norm}


@functools.lru_cache(maxsize=8)
def compiled_dflash_step(graphdef, tgraph, opt_spec: OptimizerSpec, aux_ids: tuple, spec: DFlashSpec,
                         sharding_leaves: tuple, sharding_tree):
    """The jitted step, its outputs pinned to the shardings its params and moments came in with
    (as step.compiled_step; cached, so a resume in the same process reuses it)."""
    params_sh, opt_sh = jax.tree.unflatten(sharding_tree, sharding_leaves)
    step = functools.partial(dflash_train_step, graphdef=graphdef, tgraph=tgraph, opt_spec=opt_spec,
                             aux_ids=aux_ids, spec=spec)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(params_sh, opt_sh, None))
