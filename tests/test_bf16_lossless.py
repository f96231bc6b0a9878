"""What "lossless" means in bfloat16, on the shipped demo pair.

At float32 speculative greedy output equals target-only output exactly (test_lossless*.py). In
bf16 the verify pass runs K+1 tokens through the target where target-only decoding runs one, and
the two round differently, so a near tie between the target's two best tokens can flip. This test
checks that every place where bf16 speculative output departs from bf16 target-only output is
such a near tie: target-only's top-2 logit margin there (its own 1-token decode path) is within
MARGIN_ULPS bf16 ulps of the position's largest logit. A real disagreement (a wrong position, a
stale cache slot) would show up as a divergence at a clear margin.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.serve.demo import DemoPair

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
BF16_EPS = 2.0 ** -8   # bf16 unit roundoff (8 significant bits)
MARGIN_ULPS = 8        # benchmarks/studies/bf16_lossless.py: margins of 0 to 2.4 ulps at the demo's divergences
K = 6
NEW_TOKENS = 64
PROMPTS = 6


@pytest.fixture(scope="module")
def pair():
    p = DemoPair.load(DEMO, num_prompts=PROMPTS)
    target = e3.load_target(os.path.join(DEMO, "target"), dtype="bfloat16")
    return p, target, e3.load_draft(os.path.join(DEMO, "draft"), target)


def decode_logits(target, prompt, tokens, prompt_len: int, capacity: int) -> np.ndarray:
    """Logits predicting each of ``tokens`` as target-only decoding computes them: the prompt (right
    padded to ``prompt_len``: one compiled prefill) then one token per call."""
    cache = target.init_cache(1, capacity)
    padded = list(prompt) + [0] * (prompt_len - len(prompt))
    logits, _, cache, lengths = target.prefill(jnp.asarray([padded]), jnp.asarray([len(prompt)]), cache)
    rows = [np.asarray(logits[0, len(prompt) - 1])]
    for t in tokens[:-1]:
        logits, _, cache, lengths = target.extend(jnp.asarray([[t]]), lengths, cache)
        rows.append(np.asarray(logits[0, 0]))
    return np.stack(rows)


def test_bf16_speculative_output_departs_only_at_near_ties(pair):
    p, target, draft = pair
    capacity = p.capacity(NEW_TOKENS, K)
    base = e3.Generator(target, None, max_len=capacity)
    spec = e3.Generator(target, draft, num_draft_tokens=K, max_len=capacity)
    margins, accepted = [], []
    for prompt in p.prompt_ids:   # batch 1, one compiled program per mode (the prompt length is pinned)
        want = base.generate([prompt], NEW_TOKENS, eos_token_ids=p.eos, prompt_len=p.prompt_len).tokens[0]
        res = spec.generate([prompt], NEW_TOKENS, eos_token_ids=p.eos, prompt_len=p.prompt_len)
        got = res.tokens[0]
        accepted.append(res.stats.mean_accept_length)
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if first is None:
            assert got == want
            continue
        logits_TV = decode_logits(target, prompt, want[:first + 1], p.prompt_len, capacity)
        top2 = np.sort(logits_TV[first])[-2:]
        margins.append((top2[1] - top2[0]) / (BF16_EPS * np.abs(logits_TV[first]).max()))
    assert all(m <= MARGIN_ULPS for m in margins), margins
    assert np.mean(accepted) > 2.0   # verify really ran K + 1 live tokens
