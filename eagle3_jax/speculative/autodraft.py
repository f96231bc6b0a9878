"""``num_draft_tokens="auto"``: the K of each bounded run, from round costs timed in this process
and acceptance learned from the rows' own rounds.

The model. A round with K draft tokens costs c(K) seconds and emits τ(K) tokens per row, so it
decodes τ(K) / c(K) tokens per second per row; K = 0 is target-only, τ(0) = 1. Before every run
the chooser takes the K that maximizes that rate with acceptance at its upper confidence bound
(``AutoDraft.choose``): a K is tried while the data still allow it to pay, and dropped once they
show that it does not. No other exploration exists.

τ(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j, with a_j the probability that draft position j is accepted given
that position j-1 was (``Acceptance``).

c(K) (``RoundCosts``) is seconds per round of this program (batch size, capacity, greedy or
sampled) timed in this process: by a K's own latest runs; else, for a K once timed beside live
target-only rounds, by its ratio to c(0) then; else by a start-up probe (``session.probe_costs``:
K = 0, 1 and K_max on a scratch state, the Ks between on the line through 1 and K_max) scaled by
how the Ks that ran compare with their probe. Nothing is cached on disk: a
cost taken under another load, capacity or prompt length would price this run wrongly.

Target-only's cost is re-timed live: a probe on a shared machine can misjudge c(K) / c(0) by half
(predicted 1.13x, ran 0.79x). When a K >= 1 choice predicts less than 1 + RETIME_BELOW and c(0) was
last timed more than RETIME_AFTER runs ago, the next run whose rows are all just admitted runs
target-only (no row loses its draft state by it), unless that is the last wave: its rows would
then stay target-only to the end.

The last wave. Once no prompt waits, the batch runs until its slowest row is done while rows that
finished sit idle: the rate is then Σ R_b / (n · max_b R_b / τ_b(K)) per running row, with R_b what
row b has left to emit and τ_b its own acceptance (``Wave``); in a wave of two rows or more, a row
without counts yet borrows those of a recently finished row, since how far the slowest row lags is
only known from rows. The mean alone ran K = 5-6 at batch 8 on 8 prompts (one wave) predicting 1.8x and got 1.1x, where
K = 2 gave 1.3x: the slowest row (τ 2.7 at K = 6, 2.2 at K = 2) set the wave's length.

A "measured" speedup divides target-only's live round cost by K's, both from runs in this process;
anything resting on the probe is only "predicted".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from eagle3_jax.speculative.policy import Batch, Run

AUTO = "auto"
DEFAULT_MAX_DRAFT_TOKENS = 6
# Prior of a_1, worth PRIOR_ROUNDS rounds: weak, so that a few runs of data override it. A deeper
# position's prior is the estimate of the one before it: positions past the Ks that ran are priced
# as the nearest data say (a fixed 0.7 there held K = 3 where K = 6 ran 14 % faster, demo pair).
PRIOR_ACCEPT = 0.7
PRIOR_ROUNDS = 8
# Upper confidence bound: each a_j this many standard errors above its estimate.
UCB_Z = 1.0
# Speculation must beat target-only's rate by this much: what the model leaves out (the draft's
# share of admissions) is small but not zero.
MARGIN = 0.03
# Live costs: each K's latest LIVE_RUNS timed runs, none older than LIVE_AGE runs of any K; runs
# shorter than MIN_TIMED_ROUNDS rounds are not timed (fixed costs would dominate).
LIVE_RUNS = 8
LIVE_AGE = 64
MIN_TIMED_ROUNDS = 4
# Re-timing target-only (module docstring): below a predicted 1 + RETIME_BELOW, after RETIME_AFTER runs.
RETIME_BELOW = 0.5
RETIME_AFTER = 32
PAST_ROWS = 64   # finished rows whose acceptance stands in for a new wave's rows


@dataclass
class Acceptance:
    """Per-position conditional acceptance a_j from counts, with a prior and an upper bound."""

    max_draft_tokens: int
    accepted: np.ndarray = None   # [K_max] rounds in which position j was accepted
    offered: np.ndarray = None    # [K_max] rounds in which position j was drafted and j-1 accepted

    def __post_init__(self):
        self.accepted = np.zeros(self.max_draft_tokens)
        self.offered = np.zeros(self.max_draft_tokens)

    def observe(self, k: int, rounds: int, accepted_per_position) -> None:
        """``rounds`` rounds at ``k``; ``accepted_per_position[j]``: rounds that accepted position j
        (and so every position before it)."""
        if k == 0 or rounds == 0:
            return
        acc = np.asarray(accepted_per_position[:k], float)
        self.accepted[:k] += acc
        self.offered[:k] += np.concatenate([[rounds], acc[:-1]])

    def conditional(self, z: float = 0.0) -> np.ndarray:
        """a_j, or with ``z`` its estimate plus z standard errors (prior rounds counted as data)."""
        out, prior = np.empty(self.max_draft_tokens), PRIOR_ACCEPT
        for j in range(self.max_draft_tokens):
            n = self.offered[j] + PRIOR_ROUNDS
            prior = (self.accepted[j] + prior * PRIOR_ROUNDS) / n
            out[j] = min(prior + z * np.sqrt(prior * (1.0 - prior) / n), 1.0)
        return out

    def tau(self, k: int, z: float = 0.0) -> float:
        return 1.0 + float(np.cumprod(self.conditional(z)[:k]).sum())


@dataclass
class Wave:
    """The running rows of the last wave, each with its own acceptance since admission."""

    remaining_B: np.ndarray    # tokens each row has left to emit
    accepted_BK: np.ndarray    # rounds in which the row's draft position j was accepted
    offered_BK: np.ndarray     # rounds in which it drafted position j with j-1 accepted

    def tau(self, k: int, pooled: np.ndarray) -> float:
        """Tokens per row per iteration at K over the rest of the wave. A row's a_j: its own counts
        with a prior worth PRIOR_ROUNDS rounds, the pooled a_j scaled by how the row's a_{j-1}
        compares with the pool's (a row that accepts little early is not priced as the pool deeper)."""
        R_B = np.maximum(self.remaining_B.astype(float), 1.0)
        a_BK, scale_B = np.zeros((len(R_B), k)), np.ones(len(R_B))
        for j in range(k):
            prior_B = np.minimum(pooled[j] * scale_B, 1.0)
            a_BK[:, j] = (self.accepted_BK[:, j] + prior_B * PRIOR_ROUNDS) / (self.offered_BK[:, j] + PRIOR_ROUNDS)
            scale_B = a_BK[:, j] / pooled[j]
        tau_B = 1.0 + np.cumprod(a_BK, axis=1).sum(axis=1)
        return float(R_B.sum() / (len(R_B) * np.max(R_B / tau_B)))


