"""Verify/accept step of chain speculative decoding, as pure jittable JAX functions.

The draft proposes K tokens d_0..d_{K-1}; the target scores the prefix plus all K drafts in one
pass, giving K+1 next-token distributions (position i predicts the token after d_{i-1}; position K
is the "bonus" position). This module decides how many drafts to keep and which token (correction
or bonus) follows them: ``greedy_accept`` at temperature 0 (bitwise deterministic, no random
numbers; T = 0 must never reach ``filter_logits``), ``rejection_accept`` above it (speculative
sampling, Leviathan et al. 2023, Chen et al. 2023: lossless whatever the draft distribution).

Shape suffixes: B batch, K draft length (static), V vocabulary; ``..`` any leading dims. Sampling
parameters are ordinary array arguments, so they may be traced and one program serves every value:
that is why top-k is a sort plus a threshold compare rather than ``lax.top_k`` (static k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "first_argmax",
    "filter_logits",
    "target_probs",
    "sample_from_probs",
    "greedy_accept",
    "rejection_accept",
]

# A guard, not a feature (T = 0 belongs to greedy_accept): a stray T = 0 under jit gives a
# near-one-hot distribution instead of NaNs.
_MIN_TEMPERATURE = 1e-6


def _per_row(x, dtype, batch_shape):
    """``x`` broadcast to ``batch_shape`` with a trailing axis, to line up with ``..V``."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), batch_shape)[..., None]


def filter_logits(logits_V, temperature, top_k, top_p):
    """Temperature-scale, then top-k filter, then top-p filter; removed entries are -inf.

    Args:
      logits_V: float array ``[.., V]``; computed in float32.
      temperature: > 0. Scalar or array broadcastable to ``logits_V.shape[:-1]``
        (numpy rules, trailing-aligned: per-request values for ``[B, K+1, V]`` logits
        have shape ``[B, 1]``); may be traced.
      top_k: int, same shapes as temperature; 0 (or negative) means off; values >= V
        keep everything.
      top_p: float in (0, 1], same shapes as temperature; 1.0 (or more) means off.

    Exact definitions (both are order independent, so ties never depend on how the
    sort happened to order equal values):

    * top-k keeps every token whose logit is >= the k-th largest logit. Tokens tied
      with the k-th largest are all kept, so more than k may survive.
    * top-p works on the probabilities renormalised after top-k. Sort them in
      descending order; keep the smallest prefix whose cumulative probability reaches
      top_p (the token whose probability makes the sum cross top_p is kept, i.e. token
      i of the sorted order is kept iff the sum of the probabilities before it is
      < top_p). Tokens tied with the last kept one are kept too.
    * The most likely token always survives, even for top_p -> 0.

    Returns float32 logits ``[.., V]`` (scaled by 1/temperature, removed = -inf).
    """
    x_V = jnp.asarray(logits_V, jnp.float32)
    batch_shape = x_V.shape[:-1]
    vocab = x_V.shape[-1]
    t_1 = _per_row(temperature, jnp.float32, batch_shape)
    k_1 = _per_row(top_k, jnp.int32, batch_shape)
    p_1 = _per_row(top_p, jnp.float32, batch_shape)

    x_V = x_V / jnp.maximum(t_1, _MIN_TEMPERATURE)

    def _filter(x_V):
        # One descending sort serves both filters: scaling by 1/T > 0 preserves order.
        sorted_V = jnp.flip(jnp.sort(x_V, axis=-1), axis=-1)

        # top-k: threshold = k-th largest logit; k <= 0 (off) or k >= V keeps all.
        k_eff_1 = jnp.where(k_1 <= 0, vocab, jnp.minimum(k_1, vocab))
        thr_k_1 = jnp.take_along_axis(sorted_V, k_eff_1 - 1, axis=-1)

        # top-p on the top-k-renormalised distribution. The tokens surviving top-k are
        # a prefix of the sorted order (threshold compare), so mask the sorted row
        # directly; softmax commutes with the permutation, so no second sort needed.
        sorted_masked_V = jnp.where(sorted_V >= thr_k_1, sorted_V, -jnp.inf)
        sorted_probs_V = jax.nn.softmax(sorted_masked_V, axis=-1)
        cum_V = jnp.cumsum(sorted_probs_V, axis=-1)
        # Exclusive cumsum by shifting (not cum - p) so position 0 is exactly 0 and
        # the top token is always kept for any top_p > 0.
        before_V = jnp.concatenate([jnp.zeros_like(cum_V[..., :1]), cum_V[..., :-1]], axis=-1)
        # top_p >= 1 is "off" explicitly: rounding can push the cumulative sum to
        # exactly 1.0 before the tail, which would otherwise drop tiny-prob tokens.
        keep_sorted_V = (before_V < p_1) | (p_1 >= 1.0)
        n_keep_1 = jnp.maximum(jnp.sum(keep_sorted_V, axis=-1, keepdims=True), 1)
        thr_p_1 = jnp.take_along_axis(sorted_masked_V, n_keep_1 - 1, axis=-1)

        # Compare against values (not scatter by sort indices): ties at either cutoff
        # are kept, and a compare is cheaper than a scatter on TPU.
        thr_1 = jnp.maximum(thr_k_1, thr_p_1)
        return jnp.where(x_V >= thr_1, x_V, -jnp.inf)

    # Skip the full-vocab sort when both filters are off (the common "temperature only" setting).
    filtering = jnp.any(k_1 > 0) | jnp.any(p_1 < 1.0)
    return jax.lax.cond(filtering, _filter, lambda x: x, x_V)


