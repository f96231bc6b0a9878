"""num_draft_tokens="auto": the choice follows costs and acceptance, and never changes greedy output;
compile accounting and prompt buckets, which the K policy and every front end share."""

import functools
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.metrics import compile_log
from eagle3_jax.speculative import autodraft, session as session_mod
from eagle3_jax.speculative.autodraft import Acceptance, AutoDraft, RoundCosts
from eagle3_jax.speculative.engine import Engine, Request
from eagle3_jax.speculative.policy import Run
from eagle3_jax.speculative.session import SamplingSettings, bucket_prompt_len, prompt_buckets


def run_of(k, iterations, seconds, row_rounds, round_tokens, accepted):
    """A bounded run of one taught row (seconds 0: it compiled)."""
    acc = np.zeros((1, len(accepted)), np.int64)
    acc[0] = accepted
    return Run(k=k, seconds=seconds or None, iterations=iterations, admitted=0, taught_B=np.array([k > 0]),
               rounds_B=np.array([row_rounds]), round_tokens_B=np.array([round_tokens]),
               emitted_B=np.array([round_tokens]), accepted_BK=acc, finished_B=np.array([False]))


def flat_costs(n, step=0.1):
    return lambda *a: RoundCosts({k: 1.0 + step * k for k in range(n)}, probe_seconds=1.0)


def test_choice_follows_costs_and_acceptance():
    costs = RoundCosts({0: 1.0, 1: 1.3, 4: 1.75})   # probed K = 0, 1, 4; K = 2, 3 on the line between
    assert costs.cost(2) == pytest.approx(1.45) and costs.cost(3) == pytest.approx(1.6)
    acc = Acceptance(4)
    acc.observe(4, 1000, [900, 810, 729, 656])      # a_j = 0.9 everywhere
    np.testing.assert_allclose(acc.conditional(), 0.9, atol=0.01)
    assert AutoDraft(costs, 4, acc).choose() == 4
    low = Acceptance(4)
    low.observe(4, 4000, [400, 40, 4, 0])           # a_1 = 0.1: no K pays 1.3 target steps
    assert AutoDraft(costs, 4, low).choose() == 0 and low.tau(0) == 1.0
    # verify twice as dear: tau(4) = 4.1 does not pay 5.5 target steps, nor does any smaller K
    assert AutoDraft(RoundCosts({0: 1.0, 1: 2.5, 4: 5.5}), 4, acc).choose() == 0


def test_the_last_wave_is_priced_by_its_slowest_row():
    """Once no prompt waits, the batch runs until its slowest row is done: a K whose mean acceptance
    pays but whose worst row accepts little deep down loses to a shorter K there; rows alike, the
    wave prices as the mean does."""
    costs = RoundCosts({0: 1.0, 1: 1.2, 4: 1.8})    # K = 2: 1.4
    acc = Acceptance(4)
    acc.observe(4, 1000, [800, 640, 512, 410])      # a_j = 0.8 pooled: tau(4) 3.36 / 1.8 beats tau(2) 2.44 / 1.4
    auto = AutoDraft(costs, 4, acc)
    assert auto.choose() == 4
    # row 0 accepts every position; row 1 accepts 0.8, 0.5, 0.1, 0.1 of what reaches each position
    offered = np.array([[1000, 1000, 1000, 1000], [1000, 800, 400, 40]])
    accepted = np.array([[1000, 1000, 1000, 1000], [800, 400, 40, 4]])
    wave = autodraft.Wave(np.array([60, 60]), accepted, offered)
    # row 1's tau(4) is ~2.24, tau(2) ~2.2: the wave lasts 60 / 2.24 rounds at K = 4, 60 / 2.2 at K = 2
    assert wave.tau(4, acc.conditional()) == pytest.approx(2.24, abs=0.02)
    assert auto.choose(wave) == 2 and auto.choose_next(wave=wave) == 2
    # a row with little left does not hold the wave: row 1 has 2 tokens to go, row 0 sixty
    assert auto.choose(autodraft.Wave(np.array([60, 2]), accepted, offered)) == 4
    # a row seen only at position 1, where it accepts half of what the pool does, is priced at half
    # the pool's rate deeper too (before its own counts there pull it back)
    pooled = acc.conditional()
    few = autodraft.Wave(np.array([60]), np.array([[400, 0, 0, 0]]), np.array([[1000, 0, 0, 0]]))
    a1 = (400 + pooled[0] * autodraft.PRIOR_ROUNDS) / (1000 + autodraft.PRIOR_ROUNDS)
    a2 = pooled[1] * a1 / pooled[0]
    assert few.tau(2, pooled) == pytest.approx(1 + a1 + a1 * a2)
    # no row data yet: each row is the pool, the same rate as without the wave
    blank = autodraft.Wave(np.array([60, 60]), np.zeros((2, 4)), np.zeros((2, 4)))
    assert auto.rate(3, 0.0, blank) == pytest.approx(auto.rate(3))


