"""Tests for eagle3_jax.speculative.accept: greedy/rejection verification and logit filtering.

The statistical tests use fixed seeds and many vectorised draws, with a chi-square
p-value threshold of 1e-4, so they are deterministic and not flaky; each also asserts
that tokens with target probability 0 are never emitted (an exact check).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle3_jax.speculative.accept import (
    filter_logits,
    greedy_accept,
    rejection_accept,
    sample_from_probs,
    target_probs,
)

P_MIN = 1e-4  # chi-square p-value below which a distribution mismatch is declared
N_DRAWS = 200_000


# ----------------------------------------------------------------------------- helpers


def chisq_pvalue(samples, probs):
    """p-value of H0: ``samples`` (int ids) ~ Categorical(probs).

    Asserts exactly that no sample falls where probs == 0. Cells with expected count
    < 5 are pooled so the chi-square approximation holds.
    """
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    samples = np.asarray(samples).ravel()
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    assert counts.size == probs.size, "sample id out of range"
    zero = probs == 0
    assert counts[zero].sum() == 0, f"emitted ids with zero target prob: {np.flatnonzero(zero & (counts > 0))}"
    n = counts.sum()
    obs, exp = counts[~zero], probs[~zero] * n
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] < 5:  # pooled bin still too small: fold it into the biggest bin
            big = np.argmax(exp[:-1])
            obs[big] += obs[-1]
            exp[big] += exp[-1]
            obs, exp = obs[:-1], exp[:-1]
    assert exp.size >= 2
    return stats.chisquare(obs, exp).pvalue


def softmax_np(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def kept(logits):
    """Set of ids that survived filtering."""
    return set(np.flatnonzero(np.isfinite(np.asarray(logits))).tolist())


# Jitted once per shape: cheaper than eager op-by-op dispatch, and it is the way the
# functions are used. The crafted cases below pass Python numbers, which jit traces.
jfilter = jax.jit(filter_logits)
jprobs = jax.jit(target_probs)


def filter_ref(logits_V, temperature, top_k, top_p):
    """Straightforward NumPy reference of the documented filtering rule (one row)."""
    x = np.asarray(logits_V, np.float32) / np.float32(temperature)
    keep = np.ones(x.shape, bool)
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(top_k, x.size) - 1]
    if top_p < 1.0:
        probs = softmax_np(np.where(keep, x, -np.inf))
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        last = order[np.flatnonzero(before < top_p).max(initial=0)]
        keep &= x >= x[last]
    return np.where(keep, x, -np.inf)


@partial(jax.jit, static_argnames="n")
def _speculate(key, p_K1V, q_KV, n):
    """Draft n rows from q (shared across rows) and verify against p with rejection_accept."""
    k, v = q_KV.shape
    key_draft, key_verify = jax.random.split(key)
    q_BKV = jnp.broadcast_to(q_KV, (n, k, v))
    drafts_BK = sample_from_probs(key_draft, q_BKV)
    p_BK1V = jnp.broadcast_to(p_K1V, (n, k + 1, v))
    n_acc_B, out_BK1 = rejection_accept(key_verify, drafts_BK, q_BKV, p_BK1V)
    return drafts_BK, n_acc_B, out_BK1


def speculate(seed, p_K1V, q_KV, n=N_DRAWS):
    out = _speculate(jax.random.key(seed), jnp.asarray(p_K1V, jnp.float32), jnp.asarray(q_KV, jnp.float32), n)
    return tuple(np.asarray(a) for a in out)


def random_logits(rng, *shape, scale=1.5):
    return (rng.normal(size=shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------ greedy


def _onehot_logits(argmax_BK1, vocab):
    """Logits whose argmax is ``argmax_BK1``, with some noise so it isn't trivial."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=argmax_BK1.shape + (vocab,)).astype(np.float32)
    np.put_along_axis(logits, np.asarray(argmax_BK1)[..., None], 10.0, axis=-1)
    return jnp.asarray(logits)


