"""num_draft_tokens="auto": the choice is priced end to end, starts from the table (a calibration, a
probe or the user's), moves only on evidence larger than the noise, explores little, never changes
greedy output; compile accounting and prompt buckets, which the K policy and every front end share."""

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
from eagle3_jax.speculative.autodraft import Acceptance, AutoDraft, Costs
from eagle3_jax.speculative.calibration import CalibrationStore
from eagle3_jax.speculative.engine import Engine, Request
from eagle3_jax.speculative.policy import Batch, Run
from eagle3_jax.speculative.session import PROMPT_BUCKET, SamplingSettings, bucket_prompt_len


def run_of(k, iterations, seconds, row_rounds=None, round_tokens=0, accepted=(), admitted=0, admit_seconds=0.0,
           emitted=None):
    """A bounded run of one row (seconds None: it compiled)."""
    acc = np.zeros((1, max(len(accepted), 1)), np.int64)
    acc[0, :len(accepted)] = accepted
    rounds = iterations if row_rounds is None else row_rounds
    return Run(k=k, seconds=seconds, admit_seconds=admit_seconds if seconds is not None else None,
               iterations=iterations, admitted=admitted, taught_B=np.array([k > 0]), rounds_B=np.array([rounds]),
               round_tokens_B=np.array([round_tokens]),
               emitted_B=np.array([round_tokens if emitted is None else emitted]), accepted_BK=acc)


def batch_of(B=1, admitted=False, last_wave=False):
    return Batch(np.ones(B, bool), np.full(B, admitted), np.full(B, not admitted), last_wave)


def accepting(k_max, a, rounds=4000):
    """Acceptance with a_j = a at every position, from ``rounds`` rounds at K_max."""
    acc = Acceptance(k_max)
    acc.observe(k_max, rounds, [rounds * a ** (j + 1) for j in range(k_max)])
    return acc


def flat_costs(n, step=0.1):
    return lambda *a: Costs({k: 1.0 + step * k for k in range(n)}, {False: 0.0, True: 0.0}, 1.0)


def test_the_rate_counts_admissions_and_the_last_wave_does_not():
    """rate(K) = B·N / (B·a(K) + N·c(K)/τ(K)): a draft whose rounds pay but whose prefill is dear
    loses on short rows and wins on long ones; once nothing is admitted, the rounds decide alone."""
    costs = Costs({0: 1.0, 1: 1.5, 2: 2.0}, {False: 10.0, True: 30.0})
    acc = accepting(2, 0.8)
    short = AutoDraft(costs, 2, acc, batch_size=1, max_new_tokens=32)
    tau2 = acc.tau(2)
    assert short.rate(2) == pytest.approx(32 / (30.0 + 32 * 2.0 / tau2))
    assert short.rate(0) == pytest.approx(32 / (10.0 + 32 * 1.0))
    assert short.predicted(2) < 1.0 and short.start_k == 0
    long = AutoDraft(costs, 2, acc, batch_size=1, max_new_tokens=2048)
    assert long.predicted(2) > 1.1 and long.start_k == 2
    assert short.rate(2, last_wave=True) == pytest.approx(tau2 / 2.0)


def test_an_admission_kind_not_run_is_priced_by_the_calibrations_ratio():
    """The probe admits 16-token prompts; a job's prompts cost far more to prefill. Once the job has
    admitted without the draft only, with the draft is priced at the live level times the probe's
    ratio of the two, not at the probe's own (cheap) figure."""
    costs = Costs({0: 1.0, 1: 1.5}, {False: 0.01, True: 0.015})
    assert costs.admission(True) == pytest.approx(0.015)
    costs.observe(run_of(0, 8, 8 * 1.0 + 0.4, admitted=2, admit_seconds=0.4))   # 0.2 s a row live
    assert costs.admission(False) == pytest.approx(0.2) and costs.admission(True) == pytest.approx(0.3)
    costs.observe(run_of(1, 8, 8 * 1.5 + 0.5, admitted=2, admit_seconds=0.5))
    assert costs.admission(True) == pytest.approx(0.25)


