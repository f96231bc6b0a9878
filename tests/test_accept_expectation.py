"""The jitted loop's K = 1 acceptance matches sum_x min(p(x), q(x)) on the contexts its rounds ran on.

A sampler can be lossless and still waste draft tokens (rejecting more often than min(1, p/q)), or
accept too often; the chi-square tests of test_spec_sampling.py see only the emitted tokens. Here
the loop's own acceptance count over thousands of rounds is set against the teacher-forced
expectation (``tests/acceptance_check.py``), with fixed seeds: deterministic.
"""

import numpy as np
import pytest

import eagle3_jax as e3
from tests.acceptance_check import MAX_NEW_TOKENS, compare, round_starts

SIGMAS = 4.0
DETECTABLE_GAP = 0.05   # the check must be able to see an acceptance rate this far off


@pytest.fixture(scope="module")
def prompts(tiny_target):
    rows = np.random.default_rng(3).integers(2, tiny_target.config.vocab_size, size=(32, 6)).tolist()
    return [r for r in rows for _ in range(16)]   # 512 rows per run: independent draws per copy


# Three-token rows have acceptance lengths near 1 by construction, which is what the watchdog looks for.
@pytest.mark.filterwarnings("ignore::eagle3_jax.metrics.AcceptanceCollapseWarning")
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_loop_acceptance_matches_overlap(tiny_target, trained_draft_dir, prompts, top_p):
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=1, max_len=6 + MAX_NEW_TOKENS + 3)
    c = compare(gen, prompts, seeds=range(4), temperature=1.0, top_p=top_p)
    # rounds at the prompt's end (prefill's draft output) and one later (the catch-up's) both ran
    assert len(prompts) * 4 < c.rounds < 2 * len(prompts) * 4
    assert 0.1 < c.expected_rate < 0.95, "a draft this weak or strong makes the check say little"
    assert SIGMAS * np.sqrt(c.variance) / c.rounds < DETECTABLE_GAP / 2
    assert abs(c.z) < SIGMAS, (f"acceptance {c.measured_rate:.4f} ± {c.stderr:.4f} over {c.rounds} rounds, "
                               f"expected {c.expected_rate:.4f} (z = {c.z:+.2f})")


def test_round_starts_follow_the_rows():
    eos = (1,)
    assert round_starts(5, [1], float("nan"), eos) == []          # first token EOS: no round
    assert round_starts(5, [7, 8, 9], 2.0, eos) == [5]            # accepted: two tokens, done
    assert round_starts(5, [7, 8, 9], 1.0, eos) == [5, 6]         # rejected, then a second round
    assert round_starts(5, [7, 1], 1.0, eos) == [5]               # the round emitted EOS
    with pytest.raises(ValueError, match="does not fit"):
        round_starts(5, [7, 8], 1.0, eos)