def test_a_one_row_wave_is_priced_by_the_pool_not_a_borrowed_row():
    """A new row of a wave borrows a finished row's counts so that a batch's slowest row can be
    found; with one row there is none to find, and a lucky borrowed row would only pick a K the
    pool says loses (batch 1, T = 1)."""
    costs = RoundCosts({0: 1.0, 1: 1.7, 4: 3.0})   # K = 2: 2.13
    acc = Acceptance(4)
    acc.observe(4, 4000, [2200, 1300, 700, 400])     # a_1 = 0.55: no K pays
    auto = AutoDraft(costs, 4, acc)
    lucky = (np.array([95, 90, 85, 80]), np.array([100, 95, 90, 85]))   # one past row accepting ~0.95
    auto.past_rows.append(lucky)
    fresh = lambda n: autodraft.Wave(np.full(n, 60), np.zeros((n, 4)), np.zeros((n, 4)))
    assert auto.choose() == 0 and auto.choose(fresh(1)) == 0
    assert auto.choose_next(wave=fresh(1)) == 0
    assert auto._with_past(fresh(1)).offered_BK.sum() == 0   # the row keeps its own (no) counts
    # two fresh rows both borrow the lucky row: then the wave looks like it, and speculation pays
    assert auto._with_past(fresh(2)).offered_BK[:, 0].tolist() == [100, 100]
    assert auto.choose(auto._with_past(fresh(2))) > 0


def test_unreached_positions_are_priced_from_the_one_before():
    """Rounds at K = 3 never offer positions 4..6: their prior is the estimate of position 3, not a
    fixed 0.7 (measured case, demo pair, batch 1, greedy: 87 % per position; a fixed prior held
    K = 3 where K = 6 ran 14 % faster)."""
    costs = RoundCosts({0: 1.0, 1: 1.60, 2: 2.11, 3: 2.34, 4: 2.67, 5: 2.91, 6: 3.16})
    acc = Acceptance(6)
    acc.observe(3, 800, [696, 606, 527])
    a = acc.conditional()
    np.testing.assert_allclose(a[:3], 0.87, atol=0.005)
    np.testing.assert_allclose(a[3:], a[2])
    assert AutoDraft(costs, 6, acc).choose() == 6
    low = Acceptance(6)
    low.observe(2, 800, [400, 100])                 # a_1 = 0.5, a_2 = 0.25: deeper positions stay low
    assert low.conditional()[5] < 0.3


def test_the_upper_bound_explores_and_the_data_end_it():
    """With no data, acceptance at its upper bound makes speculating worth a try; once the rounds
    show it loses, the bound has closed in and target-only is chosen. A K that could not pay even
    with every draft accepted is never tried."""
    costs = RoundCosts({0: 1.0, 1: 1.6, 2: 2.2})
    auto = AutoDraft(costs, 2, Acceptance(2))
    assert auto.rate(2, autodraft.UCB_Z) > auto.rate(0) and auto.choose_next() > 0
    for _ in range(10):                             # runs at K = 2 that accept 30 % per position
        auto.observe(run_of(2, 16, 16 * 2.2, 16, 0, [5, 1]))
    assert auto.choose() == 0
    assert auto.choose_next(drafted_rows=True) == 0
    hopeless = AutoDraft(RoundCosts({0: 1.0, 1: 5.0, 2: 9.0}), 2, Acceptance(2))
    assert hopeless.acceptance.tau(2, 10.0) == 3.0 and {hopeless.choose_next() for _ in range(50)} == {0}
    # rows without a current draft state never speculate, whatever the model says
    keen = Acceptance(2)
    keen.observe(2, 1000, [1000, 1000])
    assert AutoDraft(costs, 2, keen).choose_next(drafted_rows=False) == 0


