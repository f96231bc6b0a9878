"""EAGLE-3 training-time test: the draft unrolled on its own outputs, as it runs when serving.

Indexing. The target read tokens x_0..x_{T-1}; ``aux[t]`` is its state at position t and
``logits[p]`` its prediction of x_{p+1}. Simulated step i at index t:

  inputs   hidden: fc(aux[t]) for i = 0, else step i-1's output at t;  token x_{t+1+i}
  position t + i (what the serving loop uses for the i-th draft token after position t)
  predicts x_{t+2+i}; label = softmax of logits[t+1+i] restricted to the draft vocab

Attention at step i, query t, sees step 0's keys at 0..t plus, for every simulated step j = 1..i,
only its key at index t (the paper's diagonal mask). The causal part (``efficient``: dense;
``blockwise``: key blocks, memory O(T)) and the diagonals are scored separately and merged into one
softmax through their log-sum-exps.

Loss: step i's cross-entropy against the soft label where the label is usable (a loss token whose
target top token has a draft id); total sum_i decay^i loss_i. ``LossSpec.convention``:
  ours       the prediction of x_{t+2+i} counts when loss_mask[t+i+2]; a step's loss is the mean
             over its usable positions.
  specforge  SpecForge's offline trainer (published drafts were trained with it): loss_mask[t+i]
             (its head shifts ids and logits, not the mask), each row's last token out of the mask;
             a step's summed cross-entropy over rows x the longest row of each group of
             ``specforge_batch`` rows (a device's padded batch), the groups averaged. docs/train.md.
``lk_loss_type``: SpecForge's acceptance-aware "LK" objective, with a = sum_w min(p_target(w),
q_draft(w)) the chance the draft's sample is accepted: ``alpha`` is -mean(log a), ``lambda``
w*KL + (1-w)*(1 - mean a) with w = kl_scale*exp(-kl_decay*mean a) (constant in the gradient).

``loss_chunk``: the draft head, softmaxes and sums run over row chunks, recomputed in the backward
pass, so no [B, T, draft vocab] array lives across steps; the target's signal is built likewise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.models import attention_core as core
from eagle3_jax.models import chunks
from eagle3_jax.sharding import constrain, constrain_leading, current_axis_size

CONVENTIONS = ("ours", "specforge")
LK_LOSS_TYPES = ("alpha", "lambda")


@dataclass(frozen=True)
class LossSpec:
    """What one TTT loss computes and how; hashable (the compiled step depends on it)."""

    steps: int = 7
    decay: float = 0.8
    convention: str = "ours"
    lk_loss_type: str | None = None
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    attention: str = "efficient"
    attention_block: int = 512      # keys a block with attention="blockwise"
    loss_chunk: int | None = None   # positions per chunk of the head and loss (None: the whole row)
    target_chunk: int | None = None  # online: positions per call of the frozen target (None: the whole row)
    remat: bool = False             # recompute each step's decoder layer in the backward pass
    specforge_batch: int | None = None  # specforge: rows SpecForge collates per device (None: the whole batch)


@jax.tree_util.register_dataclass
@dataclass
class TargetSignal:
    """What the loss needs from the target, per logits position p (its guess at x_{p+1})."""

    probs_BTW: jax.Array       # float32 softmax over the draft vocab of the target's logits at p
    on_draft_BTW: jax.Array    # float32 full-vocab softmax at the draft-vocab tokens (acceptance terms)
    usable_BT: jax.Array       # bool: counted in the loss (a loss token whose target top has a draft id)
    loss_BT: jax.Array         # bool: a loss token under the convention (accuracy counts over these)
    length_B: jax.Array        # int32: the row's real tokens (specforge divides by the longest)

    PER_POSITION = ("probs_BTW", "on_draft_BTW", "usable_BT", "loss_BT")


def _check_convention(convention: str):
    if convention not in CONVENTIONS:
        raise ValueError(f"loss convention {convention!r} is not one of {CONVENTIONS}")


def _signal_fields(logits_BTV, d2t_W, t2d_V):
    logits_BTV = jax.lax.stop_gradient(logits_BTV.astype(jnp.float32))
    W = d2t_W.shape[0]
    draft_BTW = jnp.take(logits_BTV, jnp.arange(W, dtype=jnp.int32) + d2t_W, axis=-1)
    on_draft_BTW = jnp.exp(draft_BTW - jax.nn.logsumexp(logits_BTV, axis=-1, keepdims=True))
    return jax.nn.softmax(draft_BTW, axis=-1), on_draft_BTW, t2d_V[jnp.argmax(logits_BTV, axis=-1)]


def target_signal_from_hidden(hidden_BTD: jax.Array, lm_head_DV: jax.Array, loss_mask_BT: jax.Array,
                              d2t_W: jax.Array, t2d_V: jax.Array, convention: str = "ours",
                              chunk: int | None = None, length_B: jax.Array | None = None) -> TargetSignal:
    """The signal of the target's head on its final hidden states, ``chunk`` positions at a time (the
    full-vocab logits [B, T, V] never exist at once); ``length_B``: each row's tokens before its right
    padding (None: every row fills T)."""
    B, T, D = hidden_BTD.shape
    S, n, C = _seq_chunks(T, chunk)
    # chunk c of every shard's positions at once: [n, B*S, C, D]
    h_NRCD = jnp.moveaxis(_seq_rows(hidden_BTD, S, n * C).reshape(B, S, n, C, D), 2, 0).reshape(n, B * S, C, D)
    fields = jax.lax.map(lambda h: _signal_fields(target_logits(h, lm_head_DV), d2t_W, t2d_V), h_NRCD)
    return _signal([_seq_join(jnp.moveaxis(x.reshape((n, B, S, C) + x.shape[3:]), 0, 2).reshape(
        (B, S, n * C) + x.shape[3:]), T) for x in fields], loss_mask_BT, convention, length_B)


def _signal(fields, loss_mask_BT, convention: str, length_B) -> TargetSignal:
    """The signal from ``_signal_fields``' (probs, on_draft, in_draft) and the loss mask."""
    _check_convention(convention)
    probs, on_draft, in_draft_BT = fields
    B, T = loss_mask_BT.shape
    length_B = jnp.full((B,), T, jnp.int32) if length_B is None else length_B
    loss_mask_BT, none = loss_mask_BT.astype(bool), jnp.zeros((B, 1), bool)
    if convention == "specforge":   # position p counts when loss_mask[p-1], a row's last token never
        last_BT = jnp.arange(T)[None, :] >= length_B[:, None] - 1
        loss_BT = jnp.concatenate([none, (loss_mask_BT & ~last_BT)[:, :-1]], axis=1)
    else:                           # ... when x_{p+1} is a loss token
        loss_BT = jnp.concatenate([loss_mask_BT[:, 1:], none], axis=1)
    return TargetSignal(probs, on_draft, in_draft_BT & loss_BT, loss_BT, length_B)