def test_greedy_crafted_cases():
    vocab = 11
    target_argmax = np.array(
        [
            [1, 2, 3, 4],  # all 3 drafts match -> bonus 4 at position K
            [5, 2, 3, 4],  # mismatch at 0 -> correction 5
            [1, 2, 7, 4],  # mismatch in the middle (position 2) -> correction 7
            [1, 9, 3, 4],  # mismatch at 1 although position 2 would match again
        ]
    )
    drafts = jnp.array([[1, 2, 3]] * 4, jnp.int32)
    n, out = greedy_accept(drafts, _onehot_logits(target_argmax, vocab))
    n, out = np.asarray(n), np.asarray(out)
    np.testing.assert_array_equal(n, [3, 0, 2, 1])
    assert n.dtype == np.int32 and out.dtype == np.int32 and out.shape == (4, 4)
    expected_emitted = [[1, 2, 3, 4], [5], [1, 2, 7], [1, 9]]
    for b, exp in enumerate(expected_emitted):
        assert out[b, : n[b] + 1].tolist() == exp


def test_greedy_ties_and_jit_bitwise():
    # Exact ties in the target logits resolve to the lowest id, identically under jit.
    logits = jnp.zeros((2, 3, 6), jnp.float32).at[0, :, 4].set(1.0).at[0, :, 2].set(1.0)
    drafts = jnp.array([[2, 2], [0, 1]], jnp.int32)
    n_e, out_e = greedy_accept(drafts, logits)
    n_j, out_j = jax.jit(greedy_accept)(drafts, logits)
    np.testing.assert_array_equal(n_e, [2, 1])
    np.testing.assert_array_equal(out_e, [[2, 2, 2], [0, 0, 0]])
    np.testing.assert_array_equal(n_e, n_j)
    np.testing.assert_array_equal(out_e, out_j)


# --------------------------------------------------------------------------- filtering


def test_top_k_exact_sets_with_ties():
    logits = jnp.array([3.0, 1.0, 2.0, 2.0, 0.0, -1.0])
    assert kept(jfilter(logits, 1.0, 1, 1.0)) == {0}
    # k-th largest (k=2) is 2.0, shared by ids 2 and 3: both kept.
    assert kept(jfilter(logits, 1.0, 2, 1.0)) == {0, 2, 3}
    assert kept(jfilter(logits, 1.0, 3, 1.0)) == {0, 2, 3}
    assert kept(jfilter(logits, 1.0, 4, 1.0)) == {0, 1, 2, 3}
    for off in (0, 6, 100):  # 0 means off; k >= V keeps everything
        assert kept(jfilter(logits, 1.0, off, 1.0)) == set(range(6))


def test_top_p_exact_sets():
    probs = np.array([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 1 (.5), 3 (.2), 0 (.15), 4 (.1), 2 (.05)
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    assert kept(jfilter(logits, 1.0, 0, 0.3)) == {1}
    assert kept(jfilter(logits, 1.0, 0, 0.6)) == {1, 3}  # .5 < .6 <= .7: crossing token kept
    assert kept(jfilter(logits, 1.0, 0, 0.75)) == {1, 3, 0}
    assert kept(jfilter(logits, 1.0, 0, 0.9)) == {1, 3, 0, 4}
    assert kept(jfilter(logits, 1.0, 0, 0.99)) == set(range(5))
    # Tiny top_p (and even 0) still keeps the most likely token.
    assert kept(jfilter(logits, 1.0, 0, 1e-6)) == {1}
    assert kept(jfilter(logits, 1.0, 0, 0.0)) == {1}


def test_top_p_one_is_off_even_for_negligible_tokens():
    # In float32 the top token's probability rounds to exactly 1.0, so "cumulative
    # probability before the token < top_p" alone would drop the rest; top_p=1 must not.
    logits = jnp.array([-20.0, -200.0, 0.0, -1e4])
    assert float(jax.nn.softmax(logits)[2]) == 1.0
    assert kept(jfilter(logits, 1.0, 0, 1.0)) == {0, 1, 2, 3}
    # Also when top-k is on (so the filtering path runs): only top-k may remove tokens.
    assert kept(jfilter(logits, 1.0, 3, 1.0)) == {0, 1, 2}
    np.testing.assert_array_equal(jfilter(logits, 1.0, 0, 1.0), logits)


def test_top_p_ties_at_cutoff_are_kept():
    logits = jnp.log(jnp.array([0.2, 0.4, 0.2, 0.2]))
    # Prefix reaching 0.5 ends at a 0.2 token; the other two tied 0.2 tokens stay too.
    assert kept(jfilter(logits, 1.0, 0, 0.5)) == {0, 1, 2, 3}
    assert kept(jfilter(logits, 1.0, 0, 0.3)) == {1}


def test_top_p_applies_to_top_k_renormalised_probs():
    logits = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3]))
    # Without top-k: .4 < .5 so the .3 token is needed as well.
    assert kept(jfilter(logits, 1.0, 0, 0.5)) == {1, 3}
    # After top-2 the probs are 4/7, 3/7: the first alone already reaches 0.5.
    assert kept(jfilter(logits, 1.0, 2, 0.5)) == {1}
    assert kept(jfilter(logits, 1.0, 2, 0.6)) == {1, 3}