def target_probs(logits_V, temperature, top_k, top_p):
    """float32 probabilities ``[.., V]`` of ``filter_logits(...)`` (zeros where removed)."""
    return jax.nn.softmax(filter_logits(logits_V, temperature, top_k, top_p), axis=-1)


def sample_from_probs(key, probs_V):
    """Draw one id per row from ``probs_V [.., V]``; returns int32 ``[..]``.

    Gumbel-max on log(probs): zero entries become -inf and can never be drawn, and
    the input need not be normalised (log of a scale is a shift), so callers can pass
    an unnormalised residual directly. An all-zero row returns id 0.
    """
    probs_V = jnp.asarray(probs_V, jnp.float32)
    logp_V = jnp.where(probs_V > 0, jnp.log(jnp.where(probs_V > 0, probs_V, 1.0)), -jnp.inf)
    return jax.random.categorical(key, logp_V, axis=-1).astype(jnp.int32)


def first_argmax(x_V):
    """``jnp.argmax(x_V, axis=-1)`` as int32 for NaN-free input: the first index of the maximum.

    Written as a max followed by the smallest index where the max occurs: two plain reductions,
    where argmax lowers to one variadic (value, index) reduce that XLA:CPU runs markedly slower
    over a full vocabulary. Ties resolve to the lowest id, exactly as jnp.argmax does."""
    max_1 = jnp.max(x_V, axis=-1, keepdims=True)
    idx_V = jax.lax.broadcasted_iota(jnp.int32, x_V.shape, x_V.ndim - 1)
    return jnp.min(jnp.where(x_V == max_1, idx_V, x_V.shape[-1]), axis=-1)


def greedy_accept(draft_tokens_BK, target_logits_BK1V):
    """Temperature-0 verification.

    Args:
      draft_tokens_BK: int ``[B, K]`` drafted ids.
      target_logits_BK1V: ``[B, K+1, V]`` target logits; position i is the target's
        prediction for the token at draft position i (position K: the bonus token).

    Returns:
      n_accepted_B: int32 ``[B]`` in [0, K], the length of the longest prefix with
        draft_tokens[:, i] == argmax(target_logits[:, i]).
      out_tokens_BK1: int32 ``[B, K+1]``. ``out_tokens[b, :n+1]`` are the emitted
        tokens: the n accepted drafts then the target argmax at position n (the
        correction, or the bonus if n == K). Entries after n are unspecified.
    """
    argmax_BK1 = first_argmax(target_logits_BK1V)
    k = draft_tokens_BK.shape[1]
    match_BK = draft_tokens_BK.astype(jnp.int32) == argmax_BK1[:, :k]
    # cumprod zeroes everything from the first mismatch on; its sum is the prefix length.
    n_accepted_B = jnp.sum(jnp.cumprod(match_BK.astype(jnp.int32), axis=1), axis=1)
    # Accepted drafts equal the argmax by definition, and position n is the argmax,
    # so the argmax row *is* the emitted sequence (entries after n: later argmaxes).
    return n_accepted_B.astype(jnp.int32), argmax_BK1


