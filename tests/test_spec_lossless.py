"""Greedy speculative decoding equals target-only greedy decoding, token for token."""

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.metrics import compile_log


@pytest.fixture(scope="module")
def prompts(tiny_target):
    # The first rows of the corpus the trained draft saw (see spec_fixtures.target_greedy_corpus),
    # cut at different lengths, plus a long one that runs into max_len.
    rng = np.random.default_rng(0)
    base = rng.integers(2, tiny_target.config.vocab_size, size=(48, 6)).tolist()
    cont = e3.Generator(tiny_target, None, max_len=40).generate(base[:3], 16).tokens
    return [base[0], base[1] + cont[1][:3], base[2][:4], (base[0] + cont[0])[:20]]


@pytest.fixture(scope="module")
def settings(tiny_target, prompts):
    """max_new 24 and max_len 40: rows 0-2 stop on length or EOS, row 3 (20 tokens) on max_len;
    EOS is a token the target emits mid-way through row 1."""
    free = e3.Generator(tiny_target, None, max_len=40).generate(prompts, 24)
    eos = free.tokens[1][9]
    return dict(max_new_tokens=24, eos_token_ids=(eos,))


@pytest.fixture(scope="module")
def reference(tiny_target, prompts, settings):
    return e3.Generator(tiny_target, None, max_len=40).generate(prompts, **settings)


def test_reference_covers_eos_length_and_max_len(reference):
    reasons = set(reference.finish_reasons)
    assert {"eos", "max_len"} <= reasons, reference.finish_reasons
    assert len(reference.tokens[3]) == 20  # 20-token prompt, max_len 40


@pytest.mark.parametrize("k", [1, 3, 6])
def test_trained_draft_is_lossless(tiny_target, trained_draft_dir, prompts, settings, reference, k):
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    res = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=40).generate(prompts, **settings)
    assert res.tokens == reference.tokens
    assert res.finish_reasons == reference.finish_reasons
    # the draft really is accepted, so multi-token acceptance paths run
    assert res.stats.mean_accept_length > 1.3
    assert res.stats.rounds < sum(len(t) for t in reference.tokens)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_random_draft_is_lossless_and_watchdog_fires(tiny_target, random_draft_dir, prompts, settings, reference, k):
    draft = e3.load_draft(random_draft_dir, tiny_target)
    with pytest.warns(e3.AcceptanceCollapseWarning, match="ACCEPTANCE COLLAPSE"):
        res = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=40).generate(prompts, **settings)
    assert res.tokens == reference.tokens
    assert res.finish_reasons == reference.finish_reasons
    assert res.stats.mean_accept_length < 1.1


def test_batch_of_one(tiny_target, trained_draft_dir, prompts):
    ref = e3.Generator(tiny_target, None, max_len=48).generate(prompts[1:2], 30)
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    res = e3.Generator(tiny_target, draft, num_draft_tokens=3, max_len=48).generate(prompts[1:2], 30)
    assert res.tokens == ref.tokens
    assert len(res.stats.accept_rate_per_position) == 3
    assert res.stats.mean_accept_length == pytest.approx(res.stats.round_tokens / res.stats.rounds)


@pytest.mark.parametrize("mesh_spec", ["data=1,expert=8,tensor=1", "data=1,expert=4,tensor=2", "data=2,expert=2,tensor=2",
                                       "data=8,expert=1,tensor=1"])
def test_spec_on_8_device_mesh_matches_one_device(tiny_target_dir, trained_draft_dir, prompts, settings, reference,
                                                  mesh_spec):
    mesh = e3.make_mesh(mesh_spec)
    target = e3.load_target(tiny_target_dir, mesh=mesh)
    draft = e3.load_draft(trained_draft_dir, target)
    mark = compile_log().count
    # 2 rows for 4 prompts, 2 rounds a run: the loop program runs on states that admissions returned
    # and on states it returned itself
    res = e3.Generator(target, draft, num_draft_tokens=3, max_len=40, batch_size=2).generate(
        prompts, rounds_per_sync=2, **settings)
    assert res.tokens == reference.tokens
    # The loop state keeps one layout between the programs: the loop program is not compiled a second
    # time for the layout an admission returned (it is compiled, or loaded from the suite's cache, once).
    programs = {name: f["compiled"] + f["from_cache"] for name, f in compile_log().since(mark).by_function.items()}
    assert programs["jit(run_rounds)"] == 1, programs
