"""num_draft_tokens="auto": the choice follows costs and acceptance, and never changes greedy output."""

import functools
import itertools
import json
import time

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.speculative import autodraft, session as session_mod
from eagle3_jax.speculative.autodraft import AcceptanceModel, AutoDraft, RoundCosts
from eagle3_jax.speculative.engine import Engine, Request
from eagle3_jax.speculative.session import SamplingSettings


def test_choice_follows_costs_and_acceptance():
    # verify of K+1 tokens grows with K; target-only round = 1.0
    costs = RoundCosts({0: 1.0, 1: 1.3, 2: 1.45, 3: 1.6, 4: 1.8})
    acc = AcceptanceModel(4)
    auto = AutoDraft(costs, 4, acc)
    assert auto.choose() == 3   # prior 0.7: tau(3) = 2.56 -> 1.6 tok/s per round cost, best
    for _ in range(20):         # every draft rejected: speculation cannot pay
        auto.observe(1, 10, 13.0, 20, 20, [0, 0, 0, 0])   # 10 iterations at the calibrated 1.3 s
    assert auto.choose() == 0
    assert acc.tau(0) == 1.0 and acc.tau(1) < 1.03
    acc2 = AcceptanceModel(4)
    acc2.observe(4, 1000, [900, 810, 729, 656])   # a_j = 0.9 everywhere
    np.testing.assert_allclose(acc2.conditional(), 0.9, atol=0.01)
    assert AutoDraft(costs, 4, acc2).choose() == 4
    # verify twice as dear as above: tau(4) = 4.1 does not pay 5.5 target steps, nor any smaller K
    expensive = RoundCosts({0: 1.0, 1: 2.5, 2: 3.5, 3: 4.5, 4: 5.5})
    assert AutoDraft(expensive, 4, acc2).choose() == 0


def test_unreached_positions_are_priced_from_the_one_before():
    """Rounds at K = 3 never offer positions 4..6: their prior is the estimate of position 3, not a
    fixed 0.7. The numbers are a measured case (demo pair, batch 1, greedy: live round costs, 87 %
    acceptance per position), where the fixed prior held K = 3 and K = 6 ran 14 % faster."""
    costs = RoundCosts({0: 1.0, 1: 1.60, 2: 2.11, 3: 2.34, 4: 2.67, 5: 2.91, 6: 3.16})
    acc = AcceptanceModel(6)
    acc.observe(3, 800, [696, 606, 527])           # a_1..a_3 = 0.87
    a = acc.conditional()
    np.testing.assert_allclose(a[:3], 0.87, atol=0.005)
    np.testing.assert_allclose(a[3:], a[2])        # carried over, not 0.7
    assert AutoDraft(costs, 6, acc).choose() == 6
    low = AcceptanceModel(6)
    low.observe(2, 800, [400, 100])                # a_1 = 0.5, a_2 = 0.25: deeper positions stay low
    assert low.conditional()[5] < 0.3


def test_speculation_must_beat_target_only_by_the_margin():
    costs = RoundCosts({0: 1.0, 1: 1.0})            # drafting and verifying as cheap as a decode step
    slight = AcceptanceModel(1)
    slight.observe(1, 1000, [55])                  # tau(1) ~ 1.06: predicted 6 % faster, within the margin
    assert 1.0 < AutoDraft(costs, 1, slight).rate(1) < 1.0 + autodraft.SPECULATION_MARGIN
    assert AutoDraft(costs, 1, slight).choose() == 0
    clear = AcceptanceModel(1)
    clear.observe(1, 1000, [300])                  # tau(1) ~ 1.3
    assert AutoDraft(costs, 1, clear).choose() == 1


