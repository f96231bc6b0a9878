"""Acceptance statistics, the watchdog that makes a collapsed draft impossible to miss, and the
process's record of XLA compilations (what throughput figures leave out)."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from jax import monitoring

log = logging.getLogger("eagle3_jax")

# The seed's symptom: tau pinned at 1.0 because no draft token was ever accepted.
WATCHDOG_MIN_ROUNDS = 32
WATCHDOG_TAU = 1.1


class AcceptanceCollapseWarning(UserWarning):
    """The draft's tokens are (almost) never accepted."""


@dataclass
class GenerationStats:
    rounds: int                     # verify rounds, summed over rows (each row counts while active)
    tokens: int                     # all new tokens, incl. the one the prefill produces
    round_tokens: int               # tokens emitted by verify rounds (what tau measures)
    seconds: float
    accepted_per_position: list[int] = field(default_factory=list)
    per_row_accept_length: list[float] = field(default_factory=list)

    @classmethod
    def empty(cls, num_draft_tokens: int = 0) -> "GenerationStats":
        return cls(rounds=0, tokens=0, round_tokens=0, seconds=0.0, accepted_per_position=[0] * num_draft_tokens)

    @classmethod
    def combine(cls, parts) -> "GenerationStats":
        """The totals of several generate() calls (e.g. the batches of one prompt set)."""
        parts = list(parts)
        n = max((len(p.accepted_per_position) for p in parts), default=0)
        return cls(
            rounds=sum(p.rounds for p in parts), tokens=sum(p.tokens for p in parts),
            round_tokens=sum(p.round_tokens for p in parts), seconds=sum(p.seconds for p in parts),
            accepted_per_position=[sum(p.accepted_per_position[i] for p in parts if i < len(p.accepted_per_position))
                                   for i in range(n)],
            per_row_accept_length=[x for p in parts for x in p.per_row_accept_length])

    @property
    def mean_accept_length(self) -> float:
        """tau = tokens emitted per verify round, including the bonus token (>= 1)."""
        return self.round_tokens / self.rounds if self.rounds else float("nan")

    @property
    def accept_rate_per_position(self) -> list[float]:
        return [a / self.rounds if self.rounds else float("nan") for a in self.accepted_per_position]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def doctor_command(target: str, draft: str) -> str:
    """The command line that measures every plausible wiring of this pair."""
    import shlex

    return f"python -m tools.doctor --target {shlex.quote(str(target))} --draft {shlex.quote(str(draft))}"


def check_acceptance(stats: GenerationStats, num_draft_tokens: int, context: str = "",
                     pair: tuple[str, str] | None = None) -> bool:
    """Warns loudly when tau stays below 1.1 over >= 32 rounds. Returns True when it warned.

    ``pair``: the (target, draft) directories, so the warning can name the doctor's command line."""
    if num_draft_tokens <= 0 or stats.rounds < WATCHDOG_MIN_ROUNDS or not np.isfinite(stats.mean_accept_length):
        return False
    if stats.mean_accept_length >= WATCHDOG_TAU:
        return False
    msg = (
        f"ACCEPTANCE COLLAPSE{(' in ' + context) if context else ''}: mean acceptance length "
        f"{stats.mean_accept_length:.3f} over {stats.rounds} rounds with {num_draft_tokens} draft tokens "
        "(1.0 = no draft token ever accepted). Likely causes: the draft is wired to the wrong target layers "
        "(check eagle_config.eagle_aux_hidden_state_layer_ids against the layers it was trained on; id i = "
        "output of layer i, an off-by-one gives this symptom), the draft was trained for a different target "
        "or tokenizer, or the draft checkpoint is untrained/corrupt."
        + (f" To find the wiring that works, run: {doctor_command(*pair)}" if pair else "")
    )
    log.warning(msg)
    warnings.warn(msg, AcceptanceCollapseWarning, stacklevel=3)
    return True


# JAX's compile events (jax.monitoring): tracing (also a scalar event at its start), lowering, and the
# backend compile, which also wraps a load from the persistent cache (that records CACHE_HIT_EVENT).
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclass
class CompileTally:
    """The compilations of a stretch of time: programs compiled, programs loaded from the persistent
    cache, and the wall seconds they took (overlaps once), also by jitted function name."""

    compiled: int = 0
    from_cache: int = 0
    seconds: float = 0.0
    by_function: dict = field(default_factory=dict)   # name -> {"compiled", "from_cache", "seconds"}

    @property
    def programs(self) -> int:
        return self.compiled + self.from_cache

    def as_dict(self) -> dict:
        return asdict(self)


class CompileLog:
    """Every program this process compiled or loaded from the persistent cache: its
    ``time.perf_counter`` interval (start of tracing to end of backend compile), function name and
    whether it came from the cache, fed by listeners installed on first use (``compile_log()``).
    Callers take a ``count`` and later ask ``since(count)``; ``on_trace`` callbacks hear when
    tracing starts (so a progress line can say it is compiling)."""

    def __init__(self):
        self.intervals: list[tuple[float, float]] = []
        self.entries: list[tuple[str, bool]] = []   # (function name, loaded from the cache), per interval
        self.on_trace: list = []
        self._start: float | None = None   # start of the phases not yet closed by a backend compile
        self._hit = False
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.intervals)

    def _on_scalar(self, event: str, value: float, **_) -> None:
        if event == TRACE_EVENT:
            for callback in list(self.on_trace):
                callback()

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit = True

    def _on_duration(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        # The events carry durations on their own clock; each is placed ending now.
        now = time.perf_counter()
        with self._lock:
            if event in (TRACE_EVENT, LOWER_EVENT):
                if event == TRACE_EVENT or self._start is None:
                    self._start = now - duration
            elif event == BACKEND_COMPILE_EVENT:
                start = self._start if self._start is not None else now - duration
                self.intervals.append((min(start, now - duration), now))
                self.entries.append((fun_name, self._hit))
                self._start, self._hit = None, False

    def since(self, count: int = 0) -> CompileTally:
        """What was compiled or loaded after the first ``count`` programs."""
        tally = CompileTally(seconds=union_length(self.intervals[count:]))
        for (start, end), (name, hit) in zip(self.intervals[count:], self.entries[count:]):
            f = tally.by_function.setdefault(name, {"compiled": 0, "from_cache": 0, "seconds": 0.0})
            f["from_cache" if hit else "compiled"] += 1
            f["seconds"] += end - start
            if hit:
                tally.from_cache += 1
            else:
                tally.compiled += 1
        return tally


_LOG: CompileLog | None = None


def compile_log() -> CompileLog:
    global _LOG
    if _LOG is None:
        _LOG = CompileLog()
        monitoring.register_event_duration_secs_listener(_LOG._on_duration)
        monitoring.register_scalar_listener(_LOG._on_scalar)
        monitoring.register_event_listener(_LOG._on_event)
    return _LOG


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