def test_the_start_is_the_tables_k():
    """Calibrated costs and acceptance choose the first K (the table's, per batch size); a user's
    table names it instead; with nothing known about acceptance, target-only (the prior cannot
    show a gain larger than its own uncertainty)."""
    costs = lambda: Costs({0: 1.0, 1: 1.5, 2: 1.9}, {False: 0.0, True: 0.0}, source="calibrated")
    sure = AutoDraft(costs(), 2, accepting(2, 0.85), max_new_tokens=128)
    assert sure.start_k == 2 and sure.table_source == "calibrated"
    assert AutoDraft(costs(), 2, Acceptance(2), max_new_tokens=128).start_k == 0
    user = AutoDraft(costs(), 2, Acceptance(2), max_new_tokens=128, start_k=1)
    assert user.start_k == 1 and user.table_source == "user" and user.next_k(batch_of(admitted=True)) == 1


def test_a_switch_needs_evidence_larger_than_the_noise():
    """K = 1 predicts ~8 % over target-only. On forty rounds of acceptance that is within the noise:
    no switch; on a thousand it is not, and K = 1 takes over; costs whose runs scatter widely hold
    the switch back again."""
    acc = Acceptance(1)
    acc.observe(1, 40, [28])
    sure_costs = Costs({0: 1.0, 1: 1.58}, {False: 0.0, True: 0.0}, noise={0: 0.01, 1: 0.01})
    auto = AutoDraft(sure_costs, 1, acc, max_new_tokens=128)
    assert auto.rate(1) > 1.07 * auto.rate(0)
    assert auto.next_k(batch_of(admitted=True)) == 0 and auto.switches == 0
    acc.observe(1, 1000, [700])
    assert auto.next_k(batch_of(admitted=True)) == 1 and auto.switches == 1
    noisy = AutoDraft(Costs({0: 1.0, 1: 1.55}, {False: 0.0, True: 0.0}), 1, accepting(1, 0.7), max_new_tokens=128)
    for seconds in (1.0, 2.2, 1.0, 2.2):   # K = 1 runs at 1.6 s a round on average, spread wide
        noisy.costs.observe(run_of(1, 10, 10 * seconds))
    noisy.current = 0
    assert noisy.rate(1) > 1.03 * noisy.rate(0) and noisy.next_k(batch_of(admitted=True)) == 0


def test_only_measured_ks_run_and_exploration_is_bounded():
    """The model likes K = 4, which nothing measured: a short job never runs it (no program it was
    not shown to need); a long job explores it for one run, and again only once its explored
    rounds fall under EXPLORE_SHARE of the job's."""
    costs = Costs({0: 1.0, 1: 1.2, 2: 1.4}, {False: 0.0, True: 0.0})   # K = 4 on the line: 1.8
    acc = accepting(4, 0.9)
    short = AutoDraft(costs, 4, acc, max_new_tokens=autodraft.SHORT_JOB_TOKENS)
    assert short.rate(4) > short.rate(2) and short.start_k == 2
    assert {short.next_k(batch_of()) for _ in range(20)} == {2}
    long = AutoDraft(Costs(dict(costs.calibrated), {False: 0.0, True: 0.0}), 4, acc, max_new_tokens=4096)
    for _ in range(20):   # 320 rounds at K = 2
        long.next_k(batch_of())
        long.observe(run_of(2, 16, 16 * 1.4, accepted=[14, 13]))
    assert long.next_k(batch_of()) == 4 and long.exploring
    long.observe(run_of(4, 16, 16 * 3.0, accepted=[14, 13, 12, 11]))   # it ran dear: 3 s a round
    assert long.explored_rounds == 16 and long.next_k(batch_of()) == 2 and 4 in long.costs.runs
    assert not long.exploring   # measured now: it competes on evidence, and loses


def test_a_k_between_measured_ones_is_priced_and_can_start_a_short_job():
    """The probe measures the largest K too: every K below it is priced on the line through its
    measured neighbours (with a wider noise), so even a short job starts at the best of them, here
    K = 3, which nothing measured; without K = 6 measured it could only reach K = 2."""
    costs = Costs({0: 1.0, 1: 1.1, 2: 1.2, 6: 2.0}, {False: 0.0, True: 0.0})
    assert [costs.cost(k) for k in range(3, 6)] == pytest.approx([1.4, 1.6, 1.8])
    assert costs.priced(6) == list(range(7)) and costs.priced(4) == [0, 1, 2]
    assert costs.noise(4) == autodraft.INTERPOLATED_NOISE > costs.noise(2)
    auto = AutoDraft(costs, 6, accepting(6, 0.8), max_new_tokens=autodraft.SHORT_JOB_TOKENS)
    assert max(range(7), key=auto.rate) == 3 and auto.start_k == 3
    two = AutoDraft(Costs({0: 1.0, 1: 1.1, 2: 1.2}, {False: 0.0, True: 0.0}), 6, accepting(6, 0.8),
                    max_new_tokens=autodraft.SHORT_JOB_TOKENS)
    assert two.rate(6) > two.rate(2) and two.start_k == 2