def test_the_wall_clock_vetoes_speculation_that_loses():
    costs = RoundCosts({0: 1.0, 1: 1.0})
    acc = AcceptanceModel(1)
    acc.observe(1, 1000, [500])                    # the round model: K = 1 is 1.5x target-only
    auto = AutoDraft(costs, 1, acc)
    assert auto.choose() == 1
    for _ in range(3):                             # whole cycles: speculating slower on the wall clock
        auto.observe_cycle(1, 10.0, 1.0)
        auto.observe_cycle(0, 12.0, 1.0)
    assert auto.wall.rate(1) is None and auto.choose() == 1   # too few cycles to veto
    auto.observe_cycle(1, 10.0, 1.0)
    auto.observe_cycle(0, 12.0, 1.0)
    assert auto.wall.rate(1) == 10.0 and auto.wall.rate(0) == 12.0 and auto.choose() == 0
    for _ in range(autodraft.WALL_WINDOW):       # the latest cycles count: speculation pays again
        auto.observe_cycle(1, 15.0, 1.0)
    assert auto.choose() == 1


def test_the_veto_is_per_k():
    """A K that loses on the wall clock is overruled alone: the round model's next best K runs, and
    an exploration from target-only tries it rather than the vetoed one."""
    costs = RoundCosts({0: 1.0, 1: 1.3, 2: 1.45, 3: 1.6})
    acc = AcceptanceModel(3)
    acc.observe(3, 1000, [800, 640, 512])          # a_j = 0.8: K = 3 best, then K = 2, both pay
    auto = AutoDraft(costs, 3, acc)
    assert auto.choose() == 3
    for _ in range(autodraft.WALL_MIN_CYCLES):
        auto.observe_cycle(3, 9.0, 1.0)            # K = 3 slower than target-only on the wall clock
        auto.observe_cycle(0, 10.0, 1.0)
    assert auto.vetoed(3) and not auto.vetoed(2) and auto.choose() == 2
    assert auto._best_speculating() == 2
    for _ in range(autodraft.WALL_MIN_CYCLES):
        auto.observe_cycle(2, 9.5, 1.0)            # K = 2 loses too, K = 1 has no cycles yet
    assert auto.choose() == 1
    for _ in range(autodraft.WALL_MIN_CYCLES):
        auto.observe_cycle(1, 9.8, 1.0)            # 2 % slower: within the margin, level with target-only
    assert not auto.vetoed(1) and auto.choose() == 1
    for _ in range(autodraft.WALL_WINDOW):
        auto.observe_cycle(1, 9.6, 1.0)            # 4 % slower: vetoed
    assert auto.choose() == 0
    assert auto._best_speculating() == 3           # all vetoed: the round model's best is measured again


def test_without_target_only_cycles_the_veto_uses_its_round_cost():
    """Target-only is not explored while speculating, so the wall clock may hold no cycles of it: the
    veto then compares with target-only's rounds at their current cost (1 token per row per round)."""
    acc = AcceptanceModel(1)
    acc.observe(1, 1000, [500])                    # the round model: K = 1 is 1.5x target-only
    auto = AutoDraft(RoundCosts({0: 0.1, 1: 0.1}), 1, acc)   # target-only: 10 tokens per row per second
    for _ in range(autodraft.WALL_MIN_CYCLES):
        auto.observe_cycle(1, 9.0, 1.0)            # speculating cycles: 9 tokens per row per second
    assert auto.wall.rate(0) is None and auto.choose() == 0
    for _ in range(autodraft.WALL_WINDOW):
        auto.observe_cycle(1, 11.0, 1.0)
    assert auto.choose() == 1


def test_costs_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    costs = RoundCosts({0: 0.5, 1: 0.75})
    autodraft.save_costs("pair|cpu|B=2", costs)
    assert autodraft.load_costs("pair|cpu|B=2").seconds == costs.seconds
    assert autodraft.load_costs("other") is None
    assert json.loads((tmp_path / "round_costs.json").read_text())["pair|cpu|B=2"] == {"0": 0.5, "1": 0.75}


@pytest.fixture
def draft(tiny_target, trained_draft_dir):
    return e3.load_draft(trained_draft_dir, tiny_target)