class RoundCosts:
    """Seconds per round for each K in 0..max_draft_tokens of one program, timed in this process."""

    def __init__(self, probe: dict[int, float], probe_seconds: float = 0.0):
        self.probe = dict(probe)            # K -> seconds per round, from the start-up probe
        self.probe_seconds = probe_seconds  # its wall time, compiles included
        self.runs: dict[int, deque] = {}   # K -> (run number, seconds, rounds) of its latest timed runs
        self.clock = 0                     # runs observed, timed or not
        self.ratio: dict[int, float] = {}  # K >= 1 -> c(K) / c(0) at K's latest timed run, c(0) live

    def observe(self, k: int, seconds: float, rounds: int) -> None:
        self.clock += 1
        if rounds >= MIN_TIMED_ROUNDS and seconds > 0:
            self.runs.setdefault(k, deque(maxlen=LIVE_RUNS)).append((self.clock, seconds, rounds))
            if k and (c0 := self.live(0)):   # taken as K runs: later c(0)s are another load's
                self.ratio[k] = self.live(k) / c0

    def live(self, k: int) -> float | None:
        mine = [(s, r) for t, s, r in self.runs.get(k, ()) if self.clock - t < LIVE_AGE]
        return sum(s for s, _ in mine) / sum(r for _, r in mine) if mine else None

    def age(self, k: int) -> float:
        """Runs since K's latest timed run (inf: none)."""
        runs = self.runs.get(k)
        return self.clock - runs[-1][0] if runs else float("inf")

    def base(self, k: int) -> float:
        """The probe's cost, Ks it did not time on the line through the Ks >= 1 it did."""
        if k in self.probe:
            return self.probe[k]
        pts = sorted((j, c) for j, c in self.probe.items() if j >= 1)
        if len(pts) < 2:
            return pts[0][1] if pts else self.probe[0]
        (k1, c1), (k2, c2) = pts[0], pts[-1]
        return c1 + (c2 - c1) * (k - k1) / (k2 - k1)

    def drift(self) -> float:
        ratios = [c / self.base(k) for k in self.runs if (c := self.live(k))]
        return float(np.median(ratios)) if ratios else 1.0

    def cost(self, k: int) -> float:
        """As the module docstring orders it. A ratio outlasts a change of load; the probe's ratio
        can be off by a fifth, and a K whose own runs aged out was re-explored on it (batch 1, T = 1)."""
        live = self.live(k)
        if live is not None:
            return live
        if k in self.ratio:
            return self.ratio[k] * self.cost(0)
        return self.base(k) * self.drift()


