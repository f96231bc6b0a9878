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

What decides. The model predicts; measurements decide. Serving also pays for admissions
(prefill of the next prompts), host syncs and rows waiting for the end of a bounded run, none of
which the round model sees, so every K that has run is judged by its measured tokens per second
over whole sync cycles (``CycleRates``), and the model only ranks the Ks not yet measured.
K = 0 is a real choice: when speculation does not pay, it is turned off (and re-tried now and
then, at intervals that grow while it keeps losing).
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
import jax.numpy as jnp
import numpy as np

from eagle3_jax.distributed import fetch
from eagle3_jax.metrics import GenerationStats

AUTO = "auto"
DEFAULT_MAX_DRAFT_TOKENS = 6
# Prior conditional acceptance per position, worth PRIOR_ROUNDS observed rounds: optimistic enough
# that a session tries speculating, weak enough that a few syncs of real data override it.
PRIOR_ACCEPT = 0.7
PRIOR_ROUNDS = 8
CACHE_ENV = "EAGLE3_JAX_CACHE"
CALIBRATION_ROUNDS = 8
CALIBRATION_REPEATS = 3
CALIBRATION_PROMPT_LEN = 16
# Whole-cycle throughput: the latest CYCLE_WINDOW cycles per K count; a K's measurement replaces
# its prediction once it has MIN_CYCLES of them.
CYCLE_WINDOW = 8
MIN_CYCLES = 2
# Exploration of the other kind: EXPLORE_RUNS runs in a row (enough for MIN_CYCLES), first after
# EXPLORE_FIRST runs, then at doubling intervals up to EXPLORE_MAX runs.
EXPLORE_RUNS = MIN_CYCLES
EXPLORE_FIRST = 8
EXPLORE_MAX = 64


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
    """Measured seconds per round for each K in 0..max_draft_tokens (one batch size, one device kind)."""

    seconds: dict[int, float]
    calibration_seconds: float = 0.0   # wall time of the calibration, compiles included (0: from disk)

    def cost(self, k: int) -> float:
        return self.seconds[k]

    def predicted_throughput(self, k: int, tau: float) -> float:
        """Tokens per second per row."""
        return tau / self.cost(k)


def cost_key(fingerprint: str, program) -> str:
    return (f"{fingerprint}|{jax.devices()[0].device_kind}|B={program.batch_size}|S={program.max_len}"
            f"|Kmax={program.max_draft_tokens}|{'greedy' if program.greedy else 'sampled'}")


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
    rows = jnp.arange(B, dtype=jnp.int32)

    def timed(k: int) -> float:
        prog = program.with_draft_tokens(k)   # only the rounds differ per K; admission is shared
        state = blank_state(*models, jax.random.key(0), sp, program=program)
        state = admit_rows(*models, state, rows, jnp.asarray(ids), jnp.asarray(lengths), sp, program=program)
        before = fetch(state.rounds_B).max()
        t = time.perf_counter()
        state = run_rounds(*models, state, jnp.int32(CALIBRATION_ROUNDS), jnp.int32(B + 1), sp, program=prog)
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
        return (self.accepted + PRIOR_ACCEPT * PRIOR_ROUNDS) / (self.offered + PRIOR_ROUNDS)

    def tau(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.conditional()[:k]).sum())


@dataclass
class DraftChoice:
    """What auto decided and how it went: for metrics and progress lines."""

    num_draft_tokens: int                 # the K of the latest run
    predicted_speedup: float              # the round model's throughput at that K over target-only's
    measured_speedup: float               # measured whole-cycle tokens/s at that K over target-only's (nan: not both measured)
    tau: float                            # predicted tokens per round per row at that K
    rounds_per_k: dict[int, int] = field(default_factory=dict)   # loop iterations run with each K
    compiled_programs: int = 0            # round programs compiled by the calibration
    calibration_seconds: float = 0.0      # its wall time, compiles included (0: costs from disk)
    measured_per_k: dict[int, float] = field(default_factory=dict)   # tokens/s per row, whole cycles


class CycleRates:
    """Measured throughput per K over whole sync cycles: a bounded run, the fetch of its results,
    handing them out and the admissions that refill the freed rows, up to the next run. That is
    what a user waits for; round timings alone leave out the admissions and host syncs, whose
    share grows as speculation makes rows finish in fewer rounds."""

    def __init__(self):
        self.window: dict[int, deque] = {}

    def observe(self, k: int, row_tokens: float, seconds: float) -> None:
        """``row_tokens``: tokens the cycle emitted per occupied row."""
        self.window.setdefault(k, deque(maxlen=CYCLE_WINDOW)).append((row_tokens, seconds))

    def rate(self, k: int) -> float | None:
        """Tokens per second per row over the latest CYCLE_WINDOW cycles, None below MIN_CYCLES."""
        w = self.window.get(k)
        if not w or len(w) < MIN_CYCLES:
            return None
        return sum(t for t, _ in w) / sum(s for _, s in w)


