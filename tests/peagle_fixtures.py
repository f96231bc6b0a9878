"""A P-EAGLE draft that really accepts: trained briefly with SpecForge's objective (COD-sampled
rollouts, soft labels) on the tiny target's own greedy outputs. Enough to make multi-token
acceptance happen, which the lossless tests need; not a recipe."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.hf_loader import load_state
from eagle3_jax.drafts.peagle import checkpoint
from eagle3_jax.drafts.peagle.config import PEagleConfig
from eagle3_jax.drafts.peagle.objective import CODSettings, cod_budget, cod_sample, pad_rollouts, peagle_loss


def read_peagle_config(path, mask_token_id: int | None = None) -> PEagleConfig:
    """The P-EAGLE config at ``path`` (a directory or its config.json), with the MASK token
    ``mask_token_id`` when its config.json names none."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    with open(p) as f:
        return PEagleConfig.from_hf_dict(json.load(f), where=p, mask_token_id=mask_token_id)


def read_peagle_state(path, cfg: PEagleConfig, abstract_state: nnx.State, n_aux: int) -> nnx.State:
    """``abstract_state`` filled from SpecForge-layout safetensors."""
    return load_state(CheckpointReader(path), checkpoint.peagle_rules(cfg, n_aux), abstract_state, where=os.fspath(path))


def load_peagle_draft(path, target, dtype=None, mask_token_id: int | None = None) -> e3.LoadedDraft:
    """The P-EAGLE draft at ``path`` with the MASK token ``mask_token_id`` when its config.json names none."""
    return checkpoint.load(path, read_peagle_config(path, mask_token_id), target, dtype)


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
