"""A P-EAGLE draft that really accepts: trained briefly with SpecForge's objective (COD-sampled
rollouts, soft labels) on the tiny target's own greedy outputs. Enough to make multi-token
acceptance happen, which the lossless tests need; not a recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.drafts.peagle.objective import CODSettings, cod_budget, cod_sample, pad_rollouts, peagle_loss


def shifted_rows(target, draft: e3.LoadedDraft, seqs: np.ndarray, batch: int = 16):
    """(ids, aux, target logits) in the shifted pairing (drafts/peagle/objective.py's module docstring)."""
    outs = [target.forward(seqs[i:i + batch], aux_layer_ids=draft.aux_layer_ids) for i in range(0, len(seqs), batch)]
    aux = np.concatenate([np.asarray(o.aux_hidden) for o in outs])
    logits = np.concatenate([np.asarray(o.logits) for o in outs])
    return seqs[:, 1:], aux[:, :-1], logits[:, 1:]


def train_peagle_on_target(target, draft: e3.LoadedDraft, seqs: np.ndarray, steps=300, lr=3e-3, batch=8,
                           settings: CODSettings = CODSettings(num_depths=6), seed=0, sharpen: float = 20.0):
    """``sharpen`` scales the teacher's logits: the tiny random target's distributions are nearly
    flat, so its soft labels teach the argmax (what greedy acceptance needs) only very slowly."""
    ids, aux, logits = shifted_rows(target, draft, seqs)
    logits = logits * sharpen
    T = ids.shape[1]
    mask = np.ones((len(seqs), T), np.float32)
    budget = cod_budget(T, settings)
    model = nnx.merge(draft.graphdef, draft.state)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    def loss_fn(params, *rows):
        loss, metrics = peagle_loss(nnx.merge(graphdef, params, rest), *rows, num_depths=settings.num_depths)
        return loss, metrics

    @jax.jit
    def step(params, opt_state, *rows):
        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, *rows)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, metrics

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(seqs), size=batch, replace=False)
        lay = [pad_rollouts(*cod_sample(mask[i], settings, rng), budget) for i in idx]
        anchor, depth, valid = (np.stack([x[j] for x in lay]) for j in range(3))
        params, opt_state, loss, metrics = step(params, opt_state, jnp.asarray(ids[idx]), jnp.asarray(aux[idx]),
                                                jnp.asarray(logits[idx]), jnp.asarray(mask[idx]), jnp.asarray(anchor),
                                                jnp.asarray(depth), jnp.asarray(valid))
        losses.append(float(loss))
    trained = nnx.merge(graphdef, params, rest)
    acc = np.asarray(metrics["acc_sum"]) / np.maximum(np.asarray(metrics["acc_total"]), 1)
    return e3.LoadedDraft(trained, target, draft.aux_layer_ids), losses, acc