def test_forced_switches_stay_lossless(tiny_target, draft, monkeypatch, tmp_path):
    """K switches between every bounded run (including K = 0 with a draft present): greedy output
    equals target-only decoding of each prompt alone."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(session_mod, "calibrate",
                        lambda *a: RoundCosts({k: 1.0 + 0.1 * k for k in range(4)}, calibration_seconds=1.0))
    schedule = itertools.cycle([3, 0, 1, 2, 0, 0, 3, 1])
    monkeypatch.setattr(AutoDraft, "choose", lambda self, remaining=None: next(schedule))
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
    assert choice.compiled_programs == 4
    # runs of rounds_per_sync = 2 rounds are too short to time: no live costs, no measured speedup
    # for a speculating K (target-only's is 1 by definition)
    assert choice.round_seconds_per_k == {}
    assert np.isnan(choice.measured_speedup) if choice.num_draft_tokens else choice.measured_speedup == 1.0
    assert eng._auto.speculative_stats().mean_accept_length > 1.2   # multi-token acceptance was exercised


def test_generator_auto_calibrates_once_and_matches_target_only(tiny_target, draft, monkeypatch, tmp_path):
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(autodraft, "CALIBRATION_REPEATS", 1)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (4, 6, 3)]
    expected = e3.Generator(tiny_target, None, max_len=32).generate(prompts, 12).tokens
    gen = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32)
    assert gen.generate(prompts, 12).tokens == expected
    entries = json.loads((tmp_path / "round_costs.json").read_text())
    assert len(entries) == 1 and set(next(iter(entries.values()))) == {"0", "1", "2"}
    assert gen.draft_choice.num_draft_tokens in (0, 1, 2) and gen.draft_choice.calibration_seconds > 0
    # a new session for the same pair and shape reads the costs instead of calibrating again
    monkeypatch.setattr(session_mod, "calibrate", lambda *a: pytest.fail("calibrated again"))
    again = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32)
    assert again.generate(prompts, 12).tokens == expected
    assert again.draft_choice.calibration_seconds == 0


def test_a_wave_auto_prices_as_target_only_runs_as_one_static_program(tiny_target, draft, monkeypatch, tmp_path):
    """As many prompts as rows, and speculation priced to lose: the wave runs the static target-only
    program (no Engine, no draft), gives target-only's tokens and counts as a K = 0 run. Priced to
    win, the same call goes through the Engine."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (4, 6, 3)]
    expected = e3.Generator(tiny_target, None, max_len=32).generate(prompts, 12).tokens
    engines = []
    original_run = Engine.run

    def counting_run(self, requests):
        engines.append(self)
        return original_run(self, requests)

    monkeypatch.setattr(Engine, "run", counting_run)
    monkeypatch.setattr(session_mod, "calibrate", lambda *a: RoundCosts({0: 1.0, 1: 5.0, 2: 9.0}, calibration_seconds=1.0))
    gen = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32)
    assert gen.generate(prompts, 12).tokens == expected
    # 12 tokens: the first from the prefill, then 11 loop iterations
    assert engines == [] and gen.draft_choice.num_draft_tokens == 0 and gen.draft_choice.rounds_per_k == {0: 11}
    assert gen.last_compile_seconds > 0     # the calibration (and the first compile) are not throughput

    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path / "cheap"))
    monkeypatch.setattr(session_mod, "calibrate", lambda *a: RoundCosts({0: 1.0, 1: 1.0, 2: 1.0}, calibration_seconds=1.0))
    cheap = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32)
    assert cheap.generate(prompts, 12).tokens == expected
    assert len(engines) == 1 and cheap.draft_choice.num_draft_tokens > 0