def test_a_live_interpolated_k_scales_the_calibrated_ones():
    """A job that ran only K = 4 (priced on the line through 2 and 6, 2.0 s a round) and found it at
    3.0 s scales every calibrated figure by 1.5: K = 2 is not left at the probe's cheaper level."""
    costs = Costs({0: 1.0, 2: 1.5, 6: 2.5}, {False: 0.0, True: 0.0})
    costs.observe(run_of(4, 8, 8 * 3.0))
    assert costs.drift() == pytest.approx(1.5)
    assert costs.cost(2) == pytest.approx(2.25) and costs.cost(0) == pytest.approx(1.5)


def test_the_probe_measures_the_largest_k():
    """At batch 1 the probe measures the largest K too; above it (a slowest row's tail the model
    leaves out, growing with K) it stops at K = 2."""
    assert session_mod.probe_ks(6, 1) == [0, 1, 2, 6] and session_mod.probe_ks(2, 1) == [0, 1, 2]
    assert session_mod.probe_ks(1, 1) == [0, 1] and session_mod.probe_ks(6, 8) == [0, 1, 2]


def test_measured_speedup_is_a_ratio_of_measured_rates_or_absent():
    """measured_speedup: tokens per wall second of the runs at K over those at K = 0, both run in
    this process (admissions included), else absent; the model's figure is the prediction."""
    acc = accepting(1, 0.6)
    auto = AutoDraft(Costs({0: 1.0, 1: 1.5}, {False: 0.0, True: 0.0}, 2.0), 1, acc, max_new_tokens=128,
                     start_k=1)
    auto.next_k(batch_of(admitted=True))
    auto.observe(run_of(1, 10, 20.0, accepted=[6], round_tokens=16, admitted=1, admit_seconds=1.0, emitted=17))
    c = auto.report()
    assert c.num_draft_tokens == 1 and c.measured_speedup is None and c.predicted_speedup > 0
    assert c.round_seconds_per_k == {1: pytest.approx(1.9)} and c.calibration_seconds == 2.0
    auto.observe(run_of(0, 10, 12.5, round_tokens=10, admitted=1, admit_seconds=0.5, emitted=11))
    assert auto.report().measured_speedup == pytest.approx((17 / 20.0) / (11 / 12.5))
    assert auto.report().predicted_speedup != auto.report().measured_speedup
    auto.observe(run_of(1, 5, None, accepted=[3]))   # compiled: teaches acceptance, prices nothing
    assert auto.report().measured_speedup == pytest.approx((17 / 20.0) / (11 / 12.5)) and acc.offered[0] == 4015


def test_the_calibration_carries_costs_and_acceptance_to_the_next_job(tmp_path):
    """A job's costs and acceptance are written per shape and sampling setting; the next job reads
    them back (costs as measured, acceptance weighted as at most CARRIED_ROUNDS rounds)."""
    store = CalibrationStore(str(tmp_path / "pair.json"))
    acc = accepting(2, 0.8, rounds=10000)
    auto = AutoDraft(Costs({0: 1.0, 1: 1.3, 2: 1.6}, {False: 0.1, True: 0.2}), 2, acc, max_new_tokens=128)
    auto.observe(run_of(2, 16, 16 * 1.8))
    store.update("B1-greedy", "T0", auto)
    again = CalibrationStore(str(tmp_path / "pair.json"))
    costs = Costs.from_record(again.costs("B1-greedy"))
    assert costs.source == "calibrated" and costs.calibrated[2] == pytest.approx(1.8)
    drift = 1.8 / 1.6   # the live K = 2 against its calibration: every figure it did not time scales with it
    assert costs.calibrated[0] == pytest.approx(drift) and costs.calibrated[1] == pytest.approx(1.3 * drift)
    assert costs.admit_calibrated == {False: pytest.approx(0.1 * drift), True: pytest.approx(0.2 * drift)}
    carried = Acceptance(2)
    carried.carry(**again.acceptance("T0"))
    assert carried.offered[0] == autodraft.CARRIED_ROUNDS
    np.testing.assert_allclose(carried.conditional(), acc.conditional(), atol=0.01)
    assert {shape: rec["k"] for shape, rec in again.data["shapes"].items()} == {"B1-greedy": auto.current}


