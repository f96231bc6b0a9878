"""The jitted training step: a draft kind's loss over a batch (grad-accumulated), clipping, AdamW;
apart from the loop (trainer.py), so the planner (tools/plan/train.py) compiles exactly the program
the Trainer runs, from the same ``compiled_step``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle3_jax.train import offline as offline_lib
from eagle3_jax.train.config import TrainConfig
from eagle3_jax.train.ttt import LossSpec, target_signal_from_hidden, ttt_loss


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW after global-norm clipping, as hashable data: the compiled step depends on these, while
    the learning rate comes in as an argument (so the schedule and run length never recompile it)."""

    grad_clip: float
    weight_decay: float
    b1: float
    b2: float

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "OptimizerSpec":
        return cls(cfg.grad_clip, cfg.weight_decay, cfg.betas[0], cfg.betas[1])

    def build(self, learning_rate=0.0) -> optax.GradientTransformation:
        parts = [optax.clip_by_global_norm(self.grad_clip)] if self.grad_clip > 0 else []
        parts.append(optax.adamw(learning_rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay))
        return optax.chain(*parts)


def map_moments(opt_state, params, moment, other=lambda x: x):
    """``moment(subtree)`` on every subtree of the optimizer state shaped like ``params`` (AdamW's
    moments), ``other(leaf)`` on the rest (step counts). Matched by tree structure, so it works on
    abstract values too (optax.tree_map_params would run the optimizer's init)."""
    ptree = jax.tree.structure(params)

    def like_params(x) -> bool:
        return jax.tree.structure(x) == ptree

    return jax.tree.map(lambda x: moment(x) if like_params(x) else other(x), opt_state, is_leaf=like_params)


def init_optimizer(opt_spec: OptimizerSpec, params):
    """The optimizer state of ``params``, its moments placed like their parameters (XLA lays fresh
    zeros out as it likes: replicated, where the parameters are split)."""
    placement = jax.tree.map(lambda p: p.sharding, params)
    return map_moments(jax.jit(opt_spec.build().init)(params), params, lambda m: jax.device_put(m, placement))


def loss_spec(cfg: TrainConfig) -> LossSpec:
    return LossSpec(steps=cfg.ttt_steps, decay=cfg.loss_decay, convention=cfg.loss_convention,
                    lk_loss_type=cfg.lk_loss_type, kl_scale=cfg.kl_scale, kl_decay=cfg.kl_decay,
                    attention=cfg.attention, attention_block=cfg.attention_block, loss_chunk=cfg.loss_chunk,
                    target_chunk=cfg.target_chunk, remat=cfg.remat, specforge_batch=cfg.specforge_batch)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup over ``warmup_ratio`` of the steps, then cosine decay to 0 at ``total_steps``."""
    warmup = max(1, round(cfg.warmup_ratio * cfg.total_steps)) if cfg.warmup_ratio > 0 else 0
    if warmup:
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.total_steps, warmup + 1))
    return optax.cosine_decay_schedule(cfg.lr, cfg.total_steps)


def train_step(params, opt_state, rest, embed_VD, lm_head_DV, tstate, batch, lr, *, graphdef, tgraph,
               opt_spec: OptimizerSpec, aux_ids, spec: LossSpec):
    """The EAGLE-3 (training-time test) optimizer step (``optimizer_step``)."""

    def objective(p, mb, aux_BTX, hidden_BTD):
        loss, m = batch_loss(p, rest, embed_VD, lm_head_DV, aux_BTX, hidden_BTD, mb, graphdef=graphdef, spec=spec)
        return loss, {"ploss": m.pop("loss"), **m}   # the per-step losses

    params, opt_state, m = optimizer_step(objective, params, opt_state, tstate, batch, lr, tgraph, opt_spec, aux_ids,
                                          spec.target_chunk)
    A = batch["ids"].shape[0]
    if A > 1:   # means over the micro-batches, not sums
        m = {k: v if k in ("loss", "count", "grad_norm") else v / A for k, v in m.items()}
    return params, opt_state, m


def optimizer_step(objective, params, opt_state, tstate, batch, lr, tgraph, opt_spec: OptimizerSpec, aux_ids,
                   target_chunk):
    """One optimizer step at learning rate ``lr`` over batch arrays shaped [grad_accum, rows, ...]:
    ``objective(params, micro-batch, aux states, last hidden states) -> (loss, metrics)`` differentiated
    on each micro-batch. Returns (params, opt_state, {"loss", the summed metrics, "grad_norm"})."""

    def micro(mb):
        features = micro_features(mb, tgraph, tstate, aux_ids, target_chunk)
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, mb, *features)
        return loss, metrics, grads

    loss, metrics, grads = accumulate(micro, batch)
    updates, opt_state = opt_spec.build(lr).update(grads, opt_state, params)   # clipped AdamW
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics,
                                                             "grad_norm": optax.global_norm(grads)}


def batch_loss(params, rest, embed_VD, lm_head_DV, aux_BTX, hidden_BTD, mb, *, graphdef, spec: LossSpec):
    """(TTT loss, metrics) of one micro-batch (ids, loss mask and row lengths in ``mb``) from the
    target's aux and final hidden states: what the step differentiates."""
    signal = target_signal_from_hidden(hidden_BTD, lm_head_DV, mb["loss_mask"], rest["d2t"], rest["t2d"],
                                       spec.convention, spec.loss_chunk, length_B=mb["length"])
    return ttt_loss(nnx.merge(graphdef, params, rest), aux_BTX, mb["ids"], signal, embed_VD, spec)