def test_the_choosers_set_up_time_is_claimed_once(tiny_target, draft, monkeypatch, tmp_path):
    """Calibrating (or reading costs from disk) is compile time, counted by the first caller only: a
    wave the static path hands to the Engine, or a later call, reuses the chooser without it."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))

    def slow_calibration(*a):
        time.sleep(0.2)
        return RoundCosts({0: 1.0, 1: 1.0, 2: 1.0}, calibration_seconds=0.2)

    monkeypatch.setattr(session_mod, "calibrate", slow_calibration)
    session = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=32).session
    sampling = SamplingSettings(0.0, 1.0, 0, 0, ())
    program = session.program(2, 12, sampling)
    auto = session.autodraft(program, sampling.traced(), sampling)
    assert auto.claim_setup_seconds() >= 0.2 and auto.claim_setup_seconds() == 0.0
    assert session.autodraft(program, sampling.traced(), sampling) is auto and auto.claim_setup_seconds() == 0.0


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


def test_live_round_costs_outvote_the_calibration():
    costs = RoundCosts({0: 1.0, 1: 1.1})   # calibrated under load: K = 1 looked nearly free
    acc = AcceptanceModel(1)
    acc.observe(1, 100, [50])               # a_1 = 0.5 (0.51 with the prior): tau(1) = 1.51
    auto = AutoDraft(costs, 1, acc)
    tau1 = acc.tau(1)
    assert auto.choose() == 1 and auto.rate(1) == pytest.approx(tau1 / 1.1)
    auto.observe(0, 4, 5.0, 4, 4, [0])      # 4 target-only rounds at 1.25 s: too few to be a measurement
    assert costs.live_cost(0) is None and costs.cost(0) == 1.0
    auto.observe(0, 6, 7.5, 6, 6, [0])      # 10 rounds at 1.25 s: the machine is 25 % slower than calibrated
    assert costs.cost(0) == pytest.approx(1.25)
    assert costs.cost(1) == pytest.approx(1.1 * 1.25)   # not measured: its calibration, scaled the same
    assert auto.choose() == 1
    auto.observe(1, 10, 20.0, 10, 15, [5])  # live K = 1 rounds cost 2 s: speculation loses
    assert costs.cost(1) == pytest.approx(2.0) and auto.choose() == 0
    choice = auto.report()
    assert choice.round_seconds_per_k == {0: pytest.approx(1.25), 1: pytest.approx(2.0)}
    assert choice.predicted_speedup == pytest.approx(acc.tau(1) / 1.1) and choice.num_draft_tokens == 1
    assert choice.measured_speedup == pytest.approx(acc.tau(1) / 2.0 * 1.25)
    auto.observe(1, 5, 0.0, 5, 6, [1])      # a run that compiled: teaches acceptance, not cost
    auto.observe(1, 2, 1.0, 2, 3, [1])      # too short a run to time (fixed costs dominate): ignored
    assert costs.cost(1) == pytest.approx(2.0)


def test_exploration_backs_off_while_it_confirms_the_choice():
    # K = 1 is predicted 6 % faster at the prior's acceptance (within the margin: K = 0 is chosen);
    # at their upper confidence bounds K = 1 is 25 % and K = 2 36 % faster: worth exploring
    auto = AutoDraft(RoundCosts({0: 1.0, 1: 1.6, 2: 2.2}), 2, AcceptanceModel(2))
    assert auto.choose() == 0 and auto.could_pay()
    picks = [auto.next_k() for _ in range(100)]
    explored = [i + 1 for i, k in enumerate(picks) if k != 0]   # run numbers that speculated
    # first right away (runs 2-3), then after 8, 16, 32, 64 runs of the choice: few runs lost where K = 0 wins
    assert explored == [2, 3, 12, 13, 30, 31, 64, 65]
    assert set(picks) == {0, 2}   # the K of the highest optimistic rate
    # when a measurement changes the choice, the interval starts again from EXPLORE_FIRST
    auto.observe(0, 10, 10.0, 10, 10, [0, 0])     # live: target-only rounds as calibrated,
    auto.observe(2, 10, 20.0, 10, 30, [10, 10])   # K = 2 rounds at 2 s, every draft accepted
    assert auto.choose() == 2
    # while speculating, target-only is priced, never explored: its rounds would leave every row's
    # draft state stale
    assert [auto.next_k() for _ in range(40)] == [2] * 40
    # back at target-only (every draft rejected lately), speculation is explored again EXPLORE_FIRST
    # runs later, not at once
    auto.observe(2, 10, 20.0, 400, 400, [0, 0])
    assert auto.choose() == 0
    again = [auto.next_k() for _ in range(autodraft.EXPLORE_FIRST + 2)]
    assert again[:autodraft.EXPLORE_FIRST - 1] == [0] * (autodraft.EXPLORE_FIRST - 1)


def test_serve_auto_reports_its_choice_and_matches_target_only(tiny_target, draft, trained_draft_dir, tiny_target_dir,
                                                             tmp_path, monkeypatch):
    """``serve.py --num-draft-tokens auto``: outputs equal target-only; metrics.json says which K ran,
    how often, and the predicted and measured speedups."""
    from tests.serve_fixtures import (ModelCache, byte_target_dir, expected_text_records, prompt_rows, read_jsonl,
                                      serve, write_jsonl)

    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(session_mod, "calibrate",   # costs as if measured: compiles only the Ks that run
                        lambda *a: RoundCosts({k: 1.0 + 0.1 * k for k in range(7)}, calibration_seconds=1.0))
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


def test_exploring_speculation_waits_for_rows_with_a_current_draft():
    """While target-only is chosen, rows are admitted without the draft; exploring K >= 1 on them
    would draft from stale states and learn nothing, so it waits for rows admitted with the draft."""
    auto = AutoDraft(RoundCosts({0: 1.0, 1: 1.6}), 1, AcceptanceModel(1))
    assert auto.choose() == 0 and auto.could_pay()
    assert [auto.next_k(drafted_rows=False) for _ in range(20)] == [0] * 20   # due since run 2: postponed
    assert auto.next_k(drafted_rows=True) == 1 and auto.last_was_exploration
    assert auto.next_k(drafted_rows=False) == 1   # the exploration's second run goes ahead


def test_speculation_that_cannot_pay_is_not_explored():
    """K >= 1 rounds cost 5-9 target-only rounds: even with every draft accepted (τ(K) = K + 1)
    speculation loses, so exploring it would only cost time. Once acceptance is known to be low,
    a K that would pay at the prior's optimism is not explored either."""
    auto = AutoDraft(RoundCosts({0: 1.0, 1: 5.0, 2: 9.0}), 2, AcceptanceModel(2))
    assert not auto.could_pay()
    assert {auto.next_k(drafted_rows=True) for _ in range(100)} == {0}
    acc = AcceptanceModel(1)
    cheap = AutoDraft(RoundCosts({0: 1.0, 1: 1.6}), 1, acc)
    assert cheap.could_pay()
    acc.observe(1, 400, [40])                      # a_1 = 0.1 over 400 rounds
    assert acc.tau_upper(1) < 1.2 and not cheap.could_pay()