@pytest.fixture
def draft(tiny_target, trained_draft_dir):
    return e3.load_draft(trained_draft_dir, tiny_target)


def test_forced_switches_stay_lossless(tiny_target, draft, monkeypatch):
    """K switches between every bounded run (including K = 0 with a draft present): greedy output
    equals target-only decoding of each prompt alone."""
    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(4))
    schedule = itertools.cycle([3, 0, 1, 2, 0, 0, 3, 1])
    monkeypatch.setattr(AutoDraft, "_better", lambda self, current, last_wave: next(schedule))
    monkeypatch.setattr(AutoDraft, "_exploration", lambda self, batch: None)
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


def test_the_probe_admits_as_the_job_does(tiny_target, draft, monkeypatch):
    """An auto job's cost probe admits in the job's calls (max_admit_rows rows) at its first prompts'
    block, so that the job's admissions run programs the probe compiled, not two of the probe's own."""
    from eagle3_jax.speculative import engine as engine_mod, generate as generate_mod

    monkeypatch.setattr(session_mod, "PROBE_REPEATS", 1)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (20, 18, 17)]   # all in bucket 24
    expected = e3.Generator(tiny_target, None, max_len=40).generate(prompts, 8).tokens
    calls, real = [], generate_mod.admit_rows

    def admit_rows(*args, **kw):   # (models x 5, state, rows, ids, ...): the call's (rows, block)
        calls.append(args[7].shape)
        return real(*args, **kw)

    monkeypatch.setattr(generate_mod, "admit_rows", admit_rows)   # the probe's
    monkeypatch.setattr(engine_mod, "admit_rows", admit_rows)     # the engine's
    # the round programs of test_forced_switches_stay_lossless (batch 2, K_max 3, max_len 40)
    eng = Engine(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=3, max_len=40, batch_size=2,
                 max_new_tokens=8, max_admit_rows=1)
    done = {f.key: f.tokens for f in eng.run([Request(str(i), p) for i, p in enumerate(prompts)])}
    assert [done[str(i)] for i in range(3)] == expected
    assert eng.draft_choice.table_source == "probe"
    probe_calls = 2 * 2 * len(session_mod.probe_ks(3, 2))   # 2 calls of 1 row, (1 + PROBE_REPEATS) per K
    assert len(calls) > probe_calls and set(calls) == {(1, bucket_prompt_len(20, 40))}, calls


def test_acceptance_is_learned_only_from_rows_with_a_current_draft(tiny_target, draft, monkeypatch):
    """A prompt admitted for a target-only run and speculated later drafts from a stale state: its
    rounds emit the right tokens but teach auto nothing; a prompt admitted with the draft does."""
    monkeypatch.setattr(session_mod, "probe_costs", flat_costs(3, 0.0))
    asked = []

    def next_k(self, batch):   # target-only for the first run, K = 2 after
        asked.append(batch.can_draft)
        self.next = 0 if len(asked) == 1 else 2
        return self.next

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
    acc = eng.policy.acceptance
    assert acc.offered[0] == fresh.rounds and acc.accepted.tolist() == fresh.accepted_per_position
    assert fresh.mean_accept_length > 1.5 and asked[0] is True


