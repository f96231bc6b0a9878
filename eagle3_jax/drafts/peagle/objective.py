"""SpecForge's P-EAGLE training objective: depth-sampled rollouts ("COD" sampling) and its loss.

Data convention (SpecForge's shifted capture, the pairing the draft is served with): position t
of a training row carries ``ids_T[t]`` = the token after position t, ``aux_TX[t]`` = the target's
aux states at t, and ``target_TV[t]`` = the target's logits for the token after ``ids_T[t]``.

Sampling. Depth 0 is every position. Depth d >= 1 extends at random
``int((valid - d) * max(r**d, r_min))`` of the depth-(d-1) rollouts whose position a + d is a loss
position of the same document (``valid`` = number of loss positions), so the sequence grows by
about 1 / (1 - r), not by the number of depths.

Loss. Soft-label cross-entropy of the draft's logits against the target's softmax over the draft
vocabulary, at each sampled token (non-loss positions and target argmaxes outside the draft vocab
weigh 0): the weighted mean over the batch's tokens, or (``row_means``, SpecForge's one row a
device) the mean of the rows' weighted means. Rows are padded to :func:`cod_budget` tokens for jit;
padding attends only to itself and weighs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.drafts.peagle.model import rollout_mask


@dataclass(frozen=True)
class CODSettings:
    """SpecForge's defaults: 8 depths, ratio 0.7 per depth, never below 0.2 of the loss positions."""

    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2

    def ratio(self, d: int) -> float:
        return max(self.down_sample_ratio ** d, self.down_sample_ratio_min)


def cod_budget(seq_len: int, s: CODSettings) -> int:
    """An upper bound on the sampled tokens of a row of ``seq_len`` positions (the padded length)."""
    return seq_len + sum(int(max(0, seq_len - d) * s.ratio(d)) for d in range(1, s.num_depths))


def cod_sample(loss_mask_T: np.ndarray, s: CODSettings, rng: np.random.Generator,
               doc_T: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(anchor, depth) of one row's sampled tokens, depth 0 first then by depth, each depth sorted
    by position. ``doc_T``: document id per position for packed rows (-1 = padding), else one."""
    T = len(loss_mask_T)
    doc_T = np.zeros(T, np.int64) if doc_T is None else np.asarray(doc_T)
    valid = np.flatnonzero(np.asarray(loss_mask_T) > 0)
    anchors, depths = [np.arange(T)], [np.zeros(T, np.int64)]
    reach = valid   # positions the previous depth's rollouts reached
    for d in range(1, s.num_depths):
        targets = reach[reach >= d]
        targets = targets[(doc_T[targets] >= 0) & (doc_T[targets] == doc_T[targets - d])]
        size = min(int(max(0, len(valid) - d) * s.ratio(d)), len(targets))
        if size <= 0:
            break
        if len(targets) > size:
            targets = np.sort(rng.choice(targets, size, replace=False))
        anchors.append(targets - d)
        depths.append(np.full(len(targets), d, np.int64))
        # the next depth extends these rollouts by one position, if that one is a loss position too
        nxt = targets + 1
        reach = nxt[np.isin(nxt, valid)]
    return np.concatenate(anchors), np.concatenate(depths)


def pad_rollouts(anchor: np.ndarray, depth: np.ndarray, budget: int):
    """(anchor, depth, valid) padded to ``budget`` tokens."""
    if len(anchor) > budget:
        raise ValueError(f"{len(anchor)} sampled tokens exceed the budget {budget}; size it with cod_budget")
    pad = budget - len(anchor)
    return (np.concatenate([anchor, np.zeros(pad, anchor.dtype)]), np.concatenate([depth, np.zeros(pad, depth.dtype)]),
            np.arange(budget) < len(anchor))


def peagle_loss(draft, ids_BT, aux_BTX, target_BTV, loss_mask_BT, anchor_BP, depth_BP, valid_BP, num_depths: int = 8,
                row_means: bool = False):
    """(loss, metrics) of SpecForge's objective on sampled rollouts (P: the padded sampled tokens).
    ``metrics``: ``acc_sum`` / ``acc_total`` [num_depths], top-1 agreement with the target per depth."""
    pos_BP = anchor_BP + depth_BP
    take = lambda x_BT_: jnp.take_along_axis(x_BT_, pos_BP.reshape(pos_BP.shape + (1,) * (x_BT_.ndim - 2)), axis=1)
    P = pos_BP.shape[1]
    seen_BPP = rollout_mask(anchor_BP, depth_BP) & valid_BP[:, None, :]
    # Padding queries attend to themselves only, so their (ignored) softmax has a key.
    seen_BPP = jnp.where(valid_BP[:, :, None], seen_BPP, jnp.eye(P, dtype=bool)[None])
    step = draft.forward_rollouts(take(ids_BT), take(aux_BTX), depth_BP, pos_BP, seen_BPP)
    logits_BPW = step.logits_BTW
    W = logits_BPW.shape[-1]
    target_BPV = take(target_BTV).astype(jnp.float32)
    # The draft vocab's target ids, ascending as SpecForge's boolean t2d selection orders them.
    target_BPW = jnp.take(target_BPV, jnp.arange(W) + draft.d2t[...], axis=-1)
    in_vocab_BP = draft.t2d[...][jnp.argmax(target_BPV, axis=-1)]
    weight_BP = take(loss_mask_BT).astype(jnp.float32) * in_vocab_BP * valid_BP
    p_BPW = jax.nn.softmax(target_BPW, axis=-1)
    ce_BP = -jnp.sum(p_BPW * jax.nn.log_softmax(logits_BPW, axis=-1), axis=-1)
    if row_means:
        loss = jnp.mean(jnp.sum(weight_BP * ce_BP, axis=1) / jnp.maximum(jnp.sum(weight_BP, axis=1), 1e-6))
    else:
        loss = jnp.sum(weight_BP * ce_BP) / jnp.maximum(jnp.sum(weight_BP), 1e-6)
    hit_BP = (jnp.argmax(logits_BPW, -1) == jnp.argmax(p_BPW, -1)) & (weight_BP > 0)
    depths_D = jnp.arange(num_depths)
    at_BPD = (depth_BP[..., None] == depths_D) & (weight_BP[..., None] > 0)
    metrics = {"acc_sum": jnp.sum(at_BPD & hit_BP[..., None], axis=(0, 1)), "acc_total": jnp.sum(at_BPD, axis=(0, 1))}
    return loss, metrics

