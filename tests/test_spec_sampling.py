"""At T > 0 the speculative loop samples from the target's (filtered) distribution.

The exact joint distribution of the first two new tokens is computed from target forwards and
compared with samples from the whole jitted loop (chi-square, fixed seeds: deterministic).
"""

import numpy as np
import pytest
from scipy import stats

import eagle3_jax as e3
from eagle3_jax.speculative.accept import target_probs

TOP_K, TEMP = 6, 1.0


@pytest.fixture(scope="module")
def prompt(tiny_target):
    return np.random.default_rng(0).integers(2, tiny_target.config.vocab_size, size=(48, 6))[0].tolist()


@pytest.fixture(scope="module")
def exact_joint(tiny_target, prompt):
    V = tiny_target.config.vocab_size
    p1 = np.asarray(target_probs(tiny_target.forward(np.array([prompt])).logits[0, -1], TEMP, TOP_K, 1.0))
    support = np.flatnonzero(p1 > 0)
    seqs = np.array([prompt + [int(t)] for t in support])
    p2 = np.asarray(target_probs(tiny_target.forward(seqs).logits[:, -1], TEMP, TOP_K, 1.0))
    joint = np.zeros((V, V))
    joint[support] = p1[support, None] * p2
    return joint


def _chi2_pvalue(samples, joint):
    V = joint.shape[0]
    counts = np.zeros(V * V)
    np.add.at(counts, samples[:, 0] * V + samples[:, 1], 1)
    expected = joint.reshape(-1) * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # float32 probabilities sum to 1 only up to rounding
    return stats.chisquare(obs, exp).pvalue


def _sample_pairs(gen, prompt, n_rows=512, seeds=range(6)):
    out = []
    for s in seeds:
        res = gen.generate([prompt] * n_rows, 3, temperature=TEMP, top_k=TOP_K, seed=s)
        out += [t[:2] for t in res.tokens]
    return np.array(out)


def test_target_only_sampling_matches_exact_distribution(tiny_target, prompt, exact_joint):
    pairs = _sample_pairs(e3.Generator(tiny_target, None, max_len=16), prompt)
    assert _chi2_pvalue(pairs, exact_joint) > 1e-3


def test_speculative_sampling_matches_exact_distribution(tiny_target, trained_draft_dir, prompt, exact_joint):
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=16)
    pairs = _sample_pairs(gen, prompt)
    assert _chi2_pvalue(pairs, exact_joint) > 1e-3
    # and the draft is accepted some of the time, so the accept path (not only corrections) is tested
    res = gen.generate([prompt] * 64, 3, temperature=TEMP, top_k=TOP_K, seed=99)
    assert sum(res.stats.accepted_per_position) > 0


def test_greedy_and_sampling_share_one_compiled_program(tiny_target, trained_draft_dir, prompt):
    """Greedy vs sampling is a traced flag (Sampling.greedy), not part of the program: after a
    greedy call, a sampled call of the same shape compiles nothing new, and greedy stays lossless."""
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=16)
    base = e3.Generator(tiny_target, None, max_len=16)
    greedy = gen.generate([prompt] * 3, 5)
    sampled = gen.generate([prompt] * 3, 5, temperature=TEMP, top_k=TOP_K, seed=1)
    assert gen.last_compiled_programs == 0, "the sampled call compiled its own program"
    assert greedy.tokens == base.generate([prompt] * 3, 5).tokens
    assert all(len(t) == 5 for t in sampled.tokens)