def test_speculation_must_beat_target_only_by_the_margin():
    costs = RoundCosts({0: 1.0, 1: 1.0})            # drafting and verifying as cheap as a decode step
    slight = Acceptance(1)
    slight.observe(1, 100000, [1000])               # tau(1) ~ 1.01 even at its upper bound
    assert 1.0 < AutoDraft(costs, 1, slight).rate(1, autodraft.UCB_Z) < 1.0 + autodraft.MARGIN
    assert AutoDraft(costs, 1, slight).choose() == 0
    clear = Acceptance(1)
    clear.observe(1, 1000, [300])                   # tau(1) ~ 1.3
    assert AutoDraft(costs, 1, clear).choose() == 1


def test_live_round_costs_outvote_the_probe():
    costs = RoundCosts({0: 1.0, 1: 1.1, 2: 1.2})    # probed while the machine was idle
    acc = Acceptance(2)
    acc.observe(1, 1000, [500])
    auto = AutoDraft(costs, 2, acc)
    auto.observe(run_of(0, 3, 3.75, 3, 3, [0, 0]))          # 3 rounds: too short a run to time
    assert costs.live(0) is None and costs.cost(0) == 1.0
    auto.observe(run_of(0, 8, 10.0, 8, 8, [0, 0]))          # target-only at 1.25 s: the machine is 25 % slower
    assert costs.cost(0) == pytest.approx(1.25)
    assert costs.cost(2) == pytest.approx(1.2 * 1.25)   # not run: its probe, scaled the same
    auto.observe(run_of(1, 10, 20.0, 10, 15, [5, 0]))       # K = 1 rounds at 2 s live
    assert costs.cost(1) == pytest.approx(2.0)
    auto.observe(run_of(1, 5, 0.0, 5, 6, [1, 0]))           # a run that compiled: teaches acceptance, not cost
    assert costs.cost(1) == pytest.approx(2.0) and acc.offered[0] == 1015
    for _ in range(autodraft.LIVE_RUNS):            # K = 1's window holds its latest runs only
        auto.observe(run_of(1, 10, 10.0, 10, 15, [5, 0]))
    assert costs.cost(1) == pytest.approx(1.0) and costs.cost(0) == pytest.approx(1.25)   # K = 0 keeps its own
    for _ in range(autodraft.LIVE_AGE):             # K = 1 only, for long: K = 0's runs age out
        auto.observe(run_of(1, 10, 10.0, 10, 15, [5, 0]))
    assert costs.live(0) is None and costs.cost(0) == pytest.approx(1.0 / 1.1)


def test_a_k_whose_runs_aged_out_keeps_its_measured_ratio_to_target_only():
    """The probe put K = 2 at 1.8 target steps; timed beside target-only it cost 2.4. Once its own
    runs age out it is priced at 2.4 times the current c(0), not re-explored on the probe's 1.8."""
    costs = RoundCosts({0: 1.0, 1: 1.4, 2: 1.8})
    acc = Acceptance(2)
    acc.observe(2, 1000, [600, 420])                # tau(2) ~2.0: pays 1.8 steps, not 2.4
    auto = AutoDraft(costs, 2, acc)
    auto.observe(run_of(0, 16, 16.0, 16, 16, [0, 0]))       # c(0) = 1.0 live
    auto.observe(run_of(2, 16, 38.4, 16, 32, [10, 7]))      # c(2) = 2.4 live
    assert costs.ratio[2] == pytest.approx(2.4)
    for _ in range(autodraft.LIVE_AGE):             # target-only only, on a machine 10 % slower
        auto.observe(run_of(0, 16, 17.6, 16, 16, [0, 0]))
    assert costs.live(2) is None and costs.cost(0) == pytest.approx(1.1)
    assert costs.cost(2) == pytest.approx(2.4 * 1.1)
    assert costs.cost(1) == pytest.approx(1.4 * 1.1)   # never timed: the probe, scaled by the drift
    assert auto.rate(2, autodraft.UCB_Z) < auto.rate(0) and auto.choose() != 2