def test_exploration_goes_where_the_optimism_is_and_ends_when_data_rule_it_out():
    """An exploration runs the K whose acceptance at its upper confidence bound would pay most: the
    one whose data are thinnest where it matters. Exploring the point estimate's best instead (here
    the cheapest K) never offers the deeper positions, which keep their prior's optimism, so
    exploring would never stop (as on the demo pair at batch 1, T = 1)."""
    costs = RoundCosts({0: 1.0, 1: 1.6, 2: 2.0, 3: 2.3, 4: 2.6, 5: 2.8, 6: 3.0})
    acc = AcceptanceModel(6)
    acc.observe(2, 400, [236, 142])                # a_1 = 0.59, a_2 = 0.6; positions 3..6 never offered
    auto = AutoDraft(costs, 6, acc)
    assert auto.choose() == 0                      # every K loses at the point estimates,
    assert max(range(1, 7), key=auto.rate) == 1    # K = 1 loses least,
    assert auto.could_pay() and auto._best_speculating() == 6   # K = 6 could pay at its optimistic tau
    explored = []
    for _ in range(300):
        k = auto.next_k()
        if k:   # 200 rounds at the true acceptance: 0.6 at every position
            explored.append(k)
            auto.observe(k, 16, 16 * costs.seconds[k], 200, 0, [round(200 * 0.6 ** (j + 1)) for j in range(k)])
    assert explored == [6] * autodraft.EXPLORE_RUNS   # one exploration settled it
    assert not auto.could_pay() and auto.choose() == 0