def test_temperature_scaling_and_target_probs():
    logits = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.0, 0.0, 1.0, -1.0]])
    out = jfilter(logits, 0.5, 0, 1.0)
    np.testing.assert_allclose(out, logits / 0.5, rtol=1e-6)
    p = jprobs(logits, 0.7, 3, 1.0)
    assert p.dtype == jnp.float32
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    ref = softmax_np(np.asarray(logits) / 0.7)
    ref[0, 1] = 0.0
    ref[1, 3] = 0.0
    np.testing.assert_allclose(p, ref / ref.sum(-1, keepdims=True), rtol=1e-5)
    # Temperature changes which tokens survive top-p (flatter -> more tokens).
    row = jnp.array([2.0, 1.0, 0.0, -1.0])
    assert kept(jfilter(row, 0.25, 0, 0.9)) == {0}
    assert kept(jfilter(row, 4.0, 0, 0.9)) == {0, 1, 2, 3}


def test_per_row_sampling_params_broadcast():
    logits = jnp.tile(jnp.array([3.0, 1.0, 2.0, 0.0]), (3, 1))
    out = jfilter(logits, jnp.array([1.0, 1.0, 2.0]), jnp.array([1, 0, 2]), jnp.array([1.0, 0.5, 1.0]))
    assert kept(out[0]) == {0}
    assert kept(out[1]) == {0}  # softmax([3,1,2,0])[0] ~ 0.64 >= 0.5
    assert kept(out[2]) == {0, 2}
    np.testing.assert_allclose(out[2, [0, 2]], [1.5, 1.0])


def test_filter_jit_with_traced_params_matches_reference_without_retrace():
    traces = []

    @jax.jit
    def f(logits, t, k, p):
        traces.append(1)
        return filter_logits(logits, t, k, p), target_probs(logits, t, k, p)

    logits = random_logits(np.random.default_rng(1), 4, 10)
    for t, k, p in [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.6), (2.0, 1, 0.01), (0.9, 7, 0.95)]:
        got_l, got_p = f(jnp.asarray(logits), jnp.float32(t), jnp.int32(k), jnp.float32(p))
        ref = np.stack([filter_ref(row, t, k, p) for row in logits])
        np.testing.assert_array_equal(np.isfinite(got_l), np.isfinite(ref))
        np.testing.assert_allclose(np.where(np.isfinite(ref), got_l, 0), np.where(np.isfinite(ref), ref, 0), rtol=1e-6)
        np.testing.assert_allclose(got_p, softmax_np(ref), rtol=1e-5, atol=1e-7)
    assert len(traces) == 1


# ---------------------------------------------------------------------------- sampling


def test_sample_from_probs_handles_zeros_and_unnormalised():
    weights = jnp.array([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.0, 0.0])  # sums to 6.5
    ids = sample_from_probs(jax.random.key(0), jnp.broadcast_to(weights, (N_DRAWS, 8)))
    assert ids.shape == (N_DRAWS,) and ids.dtype == jnp.int32
    assert chisq_pvalue(ids, weights) > P_MIN


# ---------------------------------------------------------------------- lossless checks