def test_a_doubtful_choice_retimes_target_only_live():
    """A speculating choice that rests on the probe's c(0) and predicts a small gain runs target-only
    at the next admission of a whole batch (where no row's draft state is lost), so c(0) is timed
    live; a clear gain, or an admission into a batch with older rows, keeps the choice."""
    acc = Acceptance(2)
    acc.observe(2, 1000, [700, 490])                # tau(2) ~ 2.2
    auto = AutoDraft(RoundCosts({0: 1.0, 1: 1.6, 2: 1.8}), 2, acc)
    assert auto.choose() == 2 and auto.predicted(2) < 1.0 + autodraft.RETIME_BELOW
    auto.observe(run_of(2, 16, 16 * 1.8, 16, 35, [11, 8]))  # K = 2 runs live as probed: c(0) still the probe's
    assert auto.choose_next(all_new=False) == 2          # older rows would lose their draft state
    assert auto.choose_next(all_new=True) == 0           # a fresh batch: time target-only
    auto.observe(run_of(0, 16, 16 * 0.6, 16, 16, [0, 0]))   # it runs at 0.6 s, not the probe's 1.0: K = 2 loses
    assert auto.costs.live(0) == pytest.approx(0.6) and auto.choose() == 0
    # a load that came and went: K = 2 pays again once target-only's time is old news, which is
    # when a doubtful choice times target-only once more
    auto.observe(run_of(0, 16, 16 * 1.2, 16, 16, [0, 0]))
    assert auto.choose() == 2 and auto.choose_next(all_new=True) == 2   # c(0) timed just now
    for _ in range(autodraft.RETIME_AFTER + 1):
        auto.observe(run_of(2, 16, 16 * 1.8, 16, 35, [11, 8]))
    assert auto.choose_next(all_new=True) == 0
    clear = AutoDraft(RoundCosts({0: 1.0, 1: 1.1, 2: 1.2}), 2, acc)   # predicted 1.8x: no check
    assert clear.predicted(2) > 1.0 + autodraft.RETIME_BELOW and clear.choose_next(all_new=True) == 2


def test_report_says_measured_only_for_costs_timed_here():
    """The measured speedup needs K's rounds and target-only's rounds from real runs in this process;
    while target-only is priced from the probe, it is nan and only the prediction is given."""
    acc = Acceptance(1)
    acc.observe(1, 100, [60])
    auto = AutoDraft(RoundCosts({0: 1.0, 1: 1.5}, probe_seconds=2.0), 1, acc)
    auto.observe(run_of(1, 10, 20.0, 10, 16, [6]))          # K = 1 at 2 s per round
    c = auto.report()
    assert c.num_draft_tokens == 1 and c.round_seconds_per_k == {1: pytest.approx(2.0)}
    assert math.isnan(c.measured_speedup)           # target-only only probed
    assert c.predicted_speedup == pytest.approx(acc.tau(1) * (1.0 * 2.0 / 1.5) / 2.0)   # c(0) scaled by drift
    assert c.calibration_seconds == 2.0 and c.compiled_programs == 2
    auto.observe(run_of(0, 10, 12.5, 10, 10, [0]))          # target-only rounds at 1.25 s, live
    assert auto.report().num_draft_tokens == 0 and auto.report().measured_speedup == 1.0
    auto.observe(run_of(1, 10, 20.0, 10, 16, [6]))
    assert auto.report().measured_speedup == pytest.approx(acc.tau(1) * 1.25 / 2.0)
    fresh = AutoDraft(RoundCosts({0: 1.0, 1: 1.5}), 1, Acceptance(1))
    fresh.observe(run_of(1, 2, 0.1, 2, 2, [0]))             # too short to time: K = 1 has no live cost
    assert math.isnan(fresh.report().measured_speedup) and fresh.report().predicted_speedup > 0


@pytest.fixture
def draft(tiny_target, trained_draft_dir):
    return e3.load_draft(trained_draft_dir, tiny_target)