class AutoDraft:
    """Chooses K for each bounded run and learns acceptance and throughput from it (one per session
    and batch size).

    A K that has run a few whole cycles is judged by its measured tokens/s; one that has not, by
    the round model (calibrated costs, live acceptance) scaled by how far the measured Ks fall short
    of their own model predictions (admissions and syncs cost every K alike per token). The other
    kind (target-only vs speculating) is explored early, then at intervals that double while
    exploring keeps confirming the choice, so its cost where speculation loses stays small."""

    def __init__(self, costs: RoundCosts, max_draft_tokens: int, acceptance: AcceptanceModel):
        self.costs = costs
        self.acceptance = acceptance
        self.max_draft_tokens = max_draft_tokens
        self.cycles = CycleRates()
        self.rounds_per_k: dict[int, int] = {}
        self.runs = 0
        self.spec_row_rounds = 0    # rounds with K >= 1, summed over rows, and the tokens they emitted
        self.spec_round_tokens = 0
        self.explore_at = 2         # run number of the next exploration
        self.explore_interval = EXPLORE_FIRST
        self.exploring = 0          # exploration runs still to go
        self.explore_k = None
        self.settled = None         # the choice the exploration schedule was set for
        self.last_k = self.choose()

    def model_rate(self, k: int) -> float:
        """The round model: tokens per second per row."""
        return self.costs.predicted_throughput(k, self.acceptance.tau(k))

    def correction(self) -> float:
        """Median over measured Ks of measured / model throughput (1 before any measurement)."""
        ratios = [m / self.model_rate(k) for k in range(self.max_draft_tokens + 1)
                  if (m := self.cycles.rate(k)) is not None]
        return statistics.median(ratios) if ratios else 1.0

    def rate(self, k: int) -> float:
        measured = self.cycles.rate(k)
        return measured if measured is not None else self.model_rate(k) * self.correction()

    def choose(self) -> int:
        """argmax_K of the (measured or predicted) throughput; ties go to the smaller K."""
        ks = range(self.max_draft_tokens + 1)
        return max(ks, key=lambda k: (self.rate(k), -k))

    def _best_other(self, best: int) -> int:
        if best:
            return 0
        return max(range(1, self.max_draft_tokens + 1), key=lambda k: (self.rate(k), -k))

    def next_k(self) -> int:
        """The K of the next run: ``choose()``, except for exploration runs (EXPLORE_RUNS in a row)
        of the best K of the other kind: target-only when speculating, the best K >= 1 when not.
        Without them a K that once lost (say, under a load that has since gone) would never be
        measured again. The interval between explorations doubles (up to EXPLORE_MAX runs) while
        they confirm the choice and restarts at EXPLORE_FIRST when the choice changes."""
        self.runs += 1
        best = self.choose()
        if self.exploring:
            self.exploring -= 1
            return self.explore_k
        if best != self.settled:
            if self.settled is not None:   # the choice changed: check it again soon
                self.explore_at = min(self.explore_at, self.runs + EXPLORE_FIRST)
                self.explore_interval = 2 * EXPLORE_FIRST
            self.settled = best
        if self.runs < self.explore_at or self.max_draft_tokens == 0:
            return best
        self.explore_k = self._best_other(best)
        self.exploring = EXPLORE_RUNS - 1
        self.explore_at = self.runs + EXPLORE_RUNS + self.explore_interval
        self.explore_interval = min(2 * self.explore_interval, EXPLORE_MAX)
        return self.explore_k

    def observe(self, k: int, iterations: int, row_rounds: int, round_tokens: int, accepted_per_position) -> None:
        """One bounded run: ``iterations`` loop iterations; ``row_rounds`` rounds summed over running
        rows emitted ``round_tokens`` tokens."""
        self.last_k = k
        self.rounds_per_k[k] = self.rounds_per_k.get(k, 0) + iterations
        self.acceptance.observe(k, row_rounds, accepted_per_position)
        if k:
            self.spec_row_rounds += row_rounds
            self.spec_round_tokens += round_tokens

    def observe_cycle(self, k: int, row_tokens: float, seconds: float) -> None:
        """One whole sync cycle run at ``k`` (see ``CycleRates``); cycles that compiled are left out."""
        if seconds > 0 and row_tokens > 0:
            self.cycles.observe(k, row_tokens, seconds)

    def speculative_stats(self) -> GenerationStats:
        """Rounds that speculated only (K = 0 rounds emit one token by design): what the collapse
        watchdog should judge."""
        return GenerationStats(rounds=self.spec_row_rounds, tokens=self.spec_round_tokens,
                               round_tokens=self.spec_round_tokens, seconds=0.0)

    def report(self) -> DraftChoice:
        k = self.last_k
        measured_k, measured_0 = self.cycles.rate(k), self.cycles.rate(0)
        measured = measured_k / measured_0 if measured_k is not None and measured_0 else float("nan")
        per_k = {j: r for j in range(self.max_draft_tokens + 1) if (r := self.cycles.rate(j)) is not None}
        return DraftChoice(num_draft_tokens=k, predicted_speedup=self.model_rate(k) / self.model_rate(0),
                           measured_speedup=measured, tau=self.acceptance.tau(k), rounds_per_k=dict(self.rounds_per_k),
                           compiled_programs=(self.max_draft_tokens + 1) if self.costs.calibration_seconds else 0,
                           calibration_seconds=self.costs.calibration_seconds, measured_per_k=per_k)