def test_admitting_without_the_draft(tiny_target, draft):
    """admit_rows without the draft's models prefills the target exactly as a drafted admission
    does, leaves every row's draft state as it was, and does less work (no aux states, no draft pass)."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds
    from eagle3_jax.speculative.session import DecodeSession, SamplingSettings

    session = DecodeSession(tiny_target, draft, "auto", 40, max_draft_tokens=2)
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
    assert not np.array_equal(np.asarray(drafted.dhidden_BD[1]), np.asarray(before.dhidden_BD[1]))   # a drafted admission writes it
    flops = {k: low.compile().cost_analysis()["flops"] for k, low in lowered.items()}
    assert flops[0] < 0.9 * flops[2], flops


def test_acceptance_is_learned_only_from_rows_with_a_current_draft(tiny_target, draft, monkeypatch, tmp_path):
    """A prompt admitted for a target-only run and speculated later drafts from a stale state: its
    rounds emit the right tokens but teach auto nothing; a prompt admitted with the draft does."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(session_mod, "calibrate", lambda *a: RoundCosts({k: 1.0 for k in range(3)}, calibration_seconds=1.0))
    asked = []

    def next_k(self, drafted_rows=True, remaining=None):   # target-only for the first run, K = 2 after
        asked.append(drafted_rows)
        self.runs += 1
        self.last_was_exploration = False
        return 0 if len(asked) == 1 else 2

    monkeypatch.setattr(AutoDraft, "next_k", next_k)
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
    acc = eng._auto.acceptance
    assert acc.offered[0] == fresh.rounds and acc.accepted.tolist() == fresh.accepted_per_position
    assert fresh.mean_accept_length > 1.5 and asked[0] is True
    # only the prompt that speculated at one K from a current state tells how prompts spread (tail_rate)
    assert list(eng._auto.prompt_spread) == [pytest.approx((fresh.mean_accept_length - 1) / (acc.tau(2) - 1))]


def test_report_prices_target_only_rounds_that_did_not_run():
    """While speculating, target-only is not explored: the report prices its round at the calibration
    scaled by the live drift, so the measured speedup and the demo's "why" line still exist."""
    costs = RoundCosts({0: 1.0, 1: 1.5})
    acc = AcceptanceModel(1)
    auto = AutoDraft(costs, 1, acc)
    auto.observe(1, 10, 20.0, 10, 18, [8])   # K = 1 rounds at 2 s: the machine is 4/3 slower than calibrated
    choice = auto.report()
    assert costs.live_cost(0) is None and choice.round_seconds_per_k == {1: pytest.approx(2.0)}
    assert choice.target_round_seconds == pytest.approx(4 / 3)
    assert choice.measured_speedup == pytest.approx(acc.tau(1) * (4 / 3) / 2.0)


