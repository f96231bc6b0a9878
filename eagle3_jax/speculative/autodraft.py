"""``num_draft_tokens="auto"``: choose K from measured round costs and live acceptance.

A round with K draft tokens costs c(K) seconds (verify K+1 tokens, K draft steps, catch-up,
accept: measured as whole rounds, so the loop's own overhead is in it) and emits τ(K) tokens per
row on average, τ(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j with a_j the probability that draft position j is
accepted given that position j-1 was. K = 0 is target-only: τ(0) = 1. The choice is the K that
maximizes τ(K) / c(K); when speculation does not pay, that is K = 0.

Costs depend on the pair, the device kind, the batch size, the cache capacity and greedy vs
sampling, not on the weights' values or the text (every shape is static), so they are measured
once by ``calibrate`` and cached on disk under ``$EAGLE3_JAX_CACHE`` (default
``~/.cache/eagle3_jax``), then refined by the timings of the real runs (``RoundCosts.cost``).
Acceptance starts from a prior and is updated from every bounded run.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
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
# Live round timings: the latest few per K count, and only runs long enough to time meaningfully.
LIVE_SAMPLES = 8
LIVE_MIN_ITERATIONS = 4
EXPLORE_EVERY = 16


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
    live: dict[int, list[float]] = field(default_factory=dict)   # seconds per round seen in real runs

    def cost(self, k: int) -> float:
        """The median of the calibrated cost and the latest LIVE_SAMPLES live ones: a calibration
        disturbed by load (or a stale disk entry) is outvoted once K has run a few times."""
        return statistics.median([self.seconds[k]] + self.live.get(k, [])[-LIVE_SAMPLES:])

    def observe(self, k: int, seconds_per_round: float) -> None:
        self.live.setdefault(k, []).append(seconds_per_round)

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
        state = run_rounds(*models, state, jnp.int32(CALIBRATION_ROUNDS), sp, program=prog)
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
    predicted_speedup: float              # predicted throughput of that K over target-only's
    measured_speedup: float               # measured tokens/s over the calibrated target-only rate
    tau: float                            # predicted tokens per round per row at that K
    rounds_per_k: dict[int, int] = field(default_factory=dict)   # loop iterations run with each K
    compiled_programs: int = 0            # round programs compiled by the calibration
    calibration_seconds: float = 0.0      # its wall time, compiles included (0: costs from disk)


class AutoDraft:
    """Chooses K for each bounded run and learns acceptance from it (one per session and batch size)."""

    def __init__(self, costs: RoundCosts, max_draft_tokens: int, acceptance: AcceptanceModel):
        self.costs = costs
        self.acceptance = acceptance
        self.max_draft_tokens = max_draft_tokens
        self.rounds_per_k: dict[int, int] = {}
        self.runs = 0
        self.spec_row_rounds = 0    # rounds with K >= 1, summed over rows, and the tokens they emitted
        self.spec_round_tokens = 0
        self.run_seconds = 0.0
        self.run_row_tokens = 0.0   # tokens per row, summed over runs (row-rounds weighted)
        self.last_k = self.choose()

    def predicted(self, k: int) -> float:
        return self.costs.predicted_throughput(k, self.acceptance.tau(k))

    def choose(self) -> int:
        """argmax_K τ(K) / c(K); ties go to the smaller K (cheaper to be wrong)."""
        ks = range(self.max_draft_tokens + 1)
        return max(ks, key=lambda k: (self.predicted(k), -k))

    def next_k(self) -> int:
        """The K of the next run: ``choose()``, except that every EXPLORE_EVERY-th run takes the best
        K of the other kind (target-only when speculating, the best K >= 1 when not). Without it,
        target-only's cost would only ever be the calibrated one (taken under whatever load the
        machine had then) while the chosen K's cost follows live timings, and acceptance could not
        be learnt while K = 0."""
        self.runs += 1
        best = self.choose()
        if self.runs % EXPLORE_EVERY:
            return best
        if best:
            return 0
        return max(range(1, self.max_draft_tokens + 1), key=lambda k: (self.predicted(k), -k))

    def observe(self, k: int, iterations: int, seconds: float, row_rounds: int, round_tokens: int,
                accepted_per_position) -> None:
        """One bounded run: ``iterations`` loop iterations in ``seconds``; ``row_rounds`` rounds summed
        over running rows emitted ``round_tokens`` tokens."""
        self.last_k = k
        self.rounds_per_k[k] = self.rounds_per_k.get(k, 0) + iterations
        self.acceptance.observe(k, row_rounds, accepted_per_position)
        if k:
            self.spec_row_rounds += row_rounds
            self.spec_round_tokens += round_tokens
        if iterations >= LIVE_MIN_ITERATIONS:
            self.costs.observe(k, seconds / iterations)
        if iterations and row_rounds:
            self.run_seconds += seconds
            self.run_row_tokens += iterations * round_tokens / row_rounds

    def speculative_stats(self) -> GenerationStats:
        """Rounds that speculated only (K = 0 rounds emit one token by design): what the collapse
        watchdog should judge."""
        return GenerationStats(rounds=self.spec_row_rounds, tokens=self.spec_round_tokens,
                               round_tokens=self.spec_round_tokens, seconds=0.0)

    def report(self) -> DraftChoice:
        k = self.last_k
        base = self.predicted(0)
        measured = (self.run_row_tokens / self.run_seconds) / base if self.run_seconds else float("nan")
        return DraftChoice(num_draft_tokens=k, predicted_speedup=self.predicted(k) / base, measured_speedup=measured,
                           tau=self.acceptance.tau(k), rounds_per_k=dict(self.rounds_per_k),
                           compiled_programs=(self.max_draft_tokens + 1) if self.costs.calibration_seconds else 0,
                           calibration_seconds=self.costs.calibration_seconds)
