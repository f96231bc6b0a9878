"""EAGLE-3 training-time test: the draft unrolled on its own outputs, as it runs when serving.

Indexing. The target read tokens x_0..x_{T-1}; ``aux[t]`` is its state at position t and
``logits[p]`` its prediction of x_{p+1}. Simulated step i at index t:

  inputs   hidden: fc(aux[t]) for i = 0, else step i-1's output at t;  token x_{t+1+i}
  position t + i (what the serving loop uses for the i-th draft token after position t)
  predicts x_{t+2+i}; label = softmax of logits[t+1+i] restricted to the draft vocab

Attention at step i, query t, sees step 0's keys at 0..t (computed from the target's states)
plus, for every simulated step j = 1..i, only its key at index t (the paper's diagonal mask):
each earlier guess on the path to t, never another position's guesses.

Loss: step i's cross-entropy against the soft label, averaged where the label is usable (the
predicted token is in the loss mask and the target's top token has a draft id); total
sum_i decay^i loss_i. Two attention implementations: ``efficient`` scores the causal block and
the diagonals separately (O(T^2 + iT) per step), ``naive`` concatenates every step's keys and
applies the explicit block mask (O(iT^2)); they agree, and the tests hold them to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models.attention import masked_softmax
from eagle3_jax.models.draft import Draft


@jax.tree_util.register_dataclass
@dataclass
class TargetSignal:
    """What the loss needs from the target, per logits position p (the target's guess at x_{p+1})."""

    probs_BTW: jax.Array   # float32 softmax over the draft vocab of the target's logits at p
    usable_BT: jax.Array   # bool: x_{p+1} is a loss token and the target's argmax has a draft id


def target_signal(logits_BTV: jax.Array, loss_mask_BT: jax.Array, d2t_W: jax.Array, t2d_V: jax.Array) -> TargetSignal:
    W = d2t_W.shape[0]
    logits_BTV = logits_BTV.astype(jnp.float32)
    draft_to_target_W = jnp.arange(W, dtype=jnp.int32) + d2t_W
    probs_BTW = jax.nn.softmax(jnp.take(logits_BTV, draft_to_target_W, axis=-1), axis=-1)
    top_BT = jnp.argmax(logits_BTV, axis=-1)
    B = loss_mask_BT.shape[0]
    next_is_loss_BT = jnp.concatenate([loss_mask_BT[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
    return TargetSignal(probs_BTW=probs_BTW, usable_BT=t2d_V[top_BT] & next_is_loss_BT)


def target_logits(hidden_BTD: jax.Array, lm_head_DV: jax.Array) -> jax.Array:
    """The target's head on its final (normed) hidden states; the same op online and offline."""
    return jnp.einsum("btd,dv->btv", hidden_BTD, lm_head_DV).astype(jnp.float32)


def _shift(x_BT_, k: int, fill) -> jax.Array:
    """x[:, t] <- x[:, t + k], ``fill`` past the end."""
    if k == 0:
        return x_BT_
    B, T = x_BT_.shape[:2]
    k = min(k, T)
    pad = jnp.full((B, k) + x_BT_.shape[2:], fill, x_BT_.dtype)
    return jnp.concatenate([x_BT_[:, k:], pad], axis=1)


# ---------------------------------------------------------------------- attention over simulated steps
def _grouped(q_BTNH, G):
    B, T, N, H = q_BTNH.shape
    return q_BTNH.reshape(B, T, G, N // G, H)


def efficient_attend(prev, q_BTNH, k_BTGH, v_BTGH):
    """Causal scores against step 0's keys, plus one diagonal score per simulated step.

    ``prev``: None at step 0, else (k0, v0, diagonal keys, diagonal values) of earlier steps.
    """
    B, T, N, H = q_BTNH.shape
    G = k_BTGH.shape[2]
    q_BTGRH = _grouped(q_BTNH, G)
    scale = H ** -0.5
    if prev is None:
        k0_BSGH, v0_BSGH, diag_k, diag_v = k_BTGH, v_BTGH, (), ()
    else:
        k0_BSGH, v0_BSGH, diag_k, diag_v = prev
        diag_k, diag_v = diag_k + (k_BTGH,), diag_v + (v_BTGH,)
    scores_BTGRS = jnp.einsum("btgrh,bsgh->btgrs", q_BTGRH, k0_BSGH) * scale
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    scores_BTGRS = jnp.where(causal_TS[None, :, None, None, :], scores_BTGRS.astype(jnp.float32), -jnp.inf)
    if diag_k:
        dk_JBTGH = jnp.stack(diag_k)
        dv_JBTGH = jnp.stack(diag_v)
        diag_BTGRJ = jnp.einsum("btgrh,jbtgh->btgrj", q_BTGRH, dk_JBTGH).astype(jnp.float32) * scale
        scores_BTGRS = jnp.concatenate([scores_BTGRS, diag_BTGRJ], axis=-1)
    probs = jax.nn.softmax(scores_BTGRS, axis=-1)
    out_BTGRH = jnp.einsum("btgrs,bsgh->btgrh", probs[..., :T].astype(v0_BSGH.dtype), v0_BSGH)
    if diag_k:
        out_BTGRH = out_BTGRH + jnp.einsum("btgrj,jbtgh->btgrh", probs[..., T:].astype(v0_BSGH.dtype), dv_JBTGH)
    return out_BTGRH.reshape(B, T, N, H), (k0_BSGH, v0_BSGH, diag_k, diag_v)


def block_mask(T: int, n_steps: int) -> np.ndarray:
    """[T, n_steps * T] explicit mask for a query of the last step: block 0 causal, others diagonal."""
    mask = np.zeros((T, n_steps * T), bool)
    for t in range(T):
        for s in range(t + 1):
            mask[t, s] = True
        for j in range(1, n_steps):
            mask[t, j * T + t] = True
    return mask


def naive_attend(prev, q_BTNH, k_BTGH, v_BTGH):
    """Every step's keys concatenated along the key axis, with the explicit block mask."""
    B, T, N, H = q_BTNH.shape
    G = k_BTGH.shape[2]
    keys, values = (prev if prev is not None else ((), ()))
    keys, values = keys + (k_BTGH,), values + (v_BTGH,)
    k_BSGH = jnp.concatenate(keys, axis=1)
    v_BSGH = jnp.concatenate(values, axis=1)
    S = k_BSGH.shape[1]
    mask_BTS = jnp.broadcast_to(jnp.asarray(block_mask(T, len(keys))), (B, T, S))
    scores_BTGRS = jnp.einsum("btgrh,bsgh->btgrs", _grouped(q_BTNH, G), k_BSGH) * H ** -0.5
    probs = masked_softmax(scores_BTGRS.reshape(B, T, N, S), mask_BTS).reshape(B, T, G, N // G, S)
    out_BTGRH = jnp.einsum("btgrs,bsgh->btgrh", probs.astype(v_BSGH.dtype), v_BSGH)
    return out_BTGRH.reshape(B, T, N, H), (keys, values)


ATTENDS = {"efficient": efficient_attend, "naive": naive_attend}


# ---------------------------------------------------------------------- the unrolled loss
def ttt_unroll(draft: Draft, aux_BTX: jax.Array, ids_BT: jax.Array, embed_VD: jax.Array, steps: int,
               attention: str = "efficient") -> list[jax.Array]:
    """The draft's logits [B, T, W] at each simulated step (see the module docstring for indexing)."""
    attend_fn = ATTENDS[attention]
    B, T = ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden_BTD = draft.fuse(aux_BTX)
    state = None
    logits = []
    for i in range(steps):
        step = draft(_shift(ids_BT, i + 1, 0), hidden_BTD, positions_BT + i, embed_VD,
                     attend=functools.partial(attend_fn, state))
        state, hidden_BTD = step.cache, step.hidden_BTD
        logits.append(step.logits_BTW)
    return logits


def ttt_loss(draft: Draft, aux_BTX: jax.Array, ids_BT: jax.Array, signal: TargetSignal, embed_VD: jax.Array,
             steps: int, decay: float = 0.8, attention: str = "efficient"):
    """Returns (total loss, metrics) with per-step ``loss``, ``acc`` (top-1) and ``count`` [steps]."""
    total = jnp.zeros((), jnp.float32)
    losses, accs, counts = [], [], []
    for i, logits_BTW in enumerate(ttt_unroll(draft, aux_BTX, ids_BT, embed_VD, steps, attention)):
        probs_BTW = _shift(signal.probs_BTW, i + 1, 0.0)
        usable_BT = _shift(signal.usable_BT, i + 1, False)
        ce_BT = -jnp.sum(probs_BTW * jax.nn.log_softmax(logits_BTW, axis=-1), axis=-1)
        n = jnp.sum(usable_BT)
        denom = jnp.maximum(n, 1).astype(jnp.float32)
        loss_i = jnp.sum(jnp.where(usable_BT, ce_BT, 0.0)) / denom
        hit_BT = jnp.argmax(logits_BTW, axis=-1) == jnp.argmax(probs_BTW, axis=-1)
        total = total + (decay ** i) * loss_i
        losses.append(loss_i)
        accs.append(jnp.sum(hit_BT & usable_BT) / denom)
        counts.append(n)
    metrics = {"loss": jnp.stack(losses), "acc": jnp.stack(accs), "count": jnp.stack(counts)}
    return total, metrics