# ---------------------------------------------------------------------- sequence parallelism
# On a mesh whose ``draft_seq`` axis (sharding.py) has S > 1 devices, a row's positions are split
# into S contiguous shards, and every chunked computation over positions (the target's head, the
# draft's head and loss) runs chunk c of all shards at once, each device on its own positions:
# [B, T] is viewed as [B, S, L] with S on the mesh. S = 1 is the same computation unsplit.
def _seq_chunks(T: int, chunk: int | None) -> tuple[int, int, int]:
    """(S shards, n chunks per shard, C positions per chunk) covering T positions."""
    S = current_axis_size("draft_seq")
    L = -(-T // S)
    C = min(chunk or L, L)
    return S, -(-L // C), C


def _seq_rows(x_BT_, S: int, L: int):
    """[B, T, ...] zero-padded to S * L positions -> [B, S, L, ...], S on the ``draft_seq`` axis."""
    return constrain_leading(chunks.split(x_BT_, L, S), ("batch", "draft_seq"))


def _seq_join(x_BSL_, T: int):
    """``_seq_rows`` undone: [B, S, L, ...] -> [B, T, ...]."""
    return constrain_leading(chunks.join(x_BSL_, T), ("batch", "draft_seq"))


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
def unroll_attend(block: int | None, prev, q_BTNH, k_BTGH, v_BTGH):
    """Step 0's keys causally, in the core's dense form (``block`` None) or blockwise over ``block``
    keys a step, plus one diagonal key per simulated step, merged into the same softmax.
    ``prev``: None at step 0, else (k0, v0, diagonal keys, diagonal values) of earlier steps."""
    B, T, N, H = q_BTNH.shape
    if prev is None:
        k0_BSGH, v0_BSGH, diag_k, diag_v = k_BTGH, v_BTGH, (), ()
    else:
        k0_BSGH, v0_BSGH, diag_k, diag_v = prev
        diag_k, diag_v = diag_k + (k_BTGH,), diag_v + (v_BTGH,)
    if block is None:
        causal_BTS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        out_BTNH, lse_BTN = core.dense(*core.grouped(q_BTNH, k0_BSGH, v0_BSGH), causal_BTS)
    else:   # rows shorter than a block are one block (no padded keys to score)
        out_BTNH, lse_BTN = core.causal_gqa(q_BTNH, k0_BSGH, v0_BSGH, min(block, T))
    if diag_k:
        # each (row, index) has its own J keys: the dense form with (B, T) as batch and one query
        fns = core.grouped(q_BTNH[:, :, None], jnp.stack(diag_k, axis=2), jnp.stack(diag_v, axis=2))
        out_BT1NH, lse_BT1N = core.dense(*fns, None, keys=len(diag_k))
        out_BTNH = core.merge(out_BTNH, lse_BTN, out_BT1NH[:, :, 0], lse_BT1N[:, :, 0])
    return out_BTNH.astype(q_BTNH.dtype), (k0_BSGH, v0_BSGH, diag_k, diag_v)


def _attend_fn(spec: LossSpec):
    if spec.attention not in ("efficient", "blockwise"):
        raise ValueError(f"attention {spec.attention!r} is not one of efficient, blockwise")
    return functools.partial(unroll_attend, spec.attention_block if spec.attention == "blockwise" else None)


# ---------------------------------------------------------------------- the unrolled loss
def ttt_outputs(draft: Draft, aux_BTX: jax.Array, ids_BT: jax.Array, embed_VD: jax.Array, spec: LossSpec):
    """The draft's decoder output [B, T, D] at each simulated step (logits: ``draft.head`` of it)."""
    attend_fn = _attend_fn(spec)
    B, T = ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seq = ("batch", "draft_seq", "embed")   # positions split over the mesh (sequence parallelism)
    hidden_BTD = constrain(draft.fuse(constrain(aux_BTX, ("batch", "draft_seq", "aux"))), seq)
    state = None

    def layer(i, hidden_BTD, state):
        step = draft(_shift(ids_BT, i + 1, 0), hidden_BTD, positions_BT + i, embed_VD,
                     attend=functools.partial(attend_fn, state), with_logits=False)
        return constrain(step.hidden_BTD, seq), step.cache

    if spec.remat:   # keep only each step's input for the backward pass, not its activations
        layer = jax.checkpoint(layer, static_argnums=(0,))
    for i in range(spec.steps):
        hidden_BTD, state = layer(i, hidden_BTD, state)
        yield hidden_BTD


SUMS = ("ce", "hits", "count", "loss_count", "accept", "log_accept")


def _chunk_sums(draft: Draft, out_BCD, probs_BCW, on_draft_BCW, usable_BC, loss_BC, ce_weight_BC) -> dict:
    """Per-step sums over one chunk of positions (reduced by ``_step_loss``; ``ce`` weighted)."""
    logits_BCW = draft.head(out_BCD)
    logp_BCW = jax.nn.log_softmax(logits_BCW, axis=-1)
    ce_BC = -jnp.sum(probs_BCW * logp_BCW, axis=-1)
    hit_BC = (jnp.argmax(logits_BCW, axis=-1) == jnp.argmax(probs_BCW, axis=-1)) & usable_BC
    # the chance the draft's sample is accepted: sum_w min(p, q) (rejection sampling)
    a_BC = jnp.sum(jnp.minimum(on_draft_BCW, jnp.exp(logp_BCW)), axis=-1)
    log_a_BC = jnp.where(a_BC > 0, jnp.log(jnp.where(a_BC > 0, a_BC, 1.0)), 0.0)
    zero = jnp.zeros((), jnp.float32)
    return {"ce": jnp.sum(jnp.where(usable_BC, ce_BC * ce_weight_BC, zero)),
            "hits": jnp.sum(hit_BC).astype(jnp.float32), "count": jnp.sum(usable_BC).astype(jnp.float32), "loss_count": jnp.sum(loss_BC).astype(jnp.float32),
            "accept": jnp.sum(jnp.where(usable_BC, a_BC, zero)),
            "log_accept": jnp.sum(jnp.where(usable_BC, log_a_BC, zero))}


def _step_sums(draft: Draft, out_BTD, per_position: list, k: int, chunk: int | None) -> dict:
    """Sums of step i (signal offset k = i + 1) over T positions, ``chunk`` at a time on each
    sequence shard. ``per_position``: the signal's fields and the cross-entropy weights, padded so
    the window [k, k + T) lies inside them."""
    B, T, _ = out_BTD.shape
    fields = [jax.lax.slice_in_dim(x, k, k + T, axis=1) for x in per_position]
    S, n, C = _seq_chunks(T, chunk)
    if S == 1 and n == 1:
        return _chunk_sums(draft, out_BTD, *fields)
    # padded positions are neither usable nor loss tokens: they add nothing
    out_BSLD, *fields = (_seq_rows(x, S, n * C) for x in [out_BTD] + fields)

    @jax.checkpoint   # the backward pass recomputes a chunk's logits instead of keeping them
    def body(carry, c):
        rows = [jax.lax.dynamic_slice_in_dim(x, c * C, C, axis=2) for x in [out_BSLD] + fields]
        sums = _chunk_sums(draft, *(x.reshape((B * S, C) + x.shape[3:]) for x in rows))
        return jax.tree.map(jnp.add, carry, sums), None

    sums, _ = jax.lax.scan(body, {name: jnp.zeros((), jnp.float32) for name in SUMS}, jnp.arange(n))
    return sums


def _ce_weight_B(length_B: jax.Array, spec: LossSpec) -> jax.Array:
    """Each row's cross-entropy weight in a step's sum. ours: 1 (then / usable positions); specforge:
    1 / (B x the longest row of its group): G rows x L positions a device, B / G devices averaged."""
    B = length_B.shape[0]
    G = spec.specforge_batch or B
    if B % G:
        raise ValueError(f"specforge_batch={G} must divide the {B} rows of a micro-batch")
    if spec.convention != "specforge":
        return jnp.ones((B,), jnp.float32)
    return 1.0 / (B * jnp.repeat(jnp.max(length_B.reshape(B // G, G), axis=1), G).astype(jnp.float32))


def _step_loss(sums: dict, spec: LossSpec):
    n = jnp.maximum(sums["count"], 1.0)
    kl = sums["ce"] if spec.convention == "specforge" else sums["ce"] / n
    accept, log_accept = sums["accept"] / n, sums["log_accept"] / n
    if spec.lk_loss_type is None:
        return kl, accept
    if spec.lk_loss_type == "alpha":
        return -log_accept, accept
    if spec.lk_loss_type == "lambda":
        w = spec.kl_scale * jnp.exp(-spec.kl_decay * jax.lax.stop_gradient(accept))
        return w * kl + (1 - w) * (1 - accept), accept
    raise ValueError(f"lk_loss_type {spec.lk_loss_type!r} is not one of {LK_LOSS_TYPES} (or None)")


def ttt_loss(draft: Draft, aux_BTX: jax.Array, ids_BT: jax.Array, signal: TargetSignal, embed_VD: jax.Array,
             spec: LossSpec):
    """Returns (total loss, metrics) with per-step ``loss``, ``acc`` (top-1 over usable positions),
    ``acc_all`` (top-1 over every loss token: SpecForge's per-position accuracy), ``accept``
    (expected acceptance sum min(p, q) over usable positions) and ``count`` [steps]."""
    _check_convention(spec.convention)
    B, T = ids_BT.shape
    weight_BT = jnp.broadcast_to(_ce_weight_B(signal.length_B, spec)[:, None], (B, T))
    # room for every step's window [i + 1, i + 1 + T); the padding is neither usable nor a loss token
    per_position = [jnp.pad(x, ((0, 0), (0, spec.steps + 1)) + ((0, 0),) * (x.ndim - 2))
                    for x in [getattr(signal, f) for f in TargetSignal.PER_POSITION] + [weight_BT]]
    total = jnp.zeros((), jnp.float32)
    rows = {name: [] for name in ("loss", "acc", "acc_all", "accept", "count")}
    for i, out_BTD in enumerate(ttt_outputs(draft, aux_BTX, ids_BT, embed_VD, spec)):
        sums = _step_sums(draft, out_BTD, per_position, i + 1, spec.loss_chunk)
        loss_i, accept_i = _step_loss(sums, spec)
        total = total + (spec.decay ** i) * loss_i
        rows["loss"].append(loss_i)
        rows["acc"].append(sums["hits"] / jnp.maximum(sums["count"], 1.0))
        rows["acc_all"].append(sums["hits"] / jnp.maximum(sums["loss_count"], 1.0))
        rows["accept"].append(accept_i)
        rows["count"].append(sums["count"].astype(jnp.int32))
    return total, {k: jnp.stack(v) for k, v in rows.items()}


def simulated_acc_len(per_step_acc) -> float:
    """SpecForge's offline acceptance estimate: a0 + a0*a1 + ... (tokens accepted per round from
    per-step top-1 accuracies, without the target's bonus token: tau is about 1 + this)."""
    return float(np.sum(np.cumprod(np.asarray(per_step_acc, np.float64))))