def test_forced_switches_stay_lossless(tiny_target, draft, monkeypatch):
    """K switches between every bounded run (including K = 0 with a draft present): greedy output
    equals target-only decoding of each prompt alone."""
    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(4))
    schedule = itertools.cycle([3, 0, 1, 2, 0, 0, 3, 1])
    monkeypatch.setattr(AutoDraft, "choose", lambda self, wave=None: next(schedule))
    # the draft was trained on the first rows of this corpus (long accepted runs), the last is unseen
    trained = np.random.default_rng(0).integers(2, tiny_target.config.vocab_size, size=(48, 6)).tolist()
    prompts = trained[:4] + [np.random.default_rng(3).integers(2, 256, size=7).tolist()]
    ref = e3.Generator(tiny_target, None, max_len=40)
    expected = [ref.generate([p], 18).tokens[0] for p in prompts]
    eng = Engine(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=3, max_len=40, batch_size=2,
                 max_new_tokens=18, rounds_per_sync=2)
    got = {f.key: f.tokens for f in eng.run(Request(str(i), p) for i, p in enumerate(prompts))}
    assert [got[str(i)] for i in range(len(prompts))] == expected
    choice = eng.draft_choice
    # a switch back from K = 0 waits for rows with a current draft state, so not every forced K runs
    assert 0 in choice.rounds_per_k and len([k for k in choice.rounds_per_k if k > 0]) >= 2
    assert eng.speculative_stats.mean_accept_length > 1.2   # multi-token acceptance was exercised


def test_generator_auto_probes_once_per_shape_and_matches_target_only(tiny_target, draft, monkeypatch, tmp_path):
    """Greedy auto gives target-only's tokens; the round costs are probed in this process, once per
    batch shape, and nothing is written to disk."""
    monkeypatch.setattr(session_mod, "PROBE_REPEATS", 1)
    monkeypatch.setenv("HOME", str(tmp_path))
    probes = []
    real = session_mod.probe_costs
    monkeypatch.setattr(session_mod, "probe_costs", lambda *a: probes.append(a[3]) or real(*a))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (4, 6, 3)]
    expected = e3.Generator(tiny_target, None, max_len=32).generate(prompts, 12).tokens
    gen = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32)
    assert gen.generate(prompts, 12).tokens == expected
    assert gen.generate(prompts, 12).tokens == expected
    assert probes == [[0, 1, 2]]
    c = gen.draft_choice
    assert c.num_draft_tokens in (0, 1, 2) and c.calibration_seconds > 0 and set(c.round_seconds_per_k) <= {0, 1, 2}
    assert list(tmp_path.iterdir()) == []


def test_the_last_wave_reaches_the_policy_with_each_rows_own_counts(tiny_target, draft, monkeypatch):
    """A static batch is one wave: the policy is handed each running row's acceptance since
    admission and what it has left; finished rows' counts are kept for the next wave's new rows."""
    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(3, 0.0))
    waves, choose = [], AutoDraft.choose
    monkeypatch.setattr(AutoDraft, "choose", lambda self, wave=None: waves.append(wave) or choose(self, wave))
    prompts = np.random.default_rng(1).integers(2, 256, size=(3, 5)).tolist()
    expected = e3.Generator(tiny_target, None, max_len=40).generate(prompts, 18).tokens
    eng = Engine(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=40, batch_size=4,
                 max_new_tokens=18, rounds_per_sync=3)
    done = {f.key: f for f in eng.run([Request(str(i), p) for i, p in enumerate(prompts)])}
    assert [done[str(i)].tokens for i in range(3)] == expected
    given = [w for w in waves if w is not None]
    # the construction's choice prices the mean; the admission of the wave hands over its new rows
    assert waves[0] is None and waves[1] is given[0]
    assert given[0].remaining_B.tolist() == [18] * 3 and not given[0].offered_BK.any()
    for w in given[1:]:
        assert np.all(w.accepted_BK <= w.offered_BK) and np.all((0 <= w.remaining_B) & (w.remaining_B < 18))
    last = given[-1]
    acc = eng.policy.acceptance
    assert last.offered_BK.sum(0)[0] <= acc.offered[0] and last.offered_BK.sum() > 0
    # the finished rows' own counts are kept: the next wave's new rows borrow them
    past = eng.policy.past_rows
    assert len(past) == 3 and sum(o[0] for _, o in past) == acc.offered[0]
    assert eng.policy._with_past(given[0]).offered_BK[:, 0].tolist() == [o[0] for _, o in reversed(past)]