def micro_features(mb, tgraph, tstate, aux_ids, target_chunk):
    """(aux states, last hidden states) of a micro-batch: online, the frozen target runs here and
    nothing of it is differentiated; offline, they come with the batch."""
    if tgraph is None:
        return mb["aux"], mb["hidden"]
    return jax.lax.stop_gradient(offline_lib.target_features(tgraph, tstate, mb["ids"], aux_ids, target_chunk))


def accumulate(micro, batch):
    """``micro(one micro-batch) -> (loss, metrics, grads)`` over batch arrays shaped [grad_accum, rows,
    ...]: loss and grads averaged over the micro-batches, metrics summed (a ``lax.scan``)."""
    A = batch["ids"].shape[0]
    if A == 1:
        return micro(jax.tree.map(lambda x: x[0], batch))

    def body(carry, mb):
        return jax.tree.map(jnp.add, carry, micro(mb)), None

    first = jax.tree.map(lambda x: x[0], batch)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro, first))
    (loss, metrics, grads), _ = jax.lax.scan(body, zeros, batch)
    return loss / A, metrics, jax.tree.map(lambda g: g / A, grads)


@functools.lru_cache(maxsize=8)
def compiled_step(train_step, graphdef, tgraph, opt_spec: OptimizerSpec, aux_ids: tuple, spec,
                  sharding_leaves: tuple, sharding_tree):
    """A draft kind's jitted ``train_step`` for these static settings (``spec``: its loss's), its new
    params and optimizer state pinned to the shardings they came in with (else XLA may pick others,
    and the next call would recompile). Cached, so runs with identical settings in one process (a
    resume, the tests) share it."""
    params_sh, opt_sh = jax.tree.unflatten(sharding_tree, sharding_leaves)
    step = functools.partial(train_step, graphdef=graphdef, tgraph=tgraph, opt_spec=opt_spec, aux_ids=aux_ids,
                             spec=spec)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(params_sh, opt_sh, None))


def host_draws(draw_row, spec, loss_mask_ABT, seed: int, step: int, first_row: int) -> dict:
    """``draw_row(loss mask [T], spec, rng)`` of one optimizer step's rows, stacked to [A, B, ...]: one
    generator per (seed, step, micro-batch, global row; ``first_row``: this process's first), so a
    resumed run draws what the uninterrupted one drew, whichever process reads the row."""
    A, B, _ = loss_mask_ABT.shape
    rows = [[draw_row(np.asarray(loss_mask_ABT[a, b]), spec, np.random.default_rng([seed, step, a, first_row + b]))
             for b in range(B)] for a in range(A)]
    return {k: np.stack([np.stack([r[k] for r in row]) for row in rows]) for k in rows[0][0]}