def test_acceptance_is_learned_per_sampling_setting(tiny_target, draft, monkeypatch):
    """Greedy and sampled decoding accept very differently: a session learns acceptance per sampling
    setting (shared across batch sizes) and round costs per batch shape and greedy-or-sampled."""
    probed = []

    def probe(session, program, sp, ks, admission):
        probed.append(program.batch_size)
        return Costs({k: 1.0 for k in ks})

    monkeypatch.setattr(session_mod, "probe_costs", probe)
    session = session_mod.DecodeSession(tiny_target, draft, "auto", max_len=40, max_draft_tokens=2)
    greedy, hot = SamplingSettings(0.0), SamplingSettings(1.0)
    p1, p2 = session.program(1), session.program(2)
    a_greedy = session.policy(p1, greedy, 8)
    a_greedy.observe(run_of(2, 10, 1.0, 10, 30, [10, 10]))          # greedy: every draft token accepted
    a_hot = session.policy(p1, hot, 8)
    assert a_hot.acceptance is not a_greedy.acceptance and a_hot.acceptance.offered.sum() == 0
    assert session.policy(p2, hot, 8).acceptance is a_hot.acceptance
    again = session.policy(p1, greedy, 8)   # a new job on the same shape: what was learned stays
    assert again.acceptance is a_greedy.acceptance and again.costs is a_greedy.costs
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
    assert log.count == before + 1 and log.since(before).seconds > 0
    f(x).block_until_ready()
    assert log.count == before + 1
    gen = e3.Generator(tiny_target, None, max_len=24)
    prompts = [[5, 6, 7], [8, 9]]
    gen.generate(prompts, 4)
    first = gen.last_compiled_programs
    gen.generate(prompts, 4)
    assert first > 0 and gen.last_compile_seconds == 0.0 and gen.last_compiled_programs == 0
    assert gen.session.compiled_programs == first


def prompt_buckets(max_len: int) -> list[int]:
    """Every padded prompt length a session of this capacity can use."""
    out, bucket = [], PROMPT_BUCKET
    while bucket < max_len - 1:
        out.append(bucket)
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return out + [max_len - 1]


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
    assert choice["calibration_seconds"] == 1.0 and choice["table_source"] == "probe"
    # measured: tokens per wall second at the last K over those at K = 0, both run in this job, or absent
    spec, plain = (choice["iterations_per_k"].get(str(k)) for k in (choice["num_draft_tokens"], 0))
    if choice["measured_speedup"] is not None:
        assert choice["num_draft_tokens"] > 0 and spec and plain and choice["measured_speedup"] > 0
    assert "speculation" in json.loads(metrics.read_text())


def test_admitting_without_the_draft(tiny_target, draft):
    """admit_rows without the draft's models prefills the target exactly as a drafted admission
    does, leaves every row's draft state as it was, and does less work (no aux states, no draft pass)."""
    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds

    session = session_mod.DecodeSession(tiny_target, draft, "auto", 40, max_draft_tokens=2)
    program = session.program(2)
    sp = SamplingSettings().traced(8)
    models = session.models()
    rng = np.random.default_rng(6)
    ids = jnp.asarray(rng.integers(2, 256, size=(1, 16)), jnp.int32)
    lengths = jnp.asarray([11], jnp.int32)
    with session.activate():
        state = blank_state(*models, jax.random.key(0), sp, program=program)
        state = admit_rows(*models, state, jnp.asarray([0], jnp.int32), ids, lengths, sp, program=program)
        state = run_rounds(*models, state, jnp.int32(2), jnp.int32(3), sp, program=program)
        rest = (jnp.asarray([1], jnp.int32), ids, lengths, sp)
        without = session_mod.target_only(models)
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


def test_a_second_identical_serve_run_compiles_nothing_new(tiny_target, draft, trained_draft_dir, tiny_target_dir,
                                                           tmp_path, monkeypatch):
    """serve.py under auto keeps what it measured beside the compile cache: a second identical run
    starts from it (no probe) and runs only programs the first one compiled, as its metrics say."""
    from eagle3_jax import compile_cache
    from tests.serve_fixtures import ModelCache, byte_target_dir, prompt_rows, serve, write_jsonl

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the suite's persistent compilation cache is off (EAGLE3_TEST_XLA_CACHE=off)")
    monkeypatch.setattr(session_mod, "PROBE_REPEATS", 1)
    monkeypatch.setattr(compile_cache, "calibration_dir", lambda: str(tmp_path / "autodraft"))
    target_dir = byte_target_dir(tiny_target_dir, tmp_path / "target")
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows()[:6])
    models = ModelCache(tiny_target, {str(trained_draft_dir): draft})
    min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    runs = []
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)   # as compile_cache.enable() sets it
        for i in range(2):
            jax.clear_caches()   # a new process: nothing compiled in memory
            metrics = tmp_path / f"metrics{i}.json"
            assert serve(models, target_dir, inp, tmp_path / f"out{i}.jsonl", trained_draft_dir, metrics=metrics,
                         num_draft_tokens="auto", batch_size=2) == 0
            runs.append(json.loads(metrics.read_text()))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    first, second = runs
    assert first["auto_draft"]["table_source"] == "probe" and first["auto_draft"]["calibration_seconds"] > 0
    assert second["auto_draft"]["table_source"] == "calibrated" and second["auto_draft"]["calibration_seconds"] == 0
    assert first["compiles"]["compiled"] + first["compiles"]["from_cache"] > 0
    assert second["compiles"]["compiled"] == 0 and second["compiles"]["from_cache"] > 0, second["compiles"]
    # the first run compiled these for its probe
    probed = {str(k) for k in session_mod.probe_ks(autodraft.DEFAULT_MAX_DRAFT_TOKENS, 2)}
    assert set(second["auto_draft"]["iterations_per_k"]) <= set(first["auto_draft"]["iterations_per_k"]) | probed


