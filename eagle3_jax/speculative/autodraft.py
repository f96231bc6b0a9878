"""``num_draft_tokens="auto"``: choose K from measured costs and live acceptance.

The round model. A round with K draft tokens costs c(K) seconds (verify K+1 tokens, K draft
steps, catch-up, accept: timed as whole rounds, so the loop's own overhead is in it) and emits
τ(K) tokens per row on average, τ(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j with a_j the probability that draft
position j is accepted given that position j-1 was. K = 0 is target-only: τ(0) = 1. Its
throughput is τ(K) / c(K).

Costs depend on the pair, the device kind, the batch size, the cache capacity and greedy vs
sampling, not on the weights' values or the text (every shape is static), so they are measured
once by ``calibrate`` and cached on disk under ``$EAGLE3_JAX_CACHE`` (default
``~/.cache/eagle3_jax``). Acceptance starts from a prior and is updated from every bounded run.

Live costs. A calibration taken under one load (or read from disk) need not describe the machine
now, so every bounded run's own timing is kept: a K that ran lately is priced by what its rounds
cost then, one that did not by its calibration scaled as the live Ks moved (``RoundCosts``).
Admissions (the next prompts' prefill) are timed out of round costs; the wall clock (``WallClock``)
sees them. K = 0 is a real choice: when speculation does not pay, it is turned off (prompts are
then admitted without the draft, so K = 0 costs what having no draft costs), and re-tried now and
then, on rows admitted with the draft, at intervals that grow while it keeps losing, as long as
acceptance at its upper confidence bound could still make it pay; each exploration runs the K that
bound favours most, so the data it brings are the ones that could end the exploring. While
speculating, target-only is priced from its calibration, not explored: its rounds would leave every
row's draft state stale.

One wave. With prompts waiting, a finished row is refilled at once, so the mean row's τ is the
batch's, and rows admitted at different times finish at different times whatever K is. A batch
admitted together with nothing waiting (one wave: as many prompts as rows, or fewer) idles its
finished rows until the last one is done: there K is chosen for when the slowest row finishes
(``AutoDraft.tail_rate``), from how finished prompts' acceptance spread around the model's. A wide
wave of prompts that accept unevenly can lose to target-only even where the mean row gains.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import jax
import numpy as np

from eagle3_jax.distributed import fetch
from eagle3_jax.metrics import GenerationStats

AUTO = "auto"
DEFAULT_MAX_DRAFT_TOKENS = 6
# Prior conditional acceptance of draft position 1, worth PRIOR_ROUNDS observed rounds: optimistic
# enough that a session tries speculating, weak enough that a few syncs of real data override it.
# Each later position's prior is the estimate of the position before it (AcceptanceModel.conditional).
PRIOR_ACCEPT = 0.7
PRIOR_ROUNDS = 8
CACHE_ENV = "EAGLE3_JAX_CACHE"
CALIBRATION_ROUNDS = 8
CALIBRATION_REPEATS = 3
CALIBRATION_PROMPT_LEN = 16
# Live round costs: the latest LIVE_WINDOW runs of at least LIVE_MIN_RUN_ROUNDS rounds per K count,
# once they hold LIVE_MIN_ITERATIONS rounds.
LIVE_WINDOW = 8
LIVE_MIN_RUN_ROUNDS = 4
LIVE_MIN_ITERATIONS = 8
# Exploration of speculation while target-only is chosen: EXPLORE_RUNS runs in a row, first at run 2,
# then after EXPLORE_FIRST runs, then at doubling intervals up to EXPLORE_MAX runs.
EXPLORE_RUNS = 2
EXPLORE_FIRST = 8
EXPLORE_MAX = 64
# While target-only is chosen, speculation is only explored if some K could still win with its
# acceptance EXPLORE_Z standard errors above the estimate (AcceptanceModel.tau_upper): where even
# that loses (large batches on a shallow target), an exploration could not change the choice.
EXPLORE_Z = 2.0
# Speculation must be predicted this much faster than target-only to be chosen. The round model
# leaves out what speculating costs besides rounds: rows finishing out of step (more, shorter runs
# and admissions) and the draft's share of every prefill. On the demo pair at batch 8 those made a
# K predicted 8 % faster run 15 % slower (benchmarks/RESULTS.md, "speedup").
SPECULATION_MARGIN = 0.10
# One wave (rows admitted together, no prompt waiting): how each prompt's own acceptance compared with
# the model's, over the latest TAIL_WINDOW prompts that speculated at one K, once there are
# TAIL_MIN_PROMPTS; TAIL_DRAWS draws of them per row estimate when the wave's last row finishes.
TAIL_WINDOW = 64
TAIL_MIN_PROMPTS = 8
TAIL_DRAWS = 64
# The wall-clock veto: the latest WALL_WINDOW cycles of each K, once there are WALL_MIN_CYCLES, and
# only for a K measured more than WALL_MARGIN slower than target-only. Where speculation and
# target-only run level (demo pair, batch 8, T = 1: 38 vs 38 tokens per row per second, K = 1..3),
# a veto without the margin flipped on noise: every K vetoed in turn, then target-only, whose rows
# can only speculate again once re-admitted, then K = 2 again.
WALL_WINDOW = 16
WALL_MIN_CYCLES = 4
WALL_MARGIN = 0.03


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "eagle3_jax")


def pair_fingerprint(target, draft) -> str:
    """What round costs depend on: both models' configs, parameter shapes and dtypes, the mesh."""
    def shapes(state):
        return sorted((".".join(map(str, p)), tuple(v.get_value().shape), str(v.get_value().dtype))
                      for p, v in _flat(state))
    parts = [repr(target.config), shapes(target.state), repr(getattr(target.mesh, "shape", None))]
    if draft is not None:
        parts += [repr(draft.config), shapes(draft.state), draft.aux_layer_ids]
    for layer in getattr(target.model, "layers", []):   # the MoE kernel changes the cost, not the output
        kernel = getattr(getattr(layer, "mlp", None), "kernel", None)
        if kernel is not None:
            parts.append(kernel)
            break
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _flat(state):
    from flax import nnx

    return nnx.to_flat_state(state)