def test_the_tail_is_priced_by_its_slowest_row():
    """With no prompt waiting, finished rows idle until the last row is done: the batch goes at its
    slowest row's speed. Prompts whose acceptance spreads widely around the mean make speculation
    that pays per row lose on a wide batch's tail; with no spread the tail prices as the mean row."""
    def auto_with(spreads):
        acc = AcceptanceModel(1)
        acc.observe(1, 1000, [900])                   # tau(1) ~ 1.9: 1.27x per row at 1.5 target steps
        auto = AutoDraft(RoundCosts({0: 1.0, 1: 1.5}), 1, acc)
        auto.prompt_spread.extend(spreads)
        return auto

    wave = [96] * 32                                  # a 32-row batch just admitted, nothing queued
    even = auto_with([1.0] * autodraft.TAIL_MIN_PROMPTS)
    assert even.choose() == 1 and even.choose(remaining=wave) == 1
    assert even.rate(1, wave) / even.rate(0, wave) == pytest.approx(even.rate(1) / even.rate(0))
    # half the prompts accept 1.8x the model's extra tokens, half 0.2x: the same mean, but some row
    # of 32 is nearly sure to be a slow one
    spread = auto_with([1.8, 0.2] * (autodraft.TAIL_MIN_PROMPTS // 2))
    assert spread.choose() == 1 and spread.choose(remaining=wave) == 0
    # per row, K = 1 could pay, but a tail is not explored: its rows are about to finish
    assert spread.could_pay() and [spread.next_k(remaining=wave) for _ in range(12)] == [0] * 12
    # rows that ran target-only have no current draft state to speculate from
    assert even.next_k(drafted_rows=True, remaining=wave) == 1
    assert even.next_k(drafted_rows=False, remaining=wave) == 0
    assert even.next_k(drafted_rows=False) == 0   # nor, with prompts waiting, before the next admission
    # too few finished prompts to know the spread: the per-row model decides
    few = auto_with([1.8, 0.2])
    assert few.choose(remaining=wave) == 1


def test_only_one_wave_is_priced_by_its_slowest_row(tiny_target, draft, monkeypatch, tmp_path):
    """``remaining`` reaches auto only while every occupied row was admitted together and nothing
    waits: a wave. The tail of a refilled batch holds rows admitted at different times, which finish
    at different times whatever K is."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(session_mod, "calibrate", lambda *a: RoundCosts({k: 1.0 for k in range(3)}, calibration_seconds=1.0))
    seen = []
    original = AutoDraft.next_k

    def next_k(self, drafted_rows=True, remaining=None):
        seen.append(None if remaining is None else list(remaining))
        return original(self, drafted_rows, remaining)

    monkeypatch.setattr(AutoDraft, "next_k", next_k)
    prompts = [np.random.default_rng(i).integers(2, 256, size=5).tolist() for i in range(5)]

    def run(n, sized=False):
        seen.clear()
        eng = Engine(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=2, max_len=40, batch_size=2,
                     max_new_tokens=12, rounds_per_sync=2)
        requests = (Request(str(i), p) for i, p in enumerate(prompts[:n]))
        list(eng.run(list(requests) if sized else requests))
        return list(seen)

    refill = run(5)  # prompts wait at first; the last prompt's admission leaves rows of two admissions
    assert refill[0] is None and any(r is not None and len(r) == 1 for r in refill)
    assert not any(r is not None and len(r) == 2 for r in refill[1:])
    # One wave handed over as a list (as Generator does) is known as one from its first run: both
    # rows with their whole budget. From an iterator it is only known once a row is done and the
    # iterator turns out empty, so the first run is priced per row.
    assert run(2, sized=True)[0] == [12, 12]
    assert run(2)[0] is None


def test_acceptance_is_learned_per_sampling_setting(tiny_target, draft, monkeypatch, tmp_path):
    """Greedy and sampled decoding accept very differently: a session learns acceptance per sampling
    setting (shared across batch sizes) and round costs per batch shape (shared across settings)."""
    monkeypatch.setenv(autodraft.CACHE_ENV, str(tmp_path))
    calibrated = []

    def calibrate(session, program, sp):
        calibrated.append(program.batch_size)
        return RoundCosts({k: 1.0 for k in range(3)})

    monkeypatch.setattr(session_mod, "calibrate", calibrate)
    session = session_mod.DecodeSession(tiny_target, draft, "auto", max_len=40, max_draft_tokens=2)
    greedy, hot = SamplingSettings(0.0), SamplingSettings(1.0)
    p1 = session.program(1, 8, greedy)
    p1_hot, p2_hot = session.program(1, 8, hot), session.program(2, 8, hot)
    a_greedy = session.autodraft(p1, greedy.traced(), greedy)
    a_greedy.observe(2, 10, 1.0, 10, 30, [10, 10])          # greedy: every draft token accepted
    a_hot = session.autodraft(p1_hot, hot.traced(), hot)
    assert a_hot.acceptance is not a_greedy.acceptance and a_hot.acceptance.offered.sum() == 0
    assert a_hot.acceptance.tau(2) < a_greedy.acceptance.tau(2)
    # the same setting at another batch size shares what was learned; the same shape reuses its costs
    assert session.autodraft(p2_hot, hot.traced(), hot).acceptance is a_hot.acceptance
    assert session.autodraft(p1, greedy.traced(), greedy) is a_greedy
    # greedy and sampled are different programs (costs per program); two batch sizes: three calibrations
    assert sorted(calibrated) == [1, 1, 2]