def test_a_draft_that_costs_time_is_reported_with_what_to_do():
    """τ near 1 at a fixed K, or auto measuring its K slower than target-only: the progress line,
    the summary and the metrics say so and name the remedies; a healthy draft gets no word, and
    auto falling back to target-only is said without alarm."""
    from eagle3_jax.metrics import GenerationStats
    from eagle3_jax.serve.report import RunStats, metrics_dict, speculation_verdict, summary_table

    def run(k, rounds, round_tokens, pair=("tgt", "drf")):
        stats = RunStats(k, pair=pair)
        stats.add("length", GenerationStats(rounds=rounds, tokens=round_tokens, round_tokens=round_tokens,
                                            seconds=0.0, accepted_per_position=[0] * k))
        return stats

    slow = run(4, 100, 119)   # tau 1.19 (a 20-step draft, as a newcomer served it)
    v = speculation_verdict(slow)
    assert v["costs_time"] and "tau 1.19" in v["reason"]
    assert "--num-draft-tokens 0" in v["advice"] and "python -m tools.doctor --target tgt --draft drf" in v["advice"]
    assert "SLOWER than target-only" in slow.postfix() and "speculation is costing time" in summary_table(slow, 0, 0)
    assert metrics_dict(slow, 0, 0, {})["speculation"] == v
    healthy = run(4, 100, 250)
    assert speculation_verdict(healthy) == {"costs_time": False, "reason": None, "advice": None}
    assert "SLOWER" not in healthy.postfix() and "speculation" not in summary_table(healthy, 0, 0)
    assert speculation_verdict(run(0, 100, 100)) is None and speculation_verdict(run(4, 10, 10)) is None
    auto = run(6, 100, 200)
    auto.draft_choice = autodraft.DraftChoice(num_draft_tokens=2, start_k=2, table_source="calibrated",
                                              predicted_speedup=1.1, measured_speedup=0.85, tau=2.0,
                                              rounds_per_k={0: 10, 2: 40})
    assert speculation_verdict(auto)["costs_time"] and "measured 0.85x" in speculation_verdict(auto)["reason"]
    assert "SLOWER" in auto.postfix() and "measured 0.85x" in auto.postfix()
    auto.draft_choice = autodraft.DraftChoice(num_draft_tokens=0, start_k=0, table_source="probe",
                                              predicted_speedup=1.0, measured_speedup=None, tau=1.0,
                                              rounds_per_k={0: 100, 2: 16})
    fallback = speculation_verdict(auto)
    assert not fallback["costs_time"] and "does not pay" in fallback["reason"] and "SLOWER" not in auto.postfix()


def test_the_k_table_setting():
    from eagle3_jax.errors import SettingsError
    from eagle3_jax.serve import cli

    from eagle3_jax.serve.settings import parse_k_table

    assert parse_k_table(cli.settings_from_argv(["--k-table", "1:0,8:2"]).k_table) == {1: 0, 8: 2}
    assert cli.settings_from_argv([]).k_table is None
    for bad in ("8", "1:0:2", "0:1", "1:-1", "one:two"):
        with pytest.raises(SettingsError, match="k_table: expected batch:K pairs"):
            cli.settings_from_argv(["--k-table", bad])