def rejection_accept(key, draft_tokens_BK, draft_probs_BKV, target_probs_BK1V):
    """Lossless speculative sampling for one chain of K drafts (temperature > 0).

    Args:
      key: PRNG key.
      draft_tokens_BK: int ``[B, K]``; d_i was sampled from draft_probs[:, i].
      draft_probs_BKV: ``[B, K, V]`` q_i, the distribution each draft was *actually*
        sampled from (after the draft's own temperature/filtering; one-hot for a greedy
        drafter). Must be over the same V as the target: a draft with a smaller
        vocabulary must scatter its probabilities into target-vocab ids first
        (zeros elsewhere).
      target_probs_BK1V: ``[B, K+1, V]`` p_i, the filtered target distributions
        (see ``target_probs``); position K is the bonus distribution.

    Rule: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)). At the first
    rejection n, emit a sample from normalize(max(0, p_n - q_n)) (or from p_n when that
    residual has no mass, i.e. p_n == q_n); if all K are accepted, emit a bonus sample
    from p_K. The emitted tokens are then distributed exactly as sampling from p.

    Returns ``(n_accepted_B, out_tokens_BK1)`` as ``greedy_accept`` does.
    """
    b, k = draft_tokens_BK.shape
    draft_tokens_BK = draft_tokens_BK.astype(jnp.int32)
    q_BKV = jnp.asarray(draft_probs_BKV, jnp.float32)
    p_BK1V = jnp.asarray(target_probs_BK1V, jnp.float32)
    key_accept, key_sample = jax.random.split(key)

    idx_BK1 = draft_tokens_BK[..., None]
    p_draft_BK = jnp.take_along_axis(p_BK1V[:, :k], idx_BK1, axis=-1)[..., 0]
    q_draft_BK = jnp.take_along_axis(q_BKV, idx_BK1, axis=-1)[..., 0]

    # Draw all K uniforms at once. u in [0, 1), so "u * q < p" is "u < p/q" without a
    # division: probability min(1, p/q); q == 0 accepts iff p > 0, and p == 0 always
    # rejects (q may put mass where the filtered target has none).
    u_BK = jax.random.uniform(key_accept, (b, k), jnp.float32)
    accept_BK = u_BK * q_draft_BK < p_draft_BK
    # Positions after the first rejection don't count: cumprod zeroes them out.
    n_accepted_B = jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=1), axis=1)

    # Pick the one distribution we need per row (position n) before sampling, so we
    # draw B tokens, not B*(K+1). Pad q with zeros at position K: the residual there
    # is then p_K itself, which is exactly the bonus distribution.
    q_BK1V = jnp.concatenate([q_BKV, jnp.zeros_like(p_BK1V[:, :1])], axis=1)
    pick_B11 = n_accepted_B[:, None, None]
    p_nV = jnp.take_along_axis(p_BK1V, pick_B11, axis=1)[:, 0]
    q_nV = jnp.take_along_axis(q_BK1V, pick_B11, axis=1)[:, 0]
    residual_nV = jnp.maximum(p_nV - q_nV, 0.0)
    # Zero residual mass means p_n == q_n, where a rejection is impossible for a
    # draft really sampled from q; fall back to p_n rather than sample from nothing.
    has_mass_B1 = jnp.sum(residual_nV, axis=-1, keepdims=True) > 0
    # sample_from_probs accepts unnormalised weights, so no division here.
    extra_B = sample_from_probs(key_sample, jnp.where(has_mass_B1, residual_nV, p_nV))

    pos_K1 = jnp.arange(k + 1, dtype=jnp.int32)
    drafts_BK1 = jnp.concatenate([draft_tokens_BK, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out_tokens_BK1 = jnp.where(pos_K1[None, :] < n_accepted_B[:, None], drafts_BK1, extra_B[:, None])
    return n_accepted_B.astype(jnp.int32), out_tokens_BK1