def test_acceptance_is_learned_only_from_rows_with_a_current_draft(tiny_target, draft, monkeypatch):
    """A prompt admitted for a target-only run and speculated later drafts from a stale state: its
    rounds emit the right tokens but teach auto nothing; a prompt admitted with the draft does."""
    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(3, 0.0))
    asked = []

    def choose_next(self, drafted_rows=True, all_new=False, wave=None):   # target-only for the first run, K = 2 after
        asked.append(drafted_rows)
        return 0 if len(asked) == 1 else 2

    monkeypatch.setattr(AutoDraft, "choose_next", choose_next)
    trained = np.random.default_rng(0).integers(2, tiny_target.config.vocab_size, size=(48, 6)).tolist()
    prompts = trained[:2]
    ref = e3.Generator(tiny_target, None, max_len=40)
    expected = [ref.generate([p], 18).tokens[0] for p in prompts]
    eng = Engine(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=40, batch_size=1,
                 max_new_tokens=18, rounds_per_sync=4)
    done = {f.key: f for f in eng.run(Request(str(i), p) for i, p in enumerate(prompts))}
    assert [done[str(i)].tokens for i in range(2)] == expected
    stale, fresh = done["0"].stats, done["1"].stats
    assert stale.rounds > 4   # it speculated after its first (target-only) run
    acc = eng.policy.acceptance
    assert acc.offered[0] == fresh.rounds and acc.accepted.tolist() == fresh.accepted_per_position
    assert fresh.mean_accept_length > 1.5 and asked[0] is True


def test_acceptance_is_learned_per_sampling_setting(tiny_target, draft, monkeypatch):
    """Greedy and sampled decoding accept very differently: a session learns acceptance per sampling
    setting (shared across batch sizes) and round costs per batch shape and greedy-or-sampled."""
    probed = []

    def probe(session, program, sp, ks):
        probed.append(program.batch_size)
        return RoundCosts({k: 1.0 for k in ks})

    monkeypatch.setattr(session_mod, "probe_costs", probe)
    session = session_mod.DecodeSession(tiny_target, draft, "auto", max_len=40, max_draft_tokens=2)
    greedy, hot = SamplingSettings(0.0), SamplingSettings(1.0)
    p1, p1_hot, p2_hot = session.program(1, 8, greedy), session.program(1, 8, hot), session.program(2, 8, hot)
    a_greedy = session.policy(p1, greedy.traced(), greedy)
    a_greedy.observe(run_of(2, 10, 1.0, 10, 30, [10, 10]))          # greedy: every draft token accepted
    a_hot = session.policy(p1_hot, hot.traced(), hot)
    assert a_hot.acceptance is not a_greedy.acceptance and a_hot.acceptance.offered.sum() == 0
    assert session.policy(p2_hot, hot.traced(), hot).acceptance is a_hot.acceptance
    assert session.policy(p1, greedy.traced(), greedy) is a_greedy
    assert sorted(probed) == [1, 1, 2]


def test_generator_refills_when_prompts_outnumber_rows(tiny_target, draft):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (4, 6, 3, 8, 5)]
    one = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=32)
    expected = [one.generate([p], 10).tokens[0] for p in prompts]
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=32, batch_size=2)
    res = gen.generate(prompts, 10)
    assert res.tokens == expected and res.stats.tokens == sum(map(len, expected))


def test_bad_setting_is_refused(tiny_target, draft):
    with pytest.raises(e3.ConfigError, match="integer or 'auto'"):
        e3.Generator(tiny_target, draft, num_draft_tokens="fast")


def test_compile_accounting_counts_a_compile_and_not_a_cached_call(tiny_target):
    """JAX's compile events say whether a call compiled: a new shape does, the same call again does
    not; a Generator reports the programs its call compiled and leaves their time out of tok/s."""
    log = compile_log()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = jnp.arange(7.0)
    before = log.count
    f(x).block_until_ready()
    assert log.count == before + 1 and log.seconds_since(before) > 0
    f(x).block_until_ready()
    assert log.count == before + 1
    gen = e3.Generator(tiny_target, None, max_len=24)
    prompts = [[5, 6, 7], [8, 9]]
    gen.generate(prompts, 4)
    first = gen.last_compiled_programs
    gen.generate(prompts, 4)
    assert first > 0 and gen.last_compile_seconds == 0.0 and gen.last_compiled_programs == 0
    assert gen.session.compiled_programs == first