@dataclass
class DraftChoice:
    """What the K policy decided and how it went: for metrics and progress lines."""

    num_draft_tokens: int               # the K of the latest run
    predicted_speedup: float            # τ(K) · c(0) / c(K) with the model's current costs
    measured_speedup: float             # the same from both Ks' live runs in this process, else nan
    tau: float                          # τ(K) at the point estimate
    rounds_per_k: dict[int, int] = field(default_factory=dict)   # loop iterations run with each K
    compiled_programs: int = 0          # round programs the probe ran (compiled, or found compiled)
    calibration_seconds: float = 0.0    # the probe's wall time
    round_seconds_per_k: dict[int, float] = field(default_factory=dict)   # live seconds per round
    target_round_seconds: float = float("nan")   # c(0) as priced now


class AutoDraft:
    """The policy of ``num_draft_tokens="auto"`` for one program and sampling setting."""

    def __init__(self, costs: RoundCosts, max_draft_tokens: int, acceptance: Acceptance):
        self.costs = costs
        self.acceptance = acceptance
        self.max_draft_tokens = max_draft_tokens
        self.rounds_per_k: dict[int, int] = {}
        self.runs = 0
        self.last_k = self.choose()
        self.past_rows: deque = deque(maxlen=PAST_ROWS)   # (accepted_K, offered_K) of rows that finished
        # Each row's own acceptance since its admission (the last wave's pricing, ``Wave``).
        self.row_accepted_BK = np.zeros((0, max_draft_tokens), np.int64)
        self.row_offered_BK = np.zeros((0, max_draft_tokens), np.int64)
        self.next = self.last_k

    def _rows(self, B: int) -> None:
        if len(self.row_accepted_BK) != B:
            self.row_accepted_BK = np.zeros((B, self.max_draft_tokens), np.int64)
            self.row_offered_BK = np.zeros((B, self.max_draft_tokens), np.int64)

    def _with_past(self, wave: Wave | None) -> Wave | None:
        """A row of the wave without counts of its own yet borrows those of a recent finished row:
        how unlike each other rows are (and so how slow the slowest is) is known only from rows. A
        wave of one row has no slowest row to find: another row's counts would only add that row's
        luck (batch 1, T = 1: one lucky borrowed row ran K = 2 at 0.87x where target-only was best)."""
        if wave is None or not self.past_rows or len(wave.remaining_B) < 2:
            return wave
        acc, off, past = wave.accepted_BK.copy(), wave.offered_BK.copy(), list(self.past_rows)[::-1]
        for i, b in enumerate(np.flatnonzero(off[:, 0] == 0)):
            acc[b], off[b] = past[i % len(past)]
        return Wave(wave.remaining_B, acc, off)

    def rate(self, k: int, z: float = 0.0, wave: Wave | None = None) -> float:
        """Tokens per second per row at K (acceptance ``z`` standard errors above its estimate);
        in the last ``wave``, per row still running, until its slowest row is done."""
        tau = wave.tau(k, self.acceptance.conditional(z)) if wave is not None else self.acceptance.tau(k, z)
        return tau / self.costs.cost(k)

    def choose(self, wave: Wave | None = None) -> int:
        """The K >= 1 of the highest optimistic rate (ties to the smaller K) if it beats
        target-only by MARGIN, else 0."""
        if self.max_draft_tokens == 0:
            return 0
        best = max(range(1, self.max_draft_tokens + 1), key=lambda k: (self.rate(k, UCB_Z, wave), -k))
        return best if self.rate(best, UCB_Z, wave) >= (1.0 + MARGIN) * self.rate(0, 0.0, wave) else 0

    def next_k(self, batch: Batch) -> int:
        """The K of the next run: target-only while no row could draft from a current state; a
        doubtful choice re-times c(0) when every row is just admitted (no draft state is lost);
        in the last wave, priced by its rows (``Wave``)."""
        self._rows(len(batch.running_B))
        self.row_accepted_BK[batch.admitted_B] = 0
        self.row_offered_BK[batch.admitted_B] = 0
        run = batch.running_B
        wave = (Wave(batch.remaining_B[run], self.row_accepted_BK[run], self.row_offered_BK[run])
                if batch.last_wave else None)
        all_new = bool(batch.admitted_B.any()) and int(run.sum()) == int(batch.admitted_B.sum())
        self.next = self.choose_next(batch.can_draft, all_new, wave)
        return self.next

    def settled(self, batch: Batch) -> bool:
        """Target-only in the last wave stays target-only: no row keeps a current draft state."""
        return self.next == 0

    def choose_next(self, drafted_rows: bool = True, all_new: bool = False, wave: Wave | None = None) -> int:
        """``drafted_rows``: some row could draft from a current state; ``all_new``: every row is
        just admitted; ``wave``: the last wave."""
        self.runs += 1
        if not drafted_rows:
            return 0
        k = self.choose(self._with_past(wave))
        # not in the last wave: its rows would then stay target-only to the end (no draft state)
        if k and all_new and wave is None and self.costs.age(0) > RETIME_AFTER and self.predicted(k) < 1.0 + RETIME_BELOW:
            return 0
        return k

    def predicted(self, k: int) -> float:
        """τ(K) · c(0) / c(K) with the model's current costs and acceptance at its estimate."""
        return self.acceptance.tau(k) * self.costs.cost(0) / self.costs.cost(k)

    def observe(self, run: Run) -> None:
        """One bounded run: its iterations and seconds price K (a run that compiled prices
        nothing); the rows whose draft state was current teach acceptance, pooled and per row."""
        k, taught = run.k, run.taught_B
        self._rows(len(taught))
        self.last_k = k
        self.rounds_per_k[k] = self.rounds_per_k.get(k, 0) + run.iterations
        self.acceptance.observe(k, int(run.rounds_B[taught].sum()), run.accepted_BK[taught].sum(0))
        self.costs.observe(k, run.seconds or 0.0, run.iterations)
        if k:   # position j was offered in the rounds that accepted j-1 (j = 0: every round)
            acc_BK = np.where(taught[:, None], run.accepted_BK, 0)[:, :k]
            self.row_accepted_BK[:, :k] += acc_BK
            self.row_offered_BK[:, :k] += np.concatenate([np.where(taught, run.rounds_B, 0)[:, None],
                                                          acc_BK[:, :-1]], axis=1)
        done = run.finished_B
        self.past_rows.extend((a, o) for a, o in zip(self.row_accepted_BK[done], self.row_offered_BK[done])
                              if o[0] > 0)

    def report(self) -> DraftChoice:
        k, costs = self.last_k, self.costs
        tau = self.acceptance.tau(k)
        plain, live_k = costs.live(0), costs.live(k)
        measured = 1.0 if k == 0 else tau * plain / live_k if (live_k and plain) else float("nan")
        return DraftChoice(
            num_draft_tokens=k, predicted_speedup=self.predicted(k), measured_speedup=measured,
            tau=tau, rounds_per_k=dict(self.rounds_per_k), compiled_programs=len(costs.probe) if costs.probe_seconds else 0,
            calibration_seconds=costs.probe_seconds, target_round_seconds=costs.cost(0),
            round_seconds_per_k={j: c for j in range(self.max_draft_tokens + 1) if (c := costs.live(j)) is not None})
