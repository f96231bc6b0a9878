"""``num_draft_tokens="auto"``: the K of each bounded run, priced end to end.

With B rows each emitting N tokens, a K costs per row its admission a(K) (the target's prefill, and
the draft's with it when K >= 1) and N / τ(K) rounds of c(K) seconds each, shared by the batch:

    rate(K) = B·N / (B·a(K) + N·c(K) / τ(K))       tokens per wall second,

K = 0 being target-only (τ(0) = 1). In the last wave nothing is admitted and rate(K) = τ(K) / c(K).
a(K) and c(K) are wall times of the engine's runs (``policy.Run``), host work included, so a K that
loses in wall time cannot look like a win. τ(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j, with a_j the acceptance
of draft position j given position j-1's (``Acceptance``), learned from rows with a current draft state.

``Costs`` starts from what an earlier job of this pair measured on this machine
(``calibration.CalibrationStore``), else from a short probe (``session.probe_costs``); the first K
is the one they choose, or the user's ``k_table`` entry. Before every run the best K is compared
with the current one and takes over only if its predicted gain exceeds MARGIN plus SWITCH_Z
standard errors. The Ks compared are those up to the largest measured one (at batch 1 the probe
measures the largest K too, ``session.probe_ks``): a K between measured ones is priced on the line
through its measured neighbours, none beyond them, so a job compiles a K only when it chooses it,
and never one the model had to guess from outside what was measured, apart from bounded
exploration (see the constants).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from eagle3_jax.speculative.policy import Batch, Run

AUTO = "auto"
DEFAULT_MAX_DRAFT_TOKENS = 6
# Prior of a_1, worth PRIOR_ROUNDS rounds so that a few runs override it; a deeper position's prior
# is the estimate of the one before it.
PRIOR_ACCEPT = 0.7
PRIOR_ROUNDS = 8
# Acceptance carried over from earlier jobs counts as at most this many rounds.
CARRIED_ROUNDS = 256
# A switch: the predicted gain must exceed MARGIN (what the model leaves out) plus SWITCH_Z standard errors.
MARGIN = 0.03
SWITCH_Z = 1.5
# Relative standard error of a cost timed fewer than twice with no calibrated spread, and of one
# interpolated between measured Ks (a round's cost is close to linear in K, not exactly).
COST_NOISE = 0.03
INTERPOLATED_NOISE = 0.06
# Exploration: while acceptance rests on fewer than BOOTSTRAP_ROUNDS rounds, one run at the largest
# measured K (it teaches the most positions); beyond that, only in jobs whose rows may emit more than
# SHORT_JOB_TOKENS, a K that wins with acceptance SWITCH_Z errors up may run once, while explored
# rounds stay under EXPLORE_SHARE of all rounds.
BOOTSTRAP_ROUNDS = 32
SHORT_JOB_TOKENS = 256
EXPLORE_SHARE = 0.05
# Live costs: each K's latest LIVE_RUNS timed runs; runs shorter than MIN_TIMED_ROUNDS are not timed.
LIVE_RUNS = 8
MIN_TIMED_ROUNDS = 4
UPDATE_SECONDS = 30.0


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

    def carry(self, accepted, offered) -> None:
        """Counts from earlier jobs, scaled down to at most CARRIED_ROUNDS rounds."""
        offered = np.asarray(offered, float)[:self.max_draft_tokens]
        scale = min(1.0, CARRIED_ROUNDS / offered[0]) if len(offered) and offered[0] > 0 else 0.0
        self.accepted[:len(offered)] += scale * np.asarray(accepted, float)[:len(offered)]
        self.offered[:len(offered)] += scale * offered

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


class Costs:
    """Seconds per round c(K) and per admitted row a(K) of one program: calibrated, then live.

    ``calibrated``: K -> c(K) of the Ks a calibration measured; ``admit``: a(K) with and without
    the draft (keys True / False). A K the calibration did not measure is priced on the line
    through its nearest measured Ks >= 1. Live runs replace a calibrated figure K by K, and scale the
    others by how the live ones compare with theirs (the machine's load drifts)."""

    def __init__(self, calibrated: dict[int, float], admit: dict[bool, float] | None = None,
                 calibration_seconds: float = 0.0, source: str = "probe", noise: dict[int, float] | None = None):
        self.calibrated = {int(k): float(c) for k, c in calibrated.items()}
        self.calibrated_noise = {int(k): float(n) for k, n in (noise or {}).items()}   # relative standard errors
        self.admit_calibrated = dict(admit or {})
        self.calibration_seconds = calibration_seconds
        self.source = source
        self.runs: dict[int, deque] = {}        # K -> (seconds, rounds) of its latest timed runs
        self.admissions: dict[bool, list] = {}  # drafted -> [seconds, rows] summed over this job
        self.emitted: dict[int, list] = {}      # K -> [tokens, seconds] of its timed runs, end to end

    @classmethod
    def from_record(cls, record: dict) -> "Costs":
        """From a calibration record (``calibration.CalibrationStore``; ``to_record``'s form)."""
        return cls({int(k): c for k, c in record["round_seconds"].items()},
                   {bool(int(d)): a for d, a in record.get("admit_seconds", {}).items()}, source="calibrated",
                   noise={int(k): n for k, n in record.get("noise", {}).items()})

    def observe(self, run: Run) -> None:
        if run.seconds is None:
            return
        loop = run.seconds - run.admit_seconds
        if run.iterations >= MIN_TIMED_ROUNDS and loop > 0:
            self.runs.setdefault(run.k, deque(maxlen=LIVE_RUNS)).append((loop, run.iterations))
        if run.admitted:
            total = self.admissions.setdefault(run.k > 0, [0.0, 0])
            total[0] += run.admit_seconds
            total[1] += run.admitted
        total = self.emitted.setdefault(run.k, [0, 0.0])
        total[0] += run.emitted
        total[1] += run.seconds

    def live(self, k: int) -> float | None:
        mine = self.runs.get(k)
        return sum(s for s, _ in mine) / sum(r for _, r in mine) if mine else None

    def measured(self) -> set[int]:
        """The Ks with a cost of their own (calibrated or run)."""
        return set(self.calibrated) | set(self.runs)

    def priced(self, max_draft_tokens: int) -> list[int]:
        """The Ks a choice compares: 0 up to the largest measured K (at most ``max_draft_tokens``);
        the unmeasured ones among them lie between measured ones."""
        return list(range(max((k for k in self.measured() if k <= max_draft_tokens), default=0) + 1))

    def _line(self, k: int) -> float:
        """c(K) on the line through the calibrated Ks >= 1 nearest to K on either side."""
        pts = sorted((j, c) for j, c in self.calibrated.items() if j >= 1)
        if not pts:
            return self.calibrated[0] * (1.0 + k)   # nothing known: a draft token as dear as a target step
        if len(pts) < 2:
            return pts[0][1] * (1.0 + k) / (1.0 + pts[0][0])
        i = min(max(np.searchsorted([j for j, _ in pts], k), 1), len(pts) - 1)
        (k1, c1), (k2, c2) = pts[i - 1], pts[i]
        return c1 + (c2 - c1) * (k - k1) / (k2 - k1)

    def drift(self) -> float:
        """How the live costs compare with what the calibration priced them at (measured or on its
        line): a job that ran only an interpolated K must still scale the calibrated figures of the
        others, or it would weigh its live cost against a probe's cheaper one."""
        ratios = [live / self._base(k) for k in self.runs if (live := self.live(k))]
        return float(np.median(ratios)) if ratios else 1.0

    def _base(self, k: int) -> float:
        return self.calibrated[k] if k in self.calibrated else self._line(k)

    def cost(self, k: int) -> float:
        live = self.live(k)
        return live if live is not None else self._base(k) * self.drift()

    def admission(self, drafted: bool) -> float:
        """Seconds per admitted row, with the draft's prefill or without. A kind not admitted in this
        job is priced from the kind that was, by the calibration's ratio between the two: the
        prompts of a job set the level (the calibration was measured at some earlier job's prompt
        block), the calibration only the draft's share."""
        own, other = (self._admitted(d) for d in (drafted, not drafted))
        if own is not None:
            return own
        cal, cal_other = self.admit_calibrated.get(drafted), self.admit_calibrated.get(not drafted)
        if other is not None and cal and cal_other:
            return other * cal / cal_other
        return (cal or 0.0) * self.drift()

    def _admitted(self, drafted: bool) -> float | None:
        seconds, rows = self.admissions.get(drafted, (0.0, 0))
        return seconds / rows if rows else None

    def noise(self, k: int) -> float:
        """Relative standard error of c(K): from the spread of its timed runs, else the calibration's."""
        runs = self.runs.get(k, ())
        if not runs and k not in self.calibrated:
            return INTERPOLATED_NOISE
        if len(runs) < 2:
            return self.calibrated_noise.get(k, COST_NOISE) if not runs else COST_NOISE
        per_round = np.array([s / r for s, r in runs])
        return float(per_round.std(ddof=1) / per_round.mean() / np.sqrt(len(per_round)))

    def rate(self, k: int) -> float | None:
        """Tokens per wall second of the timed runs at K, end to end (None: none ran)."""
        tokens, seconds = self.emitted.get(k, (0, 0.0))
        return tokens / seconds if seconds > 0 and tokens > 0 else None

    def to_record(self) -> dict:
        """What a later job starts from: each K's cost as measured now."""
        ks = sorted(self.measured())
        return {"round_seconds": {str(k): self.cost(k) for k in ks}, "noise": {str(k): self.noise(k) for k in ks},
                "admit_seconds": {str(int(d)): self.admission(d) for d in (False, True)
                                  if d in self.admissions or d in self.admit_calibrated}}


@dataclass
class DraftChoice:
    """What the K policy decided and how it went: for metrics and progress lines."""

    num_draft_tokens: int               # the K of the latest run
    start_k: int                        # the table's K this job started from
    table_source: str                   # where that came from: "user", "calibrated", "probe"
    predicted_speedup: float            # rate(K) / rate(0) by the model, at the point estimates
    measured_speedup: float | None      # tokens per wall second at K over those at K = 0, both run here
    tau: float                          # τ(K) at the point estimate
    rounds_per_k: dict[int, int] = field(default_factory=dict)   # loop iterations run with each K
    explored_rounds: int = 0            # of which exploration
    switches: int = 0
    calibration_seconds: float = 0.0    # the probe's wall time in this process (0: calibrated before)
    round_seconds_per_k: dict[int, float] = field(default_factory=dict)   # live seconds per round
    target_round_seconds: float = float("nan")   # c(0) as priced now


class AutoDraft:
    """The policy of ``num_draft_tokens="auto"`` for one program and sampling setting."""

    def __init__(self, costs: Costs, max_draft_tokens: int, acceptance: Acceptance, batch_size: int = 1,
                 max_new_tokens: int = 256, start_k: int | None = None, on_update=None):
        """``start_k``: the user's table entry for this batch size (None: the calibration's choice);
        ``on_update(policy)``: called to keep what it learned (the calibration store)."""
        self.costs = costs
        self.acceptance = acceptance
        self.max_draft_tokens = max_draft_tokens
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.on_update = on_update
        self.rounds_per_k: dict[int, int] = {}
        self.explored_rounds = 0
        self.last_iterations = 0
        self.switches = 0
        self.table_source = "user" if start_k is not None else costs.source
        self.start_k = self.current = (min(max(start_k, 0), max_draft_tokens) if start_k is not None
                                       else self._better(0, last_wave=False))
        self.next = self.current
        self.exploring = False
        self.updated = time.perf_counter()

    # ------------------------------------------------------------------ the model
    def rate(self, k: int, z: float = 0.0, last_wave: bool = False) -> float:
        """Tokens per wall second at K with acceptance ``z`` standard errors above its estimate."""
        tau = self.acceptance.tau(k, z) if k else 1.0
        c = self.costs.cost(k)
        if last_wave:
            return tau / c
        B, N = self.batch_size, self.max_new_tokens
        return B * N / (B * self.costs.admission(k > 0) + N * c / tau)

    def noise(self, k: int, j: int) -> float:
        """Standard error of log(rate(K) / rate(J)): acceptance's and both costs'."""
        def tau_se(k):
            return (self.acceptance.tau(k, 1.0) - self.acceptance.tau(k)) / self.acceptance.tau(k) if k else 0.0
        return math.sqrt(tau_se(k) ** 2 + tau_se(j) ** 2 + self.costs.noise(k) ** 2 + self.costs.noise(j) ** 2)

    def _better(self, current: int, last_wave: bool) -> int:
        """The priced K of the best rate, if its gain over ``current`` is larger than the noise."""
        ks = self.costs.priced(self.max_draft_tokens)
        best = max(ks, key=lambda k: (self.rate(k, 0.0, last_wave), -k))
        gain = math.log(self.rate(best, 0.0, last_wave) / self.rate(current, 0.0, last_wave))
        return best if best != current and gain > math.log1p(MARGIN) + SWITCH_Z * self.noise(best, current) else current

    def predicted(self, k: int) -> float:
        return self.rate(k) / self.rate(0)

    # ------------------------------------------------------------------ the protocol
    def next_k(self, batch: Batch) -> int:
        """The K of the next run: target-only while no row could draft from a current state; else
        the current K, replaced by a better one on evidence, or for one run by an exploration."""
        self.exploring = False
        if not batch.can_draft or self.max_draft_tokens == 0:
            self.next = 0
            return 0
        new = self._better(self.current, batch.last_wave)
        self.switches += new != self.current
        self.current = self.next = new
        explore = self._exploration(batch)
        if explore is not None:
            self.exploring, self.next = True, explore
        return self.next

    def _exploration(self, batch: Batch) -> int | None:
        if self.acceptance.offered[0] < BOOTSTRAP_ROUNDS and self.table_source != "user":
            largest = max((k for k in self.costs.measured() if 1 <= k <= self.max_draft_tokens), default=0)
            return largest if largest not in (0, self.current) else None
        # the next run taken as long as the latest: it must fit in the share with those explored before
        total = sum(self.rounds_per_k.values())
        if (self.max_new_tokens <= SHORT_JOB_TOKENS or not self.last_iterations
                or self.explored_rounds + self.last_iterations > EXPLORE_SHARE * total):
            return None
        hopeful = max(range(self.max_draft_tokens + 1), key=lambda k: (self.rate(k, SWITCH_Z, batch.last_wave), -k))
        if hopeful == self.current or hopeful in self.costs.runs:
            return None
        now = self.rate(self.current, 0.0, batch.last_wave)
        return hopeful if self.rate(hopeful, SWITCH_Z, batch.last_wave) > (1 + MARGIN) * now else None

    def settled(self, batch: Batch) -> bool:
        """Target-only in the last wave stays target-only: no row keeps a current draft state."""
        return self.next == 0

    def observe(self, run: Run) -> None:
        taught = run.taught_B
        self.rounds_per_k[run.k] = self.rounds_per_k.get(run.k, 0) + run.iterations
        self.last_iterations = run.iterations
        if self.exploring:
            self.explored_rounds += run.iterations
        self.acceptance.observe(run.k, int(run.rounds_B[taught].sum()), run.accepted_BK[taught].sum(0))
        self.costs.observe(run)
        # kept every UPDATE_SECONDS too: a long job that is killed keeps most of what it learned
        if self.on_update is not None and time.perf_counter() - self.updated > UPDATE_SECONDS:
            self.finish()

    def finish(self) -> None:
        """The job is over: what it learned is kept for the next one."""
        if self.on_update is not None:
            self.on_update(self)
            self.updated = time.perf_counter()

    def report(self) -> DraftChoice:
        k, costs = self.next, self.costs
        spec, plain = costs.rate(k), costs.rate(0)
        return DraftChoice(
            num_draft_tokens=k, start_k=self.start_k, table_source=self.table_source,
            predicted_speedup=self.predicted(k), measured_speedup=spec / plain if (k and spec and plain) else None,
            tau=self.acceptance.tau(k), rounds_per_k=dict(self.rounds_per_k), explored_rounds=self.explored_rounds,
            switches=self.switches, calibration_seconds=costs.calibration_seconds,
            target_round_seconds=costs.cost(0),
            round_seconds_per_k={j: c for j in sorted(costs.runs) if (c := costs.live(j)) is not None})