def test_prompt_buckets_are_few_and_waste_little():
    """A session compiles one admission program per prompt bucket it meets: the buckets grow
    geometrically, so their number grows with log(max_len), and padding stays under 50 %."""
    for max_len in (64, 2048, 131072):
        buckets = prompt_buckets(max_len)
        assert len(buckets) <= 2 * math.log2(max_len / 16) + 2, (max_len, buckets)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_len - 1
        for n in itertools.chain(range(1, min(max_len, 600)), range(max_len - 50, max_len)):
            b = bucket_prompt_len(n, max_len)
            assert b in buckets and n <= b and (b <= max(16, 1.5 * n) or b == max_len - 1)
    assert prompt_buckets(2048)[:6] == [16, 24, 32, 48, 64, 96]


def test_serve_auto_reports_its_choice_and_matches_target_only(tiny_target, draft, trained_draft_dir, tiny_target_dir,
                                                             tmp_path, monkeypatch):
    """``serve.py --num-draft-tokens auto``: outputs equal target-only; metrics.json says which K ran,
    how often, and the predicted and measured speedups."""
    from tests.serve_fixtures import (ModelCache, byte_target_dir, expected_text_records, prompt_rows, read_jsonl,
                                      serve, write_jsonl)

    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(7))
    target_dir = byte_target_dir(tiny_target_dir, tmp_path / "target")
    rows = prompt_rows()[:6]
    expected = expected_text_records(tiny_target, target_dir, rows)
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    models = ModelCache(tiny_target, {str(trained_draft_dir): draft})
    assert serve(models, target_dir, write_jsonl(tmp_path / "in.jsonl", rows), out, trained_draft_dir,
                 metrics=metrics, num_draft_tokens="auto", batch_size=2) == 0
    assert {r["id"]: (r["text"], r["num_tokens"], r["finish_reason"]) for r in read_jsonl(out)} == expected
    choice = json.loads(metrics.read_text())["auto_draft"]
    assert 0 <= choice["num_draft_tokens"] <= autodraft.DEFAULT_MAX_DRAFT_TOKENS
    assert sum(choice["iterations_per_k"].values()) > 0 and choice["predicted_speedup"] > 0
    assert choice["calibration_seconds"] == 1.0 and choice["compiled_round_programs"] == 7


def test_admitting_without_the_draft(tiny_target, draft):
    """admit_rows without the draft's models prefills the target exactly as a drafted admission
    does, leaves every row's draft state as it was, and does less work (no aux states, no draft pass)."""
    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds

    session = session_mod.DecodeSession(tiny_target, draft, "auto", 40, max_draft_tokens=2)
    program = session.program(2, 8, SamplingSettings())
    sp = SamplingSettings().traced()
    models = session.models()
    rng = np.random.default_rng(6)
    ids = jnp.asarray(rng.integers(2, 256, size=(1, 16)), jnp.int32)
    lengths = jnp.asarray([11], jnp.int32)
    with session.activate():
        state = blank_state(*models, jax.random.key(0), sp, program=program)
        state = admit_rows(*models, state, jnp.asarray([0], jnp.int32), ids, lengths, sp, program=program)
        state = run_rounds(*models, state, jnp.int32(2), jnp.int32(3), sp, program=program)
        rest = (jnp.asarray([1], jnp.int32), ids, lengths, sp)
        without = models[:2] + (None, None)
        lowered = {k: admit_rows.lower(*m, state, *rest, program=program) for k, m in ((0, without), (2, models))}
        copy = functools.partial(jax.tree_util.tree_map, jnp.copy)   # admit_rows donates its state
        drafted = admit_rows(*models, copy(state), *rest, program=program)
        plain = admit_rows(*without, copy(state), *rest, program=program)
    before = state
    for name in ("tokens_BN", "n_out_B", "finish_B", "lengths_B", "last_B", "tcache"):
        for a, b in zip(jax.tree_util.tree_leaves(getattr(plain, name)), jax.tree_util.tree_leaves(getattr(drafted, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    for name in ("dcache", "dhidden_BD", "dlogits_BW"):
        for a, b in zip(jax.tree_util.tree_leaves(getattr(plain, name)), jax.tree_util.tree_leaves(getattr(before, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert not np.array_equal(np.asarray(drafted.dhidden_BD[1]), np.asarray(before.dhidden_BD[1]))
    flops = {k: low.compile().cost_analysis()["flops"] for k, low in lowered.items()}
    assert flops[0] < 0.9 * flops[2], flops