@dataclass
class RoundCosts:
    """Seconds per round for each K in 0..max_draft_tokens (one batch size, one device kind):
    calibrated, then measured on the real runs.

    A K that has run LIVE_MIN_ITERATIONS rounds lately is priced by its live timings (the latest
    LIVE_WINDOW runs, total seconds over total rounds); one that has not, by its calibrated cost
    scaled by how the measured Ks compare with their own calibration (the machine's load now
    against the load when it calibrated, or a stale disk entry)."""

    seconds: dict[int, float]
    calibration_seconds: float = 0.0   # wall time of the calibration, compiles included (0: from disk)
    live: dict[int, deque] = field(default_factory=dict)   # K -> (seconds, rounds) of the latest runs

    def observe(self, k: int, seconds: float, rounds: int) -> None:
        """A run of ``rounds`` loop iterations in ``seconds``. Runs shorter than LIVE_MIN_RUN_ROUNDS
        are left out: a run's fixed costs (dispatch, the fetch of its results, a first iteration
        after an admission) would dominate them, and the number of runs follows how often rows
        finish, not K."""
        if rounds >= LIVE_MIN_RUN_ROUNDS and seconds > 0:
            self.live.setdefault(k, deque(maxlen=LIVE_WINDOW)).append((seconds, rounds))

    def live_cost(self, k: int) -> float | None:
        w = self.live.get(k)
        rounds = sum(r for _, r in w) if w else 0
        return sum(t for t, _ in w) / rounds if rounds >= LIVE_MIN_ITERATIONS else None

    def drift(self) -> float:
        """Median over live-measured Ks of live / calibrated cost (1 before any measurement)."""
        ratios = [c / self.seconds[k] for k in self.seconds if (c := self.live_cost(k)) is not None]
        return statistics.median(ratios) if ratios else 1.0

    def cost(self, k: int) -> float:
        live = self.live_cost(k)
        return live if live is not None else self.seconds[k] * self.drift()

    def predicted_throughput(self, k: int, tau: float) -> float:
        """Tokens per second per row."""
        return tau / self.cost(k)


