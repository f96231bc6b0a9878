"""SpecForge's DFlash training objective (``OnlineDFlashModel``, loss type ``dflash``), in JAX.

A batch row is a sequence of S tokens with its loss mask and the target's states at the draft's
layers. Blocks are anchored at positions a where the token at a and the one after it are both
supervised (:func:`sample_anchors_host`, up to ``num_anchors`` a row, in position order). Block
offset j >= 1 is scored against the sequence's own token at a + j, a hard label, where that position
exists and is supervised; offset 0 (the known token) never is. The loss is the weighted mean of the
cross-entropy of the target head's logits, weights ``exp(-(j - 1) / gamma)`` with a decay ``gamma``
(else 1); accuracy is top-1 agreement over the same positions, unweighted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample_anchors_host(loss_mask_S: np.ndarray, num_anchors: int, rng: np.random.Generator
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(anchors [N], kept [N]) of one row: up to ``num_anchors`` valid anchors, uniformly chosen and
    sorted, the rest dropped blocks at 0. Drawn on the host with the row's own generator, so a
    resumed run draws what the uninterrupted one drew."""
    valid_C = (loss_mask_S[:-1] > 0.5) & (loss_mask_S[1:] > 0.5)
    picked = np.sort(rng.permutation(np.flatnonzero(valid_C))[:num_anchors])
    anchors_N = np.zeros(num_anchors, np.int32)
    anchors_N[:len(picked)] = picked
    kept_N = np.arange(num_anchors) < len(picked)
    return anchors_N, kept_N


def block_weights(ids_BS, loss_mask_BS, anchor_BN, keep_BN, block: int, decay_gamma: float | None = None):
    """(labels [B, N, block], weights [B, N, block], scored [B, N, block]) of the blocks."""
    S = ids_BS.shape[1]
    off_K = jnp.arange(block)   # K: offsets within a block (the block's own draft tokens)
    label_BNK = anchor_BN[:, :, None] + off_K
    inside_BNK = label_BNK < S
    at_BNK = jnp.minimum(label_BNK, S - 1)
    labels_BNK = jnp.take_along_axis(ids_BS[:, None, :], at_BNK, axis=2)
    supervised_BNK = jnp.take_along_axis(loss_mask_BS[:, None, :], at_BNK, axis=2) > 0.5
    scored_BNK = keep_BN[:, :, None] & inside_BNK & (off_K > 0) & supervised_BNK
    weights_BNK = scored_BNK.astype(jnp.float32)
    if decay_gamma:
        weights_BNK *= jnp.exp(-jnp.maximum(off_K - 1, 0).astype(jnp.float32) / decay_gamma)
    return labels_BNK, weights_BNK, scored_BNK


def dflash_terms(logits_BTV, ids_BS, loss_mask_BS, anchor_BN, keep_BN, block: int,
                 decay_gamma: float | None = None) -> dict:
    """The loss's sums over the blocks' logits [B, N * block, V]: ``num`` (weighted cross-entropy)
    and ``den`` (weights), and per block offset ``hits_K`` (top-1 agreements) and ``scored_K``."""
    B, N = anchor_BN.shape
    labels_BNK, weights_BNK, scored_BNK = block_weights(ids_BS, loss_mask_BS, anchor_BN, keep_BN, block, decay_gamma)
    logits_BNKV = logits_BTV.reshape(B, N, block, -1).astype(jnp.float32)
    logp_BNKV = jax.nn.log_softmax(logits_BNKV, axis=-1)
    ce_BNK = -jnp.take_along_axis(logp_BNKV, labels_BNK[..., None], axis=-1)[..., 0]
    hits_BNK = (jnp.argmax(logits_BNKV, axis=-1) == labels_BNK) & scored_BNK
    return {"num": jnp.sum(ce_BNK * weights_BNK), "den": jnp.sum(weights_BNK),
            "hits_K": jnp.sum(hits_BNK, axis=(0, 1)), "scored_K": jnp.sum(scored_BNK, axis=(0, 1))}


def chunked_terms(out_BTD, head_DV, ids_BS, loss_mask_BS, anchor_BN, keep_BN, block: int,
                  decay_gamma: float | None = None, chunk_blocks: int | None = None) -> dict:
    """:func:`dflash_terms` of the head's logits of the blocks' outputs [B, N * block, D], computed
    ``chunk_blocks`` blocks at a time and recomputed chunk by chunk in the backward pass, so only one
    chunk's logits [B, chunk * block, V] exist at once (SpecForge's ``objective_chunk_blocks``).
    None or 0: all blocks in one chunk."""
    B, N = anchor_BN.shape
    D = out_BTD.shape[-1]
    c = N if not chunk_blocks else min(chunk_blocks, N)
    n, pad = -(-N // c), -(-N // c) * c - N   # the last chunk is filled with dropped blocks
    out_BNKD = jnp.pad(out_BTD.reshape(B, N, block, D), ((0, 0), (0, pad), (0, 0), (0, 0)))
    anchor_BN, keep_BN = (jnp.pad(x, ((0, 0), (0, pad))) for x in (anchor_BN, keep_BN))

    @jax.checkpoint
    def one(out_BCKD, anchor_BC, keep_BC):
        logits_BTV = jnp.einsum("bckd,dv->bckv", out_BCKD, head_DV.astype(out_BCKD.dtype)).reshape(B, c * block, -1)
        return dflash_terms(logits_BTV, ids_BS, loss_mask_BS, anchor_BC, keep_BC, block, decay_gamma)

    if n == 1:
        return one(out_BNKD, anchor_BN, keep_BN)
    xs = (out_BNKD.reshape(B, n, c, block, D).swapaxes(0, 1), anchor_BN.reshape(B, n, c).swapaxes(0, 1),
          keep_BN.reshape(B, n, c).swapaxes(0, 1))
    first = jax.eval_shape(one, *(x[0] for x in xs))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    total, _ = jax.lax.scan(lambda acc, x: (jax.tree.map(jnp.add, acc, one(*x)), None), zeros, xs)
    return total


def terms_loss(t: dict) -> jax.Array:
    """The loss of :func:`dflash_terms`' sums; 0 where nothing is scored."""
    return jnp.where(t["den"] > 0, t["num"] / jnp.maximum(t["den"], 1e-30), 0.0)