def _case(seed, k, vocab, top_k, top_p, temperature=0.8):
    """Target p [K+1, V] from random logits filtered by top-k/top-p. Draft q [K, V] is
    a noisy, *unfiltered* copy of the target logits, like a real drafter: it accepts
    often enough to reach later positions and still puts mass where p is zero."""
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, k + 1, vocab)
    p = np.asarray(jprobs(jnp.asarray(logits), temperature, top_k, top_p))
    q = softmax_np(logits[:k] / temperature + random_logits(rng, k, vocab, scale=1.0)).astype(np.float32)
    return p, q


@pytest.mark.parametrize(
    "seed,k,vocab,top_k,top_p",
    [
        (10, 1, 10, 4, 1.0),  # top-k: q has mass on the 6 tokens p excludes
        (11, 3, 10, 0, 0.85),  # top-p
        (12, 3, 10, 5, 0.9),  # both
    ],
)
def test_emitted_tokens_follow_target(seed, k, vocab, top_k, top_p):
    p, q = _case(seed, k, vocab, top_k, top_p)
    assert q[0, p[0] == 0].sum() > 0.02, "case should put draft mass on tokens the target excludes"
    drafts, n_acc, out = speculate(seed, p, q)
    assert n_acc.min() >= 0 and n_acc.max() <= k
    # The first emitted token is always emitted and must follow p_0 exactly.
    assert chisq_pvalue(out[:, 0], p[0]) > P_MIN
    # Positions are independent here, so the token at position j, given it is emitted
    # (n >= j: all earlier drafts accepted), must follow p_j; j = K is the bonus.
    for j in range(1, k + 1):
        emitted = n_acc >= j
        assert emitted.sum() > 2000
        assert chisq_pvalue(out[emitted, j], p[j]) > P_MIN
    # Accepted prefix really is the drafts.
    pos = np.arange(k)[None, :]
    assert np.all((out[:, :k] == drafts) | (pos >= n_acc[:, None]))


def test_power_check_unverified_drafts_are_detected():
    # Sanity check that the chi-square test has power: raw drafts (no verification)
    # are clearly not distributed as p.
    p, q = _case(10, 1, 10, 4, 1.0)
    drafts, _, _ = speculate(10, p, q)
    p_mixed = 0.9 * p[0] + 0.1 * q[0]  # avoid the exact zero-prob assertion
    assert chisq_pvalue(drafts[:, 0], p_mixed) < 1e-10


def test_q_equals_p_accepts_everything():
    p, _ = _case(20, 3, 10, 0, 0.9)
    q = p[:3].copy()
    drafts, n_acc, out = speculate(20, p, q)
    assert np.all(n_acc == 3)
    np.testing.assert_array_equal(out[:, :3], drafts)
    for j in range(4):
        assert chisq_pvalue(out[:, j], p[j]) > P_MIN


def test_zero_residual_falls_back_to_target():
    # A (malformed) draft with p(d) == q(d) == 0 is rejected while p == q, so the
    # residual max(0, p - q) has no mass: the correction must be a sample of p.
    p = np.array([0.0, 0.3, 0.0, 0.5, 0.2, 0.0, 0.0, 0.0], np.float32)
    n = N_DRAWS
    p_BK1V = jnp.broadcast_to(jnp.asarray(p), (n, 2, 8))
    drafts_BK = jnp.zeros((n, 1), jnp.int32)
    n_acc, out = jax.jit(rejection_accept)(jax.random.key(3), drafts_BK, p_BK1V[:, :1], p_BK1V)
    assert np.all(np.asarray(n_acc) == 0)
    assert chisq_pvalue(np.asarray(out[:, 0]), p) > P_MIN