def cost_key(fingerprint: str, program, greedy: bool) -> str:
    return (f"{fingerprint}|{jax.devices()[0].device_kind}|B={program.batch_size}|S={program.max_len}"
            f"|Kmax={program.max_draft_tokens}|{'greedy' if greedy else 'sampled'}")


def load_costs(key: str) -> RoundCosts | None:
    path = os.path.join(cache_dir(), "round_costs.json")
    try:
        with open(path) as f:
            entry = json.load(f).get(key)
    except (OSError, ValueError):
        return None
    return RoundCosts({int(k): float(v) for k, v in entry.items()}) if entry else None


def save_costs(key: str, costs: RoundCosts) -> None:
    """Adds one entry to the cache file (written to a temporary file and renamed: never half-written)."""
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "round_costs.json")
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table[key] = {str(k): v for k, v in costs.seconds.items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def calibrate(session, program, sp) -> RoundCosts:
    """Times whole rounds for each K on a batch of random prompts: CALIBRATION_REPEATS
    interleaved runs of CALIBRATION_ROUNDS rounds per K (after one untimed run that compiles),
    the median seconds per executed round. Static shapes make the cost independent of the text."""
    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds

    start = time.perf_counter()
    models = session.models()
    B = program.batch_size
    # Random prompts, one per row: the MoE cost depends on how many distinct experts the tokens
    # route to, so identical dummy rows would time a round far cheaper than real text makes it.
    rng = np.random.default_rng(0)
    vocab = session.target.config.vocab_size
    T = min(CALIBRATION_PROMPT_LEN, session.max_len - 1)
    ids, lengths, _ = session.pack_prompts({b: rng.integers(0, vocab, T).tolist() for b in range(B)}, B)
    rows = np.arange(B, dtype=np.int32)

    # K = 0 runs without the draft's weights, as the Engine runs it: the same compiled program,
    # which the Engine then finds compiled (with them it was one more program to compile).
    target_models = models[:2] + (None, None)

    def timed(k: int) -> float:
        prog = program.with_draft_tokens(k)   # only the rounds differ per K; admission is shared
        state = blank_state(*models, jax.random.key(0), sp, program=program)
        state = admit_rows(*models, state, rows, ids, lengths, sp, program=program)
        before = fetch(state.rounds_B).max()
        t = time.perf_counter()
        state = run_rounds(*(models if k else target_models), state, np.int32(CALIBRATION_ROUNDS), np.int32(B + 1),
                           sp, program=prog)
        executed = fetch(state.rounds_B).max() - before   # the fetch waits for the run
        return (time.perf_counter() - t) / max(int(executed), 1)

    ks = range(program.max_draft_tokens + 1)
    with session.activate():
        for k in ks:
            timed(k)   # compiles
        samples = {k: [] for k in ks}
        for _ in range(CALIBRATION_REPEATS):
            for k in ks:
                samples[k].append(timed(k))
    return RoundCosts({k: statistics.median(v) for k, v in samples.items()}, time.perf_counter() - start)


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance a_j: a prior, then counts from every observed run."""

    max_draft_tokens: int
    accepted: np.ndarray = None    # [K_max] rounds in which position j was accepted
    offered: np.ndarray = None     # [K_max] rounds in which position j was drafted and j-1 accepted

    def __post_init__(self):
        self.accepted = np.zeros(self.max_draft_tokens)
        self.offered = np.zeros(self.max_draft_tokens)

    def observe(self, k: int, rounds: int, accepted_per_position) -> None:
        """One run of ``rounds`` rounds with ``k`` draft tokens; ``accepted_per_position[j]``: rounds
        in which position j was accepted (which implies every earlier one was)."""
        if k == 0 or rounds == 0:
            return
        acc = np.asarray(accepted_per_position[:k], float)
        self.accepted[:k] += acc
        self.offered[:k] += np.concatenate([[rounds], acc[:-1]])

    def conditional(self) -> np.ndarray:
        """a_j, each position's counts on top of a prior worth PRIOR_ROUNDS rounds: PRIOR_ACCEPT for
        position 1, the estimate of position j-1 for position j. Positions past the K that has run
        are never offered, so a fixed prior would price them forever: with 0.7 there, a greedy
        session accepting 87 % per position held K = 3 at 1.38x target-only while K = 6 ran at
        1.57x (demo pair, batch 1, RESULTS "autodraft: unreached positions"). Carried over from the
        position before, they are priced as the nearest data say until their own counts tell."""
        out = np.empty(self.max_draft_tokens)
        prior = PRIOR_ACCEPT
        for j in range(self.max_draft_tokens):
            out[j] = prior = (self.accepted[j] + prior * PRIOR_ROUNDS) / (self.offered[j] + PRIOR_ROUNDS)
        return out

    def tau(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.conditional()[:k]).sum())

    def tau_upper(self, k: int) -> float:
        """τ(K) with each a_j at its upper confidence bound (EXPLORE_Z standard errors above the
        estimate, the prior's rounds counted as observations): what speculation could reach if
        acceptance were as good as the data allow. Close to K + 1 with little data, close to τ(K)
        with much."""
        a = self.conditional()
        n = self.offered + PRIOR_ROUNDS
        upper = np.minimum(a + EXPLORE_Z * np.sqrt(a * (1.0 - a) / n), 1.0)
        return 1.0 + float(np.cumprod(upper[:k]).sum())


@dataclass
class DraftChoice:
    """What auto decided and how it went: for metrics and progress lines."""

    num_draft_tokens: int                 # the K of the latest run
    predicted_speedup: float              # throughput at that K over target-only's with calibrated round costs
    # the same with live round costs: target-only's where it ran lately, else its calibration scaled by
    # the live drift (RoundCosts.cost; it is not explored while speculating); nan before K has run
    measured_speedup: float
    tau: float                            # predicted tokens per round per row at that K
    rounds_per_k: dict[int, int] = field(default_factory=dict)   # loop iterations run with each K
    compiled_programs: int = 0            # round programs compiled by the calibration
    calibration_seconds: float = 0.0      # its wall time, compiles included (0: costs from disk)
    round_seconds_per_k: dict[int, float] = field(default_factory=dict)   # live seconds per round
    target_round_seconds: float = float("nan")   # a target-only round as priced now (RoundCosts.cost(0))


class WallClock:
    """Tokens per occupied row per second over whole sync cycles, kept per K (0: target-only): a
    bounded run, handing out its results, and the admissions that refill the freed rows, up to the
    next run. That is what a user waits for, including what the round model leaves out (more and
    shorter runs when speculating rows finish out of step, the draft's share of every prefill). It
    only vetoes: a K whose own cycles have been slower on the wall clock than target-only's is
    overruled, and the round model's next best K is considered instead. Per K, because one K that
    loses says little about another: pooled, the cycles of a K = 3 the round model overrated kept
    vetoing a K = 2 that paid (demo pair, batch 8, T = 1: auto 1.04x against K = 2 at 1.17x)."""

    def __init__(self):
        self.cycles: dict[int, deque] = {}

    def observe(self, k: int, row_tokens: float, seconds: float) -> None:
        if row_tokens > 0 and seconds > 0:
            self.cycles.setdefault(k, deque(maxlen=WALL_WINDOW)).append((row_tokens, seconds))

    def rate(self, k: int) -> float | None:
        """None until WALL_MIN_CYCLES cycles at that K were seen."""
        w = self.cycles.get(k, ())
        return sum(t for t, _ in w) / sum(s for _, s in w) if len(w) >= WALL_MIN_CYCLES else None


class AutoDraft:
    """Chooses K for each bounded run and learns acceptance and round costs from it (one per
    session and batch size): K maximizes τ(K) / c(K), with τ from the live acceptance and c from
    live round timings where K has run lately (``RoundCosts``). While target-only is chosen,
    speculation is explored early, then at intervals that double while exploring keeps confirming
    the choice, so what exploring costs where speculation loses stays small; while speculating,
    target-only is priced, not explored (``next_k``)."""

    def __init__(self, costs: RoundCosts, max_draft_tokens: int, acceptance: AcceptanceModel):
        self.costs = costs
        self.acceptance = acceptance
        self.max_draft_tokens = max_draft_tokens
        self.wall = WallClock()
        self.rounds_per_k: dict[int, int] = {}
        # per finished prompt that speculated at one K: (its tau - 1) / (the model's tau(K) - 1)
        self.prompt_spread: deque = deque(maxlen=TAIL_WINDOW)
        self.runs = 0
        self.spec_row_rounds = 0    # rounds with K >= 1, summed over rows, and the tokens they emitted
        self.spec_round_tokens = 0
        self.explore_at = 2         # run number of the next exploration
        self.explore_interval = EXPLORE_FIRST
        self.exploring = 0          # exploration runs still to go
        self.explore_k = None
        self.settled = None         # the choice the exploration schedule was set for
        self.last_k = self.choose()
        self.last_was_exploration = False
        # Wall time of setting this chooser up (calibrating, or reading costs from disk), set by
        # DecodeSession.autodraft: compile time, which the first caller claims (claim_setup_seconds).
        self.setup_seconds = 0.0

    def claim_setup_seconds(self) -> float:
        """The set-up time not yet counted by a caller, once: a chooser made for one call and reused
        by the next (a wave handed to the Engine, a later generate) is set-up time only once."""
        seconds, self.setup_seconds = self.setup_seconds, 0.0
        return seconds

    def rate(self, k: int, remaining=None) -> float:
        """Predicted tokens per second per row at K; with ``remaining`` (see ``choose``) and enough
        finished prompts to know how acceptance spreads over prompts, tokens per second until the
        batch's last row is done (``tail_rate``)."""
        if remaining is not None and len(remaining) and len(self.prompt_spread) >= TAIL_MIN_PROMPTS:
            return self.tail_rate(k, remaining)
        return self.costs.predicted_throughput(k, self.acceptance.tau(k))

    def tail_rate(self, k: int, remaining) -> float:
        """In one wave (rows admitted together, no prompt waiting), a finished row idles until the
        batch's last row is done, so its speed is set by its slowest row, not by the mean row the
        per-row model prices. The rows still to run (``remaining`` tokens each) finish after max over
        rows of remaining / tau_r rounds, each row's tau_r = 1 + spread * (tau(K) - 1) with the spread drawn from the latest
        finished prompts (TAIL_DRAWS draws per row, a fixed seed: the same inputs give the same
        choice). At K = 0 every row emits one token per round. Returns tokens per second."""
        left = np.asarray(remaining, float)
        if k == 0:
            rounds = float(left.max())
        else:
            spread = np.asarray(self.prompt_spread, float)
            draws = np.random.default_rng(0).choice(spread, size=(TAIL_DRAWS, len(left)))
            tau_r = 1.0 + draws * (self.acceptance.tau(k) - 1.0)
            rounds = float(np.mean(np.max(left[None, :] / tau_r, axis=1)))
        return float(left.sum()) / (max(rounds, 1.0) * self.costs.cost(k))

    def observe_prompt(self, k: int, tau: float) -> None:
        """A finished prompt whose rounds all ran at K >= 1 from a current draft state emitted ``tau``
        tokens per round: how it compares with the model's tau(K) feeds ``tail_rate``."""
        model = self.acceptance.tau(k)
        if k > 0 and model > 1.0:
            self.prompt_spread.append(max(tau - 1.0, 0.0) / (model - 1.0))

    def choose(self, remaining=None) -> int:
        """The K >= 1 of the highest predicted throughput (ties to the smaller K) among those the
        wall clock has not vetoed (``vetoed``), if it beats target-only by SPECULATION_MARGIN; else 0.
        ``remaining``: in one wave (rows admitted together, no prompt waiting), the tokens each
        occupied row still has to emit (``tail_rate``); else None."""
        if self.max_draft_tokens == 0:
            return 0
        ks = self._not_vetoed()
        if not ks:
            return 0
        best = max(ks, key=lambda k: (self.rate(k, remaining), -k))
        if self.rate(best, remaining) < (1.0 + SPECULATION_MARGIN) * self.rate(0, remaining):
            return 0
        return best

    def vetoed(self, k: int) -> bool:
        """Whether K's own whole cycles were slower on the wall clock than target-only by more than
        WALL_MARGIN (``WallClock``)."""
        spec, plain = self.wall.rate(k), self.wall.rate(0)
        if plain is None:
            # No target-only cycles to compare with (it is not explored while speculating, see
            # next_k): its rounds at their current cost. That leaves out its admissions, so it errs
            # toward vetoing.
            plain = 1.0 / self.costs.cost(0)
        return spec is not None and spec < (1.0 - WALL_MARGIN) * plain

    def _not_vetoed(self) -> list[int]:
        return [k for k in range(1, self.max_draft_tokens + 1) if not self.vetoed(k)]

    def optimistic_rate(self, k: int) -> float:
        """Tokens per second per row at K with acceptance at its upper confidence bound
        (``AcceptanceModel.tau_upper``): what K could reach as far as the data allow."""
        return self.acceptance.tau_upper(k) / self.costs.cost(k)

    def _could_pay(self) -> list[int]:
        plain = (1.0 + SPECULATION_MARGIN) * self.rate(0)
        return [k for k in range(1, self.max_draft_tokens + 1) if self.optimistic_rate(k) >= plain]

    def could_pay(self) -> bool:
        """Whether some K >= 1 would beat target-only by SPECULATION_MARGIN at its optimistic τ."""
        return bool(self._could_pay())

    def _best_speculating(self) -> int:
        """What an exploration runs: of the Ks that could pay at their optimistic τ, the one whose
        optimistic rate is highest (the wall clock's vetoed ones only if every such K is vetoed; if
        none could pay, the round model's best). The K whose optimism is highest is the one whose
        data are thinnest where they matter, so exploring it is what can settle the question: a
        point-estimate pick explored a cheap K again and again while the positions only a larger K
        reaches kept their prior's optimism, and with it kept could_pay true (demo pair, batch 1,
        T = 1: K = 1 and K = 2 explored every 64 runs at 0.8-0.9x target-only)."""
        ks = self._could_pay()
        if not ks:
            return max(self._not_vetoed() or range(1, self.max_draft_tokens + 1), key=lambda k: (self.rate(k), -k))
        return max([k for k in ks if not self.vetoed(k)] or ks, key=lambda k: (self.optimistic_rate(k), -k))

    def next_k(self, drafted_rows: bool = True, remaining=None) -> int:
        """The K of the next run: ``choose()``, except for exploration runs (EXPLORE_RUNS in a row)
        of the best K >= 1 while target-only is chosen. Without them speculation that once lost
        (say, under a load that has since gone) would never be measured again. The interval between
        explorations doubles (up to EXPLORE_MAX runs) while they confirm the choice and restarts at
        EXPLORE_FIRST runs after the choice changes.

        ``drafted_rows``: whether a speculating run now would have rows with a current draft state
        (rows admitted for it, or that have speculated since their admission). Acceptance is only
        learned from such rows, and speculating without any drafts from stale states: without them
        the run is target-only, and an exploration of speculation waits until there are some and
        until it could pay (``could_pay``). ``remaining``: see ``choose``."""
        self.runs += 1
        best = self.choose(remaining)
        if not drafted_rows:
            # Rows that ran target-only have a stale draft state: speculating on them would draft from
            # it until they finish. Speculation resumes with the next admission (rows admitted with
            # the draft); a wave that went target-only stays there.
            best = 0
        self.last_was_exploration = True
        if self.exploring:
            self.exploring -= 1
            return self.explore_k
        if best != self.settled:
            if self.settled is not None:   # the choice changed: check it again soon
                self.explore_at = self.runs + EXPLORE_FIRST
                self.explore_interval = 2 * EXPLORE_FIRST
            self.settled = best
        # Target-only is never explored while speculating: its rounds leave the rows' draft state
        # behind (the draft does not see the tokens they emit), so every row would speculate from a
        # stale state until it is re-admitted (measured on the demo pair at batch 1: 1.31x with those
        # explorations against 1.47x without). What it costs needs no exploring either: a K = 0
        # round is priced by its calibration scaled by the live drift (RoundCosts.cost), and the
        # wall-clock veto falls back to that price (choose).
        # Nor is speculation explored in one wave: its rows are about to finish.
        if (self.runs < self.explore_at or self.max_draft_tokens == 0 or best > 0 or remaining is not None
                or not (drafted_rows and self.could_pay())):
            self.last_was_exploration = False
            return best
        self.explore_k = self._best_speculating()
        self.exploring = EXPLORE_RUNS - 1
        self.explore_at = self.runs + EXPLORE_RUNS + self.explore_interval
        self.explore_interval = min(2 * self.explore_interval, EXPLORE_MAX)
        return self.explore_k

    def observe(self, k: int, iterations: int, seconds: float, row_rounds: int, round_tokens: int,
                accepted_per_position) -> None:
        """One bounded run: ``iterations`` loop iterations in ``seconds`` (the run alone, admissions
        excluded); ``row_rounds`` rounds summed over the rows whose draft state was current emitted
        ``round_tokens`` tokens (a row admitted without the draft, or that ran target-only rounds
        since it last speculated, drafts from a stale state: its acceptance says nothing of K)."""
        self.last_k = k
        self.rounds_per_k[k] = self.rounds_per_k.get(k, 0) + iterations
        self.acceptance.observe(k, row_rounds, accepted_per_position)
        self.costs.observe(k, seconds, iterations)
        if k:
            self.spec_row_rounds += row_rounds
            self.spec_round_tokens += round_tokens

    def observe_cycle(self, k: int, row_tokens: float, seconds: float) -> None:
        """One whole sync cycle run at K (``WallClock``); cycles that compiled are not passed in.
        ``row_tokens``: tokens per occupied row, or at K >= 1 per row with a current draft state."""
        self.wall.observe(k, row_tokens, seconds)

    def speculative_stats(self) -> GenerationStats:
        """Rounds that speculated only (K = 0 rounds emit one token by design): what the collapse
        watchdog should judge."""
        return GenerationStats(rounds=self.spec_row_rounds, tokens=self.spec_round_tokens,
                               round_tokens=self.spec_round_tokens, seconds=0.0)

    def report(self) -> DraftChoice:
        k = self.last_k
        live_k, plain = self.costs.live_cost(k), self.costs.cost(0)
        # K = 0 is target-only: 1 by definition (a wave run as the static target-only program has no
        # live round timing)
        measured = 1.0 if k == 0 else self.acceptance.tau(k) * plain / live_k if live_k else float("nan")
        calibrated = self.costs.seconds
        return DraftChoice(num_draft_tokens=k,
                           predicted_speedup=self.acceptance.tau(k) * calibrated[0] / calibrated[k],
                           measured_speedup=measured, tau=self.acceptance.tau(k), rounds_per_k=dict(self.rounds_per_k),
                           compiled_programs=(self.max_draft_tokens + 1) if self.costs.calibration_seconds else 0,
                           calibration_seconds=self.costs.calibration_seconds,
                           target_round_seconds=plain,
                           round_seconds_per_k={j: c for j in range(self.max_draft_tokens + 1)
                                                if (c := self.costs.live_cost(j)) is not None})