def test_two_round_joint_distribution_is_product_of_targets():
    # Position-dependent p_j and q_j that don't depend on earlier tokens, so a true
    # sample x_0, x_1 from the target has x_0 ~ p_0 independent of x_1 ~ p_1. Run the
    # decoder honestly for two tokens: rows that emitted only one token in round 1
    # (n == 0) get x_1 from a second round starting at sequence position 1.
    vocab, k = 10, 2
    rng = np.random.default_rng(30)
    logits = jnp.asarray(random_logits(rng, k + 2, vocab))
    # Per-position filtering: top-k at position 0, top-p at 1, both at 2, none at 3.
    p = np.asarray(
        jprobs(logits, 0.9, jnp.array([4, 0, 5, 0]), jnp.array([1.0, 0.85, 0.9, 1.0]))
    )
    q = softmax_np(random_logits(rng, k + 1, vocab)).astype(np.float32)
    _, n1, out1 = speculate(31, p[: k + 1], q[:k])
    _, _, out2 = speculate(32, p[1 : k + 2], q[1 : k + 1])
    assert 0.05 < (n1 == 0).mean() < 0.95  # both branches well exercised
    x0 = out1[:, 0]
    x1 = np.where(n1 >= 1, out1[:, 1], out2[:, 0])
    joint = np.outer(p[0].astype(np.float64), p[1].astype(np.float64))
    assert chisq_pvalue(x0 * vocab + x1, joint) > P_MIN


def test_expected_acceptance_length():
    # K=1: P(accept) = sum_v min(p, q). K=3 with i.i.d. positions: E[n] = a + a^2 + a^3.
    p, q = _case(40, 1, 10, 6, 0.95)
    a = np.minimum(p[0].astype(np.float64), q[0]).sum()
    _, n_acc, _ = speculate(40, p, q)
    se = np.sqrt(a * (1 - a) / N_DRAWS)
    assert abs(n_acc.mean() - a) < 5 * se

    rng = np.random.default_rng(41)
    p1 = np.asarray(jprobs(jnp.asarray(random_logits(rng, 10)), 1.0, 0, 0.9))
    q1 = softmax_np(random_logits(rng, 10)).astype(np.float32)
    a = np.minimum(p1.astype(np.float64), q1).sum()
    _, n_acc, _ = speculate(41, np.tile(p1, (4, 1)), np.tile(q1, (3, 1)))
    mean = a + a**2 + a**3
    # n = sum_i 1[first i+1 drafts accepted], so E[n^2] = sum_{i,j} a^(max(i,j)+1).
    var = sum(a ** (max(i, j) + 1) for i in range(3) for j in range(3)) - mean**2
    assert abs(n_acc.mean() - mean) < 5 * np.sqrt(var / N_DRAWS)


def test_full_pipeline_jit_with_traced_sampling_params():
    traces = []

    @jax.jit
    def step(key, logits_BK1V, drafts_BK, q_BKV, t, k, p):
        traces.append(1)
        return rejection_accept(key, drafts_BK, q_BKV, target_probs(logits_BK1V, t, k, p))

    rng = np.random.default_rng(50)
    logits = jnp.asarray(random_logits(rng, 4, 3, 10))
    q = jnp.asarray(softmax_np(random_logits(rng, 4, 2, 10)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, 10, size=(4, 2)), jnp.int32)
    for t, k, p in [(1.0, 0, 1.0), (0.6, 3, 0.9), (1.5, 0, 0.5)]:
        n_acc, out = step(jax.random.key(0), logits, drafts, q, jnp.float32(t), jnp.int32(k), jnp.float32(p))
        assert n_acc.shape == (4,) and out.shape == (4, 3)
        probs = np.asarray(jprobs(logits, t, k, p))
        # Every emitted extra token has nonzero target probability at its position.
        for b in range(4):
            nb = int(n_acc[b])
            assert probs[b, nb, int(out[b, nb])] > 0
    assert len(traces) == 1


def test_first_argmax_equals_argmax_including_ties():
    from eagle3_jax.speculative.accept import first_argmax

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(4, 5, 301)).astype(np.float32)   # small integers: many ties
    x[0, 0] = 7.0                                                    # an all-equal row
    x[1, 2, [5, 17, 300]] = 9.0                                      # a three-way tie for the max
    x[2, 1, -1] = 100.0                                              # max at the last id
    x[3, 3] = -np.inf
    x[3, 3, 42] = -1e30                                              # -inf everywhere else
    got = np.asarray(first_argmax(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and got[0, 0] == 0 and got[1, 2] == 5 and got[3, 3] == 42
    big = jnp.asarray(rng.standard_normal((2, 3, 129280)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(first_argmax(big)), np.asarray(jnp.argmax(big, axis=-1)))
