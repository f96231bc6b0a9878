"""What a serve run shows: live numbers for the progress bar, the periodic acceptance watchdog,
the final table and the ``--metrics`` JSON.

Time is split three ways so that throughput means decoding speed: ``load_seconds`` (reading the
models), ``compile_seconds`` (XLA compilations during generation: the first call of each program
and each new prompt-length bucket, summed from JAX's compile events), and ``seconds``, the rest of
the generation wall time. ``tokens_per_second`` is tokens / ``seconds``.
"""

from __future__ import annotations

import collections
import math
import time

from eagle3_jax.checkpoint.staging import write_json_atomic
from jax import monitoring

from eagle3_jax.metrics import (BACKEND_COMPILE_EVENT, TRACE_EVENT, WATCHDOG_MIN_ROUNDS, GenerationStats,
                                check_acceptance, union_length)
from eagle3_jax.train_serve import ContextBuckets

# JAX reports each compilation as timed phases: trace, lower to MLIR, XLA compile (and load).
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"   # trace and backend events: metrics


class CompileClock:
    """Sums the wall time JAX spends compiling while active (a context manager): for each
    compilation, from the start of its tracing to the end of its XLA compile, so the host work
    between the phases counts too (a trace that compiles nothing counts its own duration).
    ``on_compile`` is called when tracing starts, so a progress line can say that it is compiling
    instead of stalling silently."""

    def __init__(self, on_compile=None):
        self.seconds = 0.0
        self.intervals: list[tuple[float, float]] = []   # (start, end) in time.perf_counter() seconds
        self.on_compile = on_compile
        self._pending: tuple[float, float] | None = None   # (start, end) of phases not yet closed by a compile

    def _on_phase_start(self, event: str, value: float, **_) -> None:
        # JAX announces each timed phase with its start time as a scalar event.
        if event == TRACE_EVENT and self.on_compile is not None:
            self.on_compile()

    def _on_span(self, event: str, start: float, end: float, **_) -> None:
        if event == TRACE_EVENT:
            self._flush()
            self._pending = (start, end)
        elif event == LOWER_EVENT and self._pending is None:
            self._pending = (start, end)
        elif event == BACKEND_COMPILE_EVENT:
            self._add(end - (self._pending[0] if self._pending is not None else start))
            self._pending = None

    def _add(self, seconds: float) -> None:
        # The events' own clock may not be perf_counter's: the interval is placed ending now.
        now = time.perf_counter()
        self.seconds += seconds
        self.intervals.append((now - seconds, now))

    def _flush(self) -> None:
        if self._pending is not None:
            self._add(self._pending[1] - self._pending[0])
            self._pending = None

    def __enter__(self):
        monitoring.register_scalar_listener(self._on_phase_start)
        monitoring.register_event_time_span_listener(self._on_span)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_scalar_listener(self._on_phase_start)
        monitoring.unregister_event_time_span_listener(self._on_span)
        self._flush()


class RunStats:
    """What the bar, the table and the JSON show: the prompts finished in this run, with their
    generation totals kept as one ``GenerationStats`` (the same type every front end reports)."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens
        self.prompts = 0
        self.errors = 0
        self.finish = collections.Counter()
        self.failures = collections.Counter()   # why prompts failed: a short reason -> how many
        self.generation = GenerationStats.empty(num_draft_tokens)
        self.by_context = ContextBuckets()   # tau per context-length bucket
        self.started = time.perf_counter()
        self.load_seconds = 0.0
        self.compile = CompileClock()
        self.engine_compile_intervals: list[tuple[float, float]] = []
        self.draft_choice = None   # under --num-draft-tokens auto: the engine's latest DraftChoice

    @property
    def compile_seconds(self) -> float:
        # JAX's compile events, joined with the engine's calls that compiled (which also hold each
        # new program's first execution, about 0.5 s on a CPU, and auto's calibration): the length
        # of the union of both sets of intervals, so nothing counts twice.
        return union_length(self.compile.intervals + self.engine_compile_intervals)

    def add(self, finish_reason: str, stats: GenerationStats | None = None, failure: str | None = None,
            prompt_tokens: int | None = None) -> None:
        """One finished prompt: its finish reason, unless it failed before generating its stats, and
        for a failed prompt the short reason it is counted under in the summary."""
        self.prompts += 1
        if stats is not None and prompt_tokens is not None:
            self.by_context.add(prompt_tokens, stats)
        if stats is not None:
            seconds = self.generation.seconds
            self.generation = GenerationStats.combine([self.generation, stats])
            self.generation.seconds = seconds
        if finish_reason.startswith("error"):
            self.errors += 1
            self.finish["error"] += 1
            self.failures[failure or finish_reason] += 1
        else:
            self.finish[finish_reason] += 1

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def tick(self) -> None:
        """Generation time so far, compilations excluded."""
        self.generation.seconds = max(time.perf_counter() - self.started - self.compile_seconds, 0.0)

    @property
    def tokens(self) -> int:
        return self.generation.tokens

    @property
    def rounds(self) -> int:
        return self.generation.rounds

    @property
    def seconds(self) -> float:
        return self.generation.seconds

    @property
    def tau(self) -> float:
        return self.generation.mean_accept_length if self.num_draft_tokens else float("nan")

    @property
    def accept_rate_per_position(self) -> list[float]:
        return self.generation.accept_rate_per_position

    @property
    def tokens_per_second(self) -> float:
        return self.generation.tokens_per_second

    def postfix(self) -> str:
        parts = [f"{self.tokens_per_second:.1f} tok/s"]
        if self.num_draft_tokens:
            parts.append(f"tau {self.tau:.2f}")
        c = self.draft_choice
        if c is not None:
            measured = f"{c.measured_speedup:.2f}x" if math.isfinite(c.measured_speedup) else "?"
            parts.append(f"K={c.num_draft_tokens} (predicted {c.predicted_speedup:.2f}x, measured {measured})")
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)

    def failure_summary(self) -> str:
        """``2 prompt too long for max_len, 1 empty prompt``: why prompts failed, most common first."""
        return ", ".join(f"{n} {why}" for why, n in self.failures.most_common())


class Watchdog:
    """Runs the acceptance check as soon as enough rounds exist, then every ``interval`` seconds."""

    def __init__(self, num_draft_tokens: int, context: str, interval: float = 300.0,
                 pair: tuple[str, str] | None = None):
        self.num_draft_tokens = num_draft_tokens
        self.context = context
        self.pair = pair   # (target, draft) directories, named in the warning's doctor command
        self.interval = interval
        self.last = -math.inf

    def maybe_check(self, stats: RunStats) -> bool:
        now = time.perf_counter()
        if not self.num_draft_tokens or stats.rounds < WATCHDOG_MIN_ROUNDS or now - self.last < self.interval:
            return False
        self.last = now
        return check_acceptance(stats.generation, self.num_draft_tokens, self.context, self.pair)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def summary_table(stats: RunStats, already_done: int, skipped_lines: int) -> str:
    rate = stats.accept_rate_per_position
    rows = [
        ("prompts", f"{stats.prompts} this run ({stats.errors} errors), {already_done} already done"
                    + (f", {skipped_lines} bad lines skipped" if skipped_lines else "")),
        ("finish", ", ".join(f"{k} {v}" for k, v in sorted(stats.finish.items())) or "-"),
    ]
    if stats.errors:
        rows.append(("failed", f"{stats.errors}: {stats.failure_summary()}; a rerun retries them"))
    rows += [
        ("tokens", str(stats.tokens)),
        ("seconds", f"{_fmt(stats.seconds, 1)} generating, {_fmt(stats.compile_seconds, 1)} compiling, "
                    f"{_fmt(stats.load_seconds, 1)} loading"),
        ("tok/s", _fmt(stats.tokens_per_second, 1) + " (generating time only)"),
        ("tau", _fmt(stats.tau) if stats.num_draft_tokens else "- (no draft)"),
    ]
    if stats.num_draft_tokens:
        rows.append(("accept by position", "  ".join(f"{i + 1}:{_fmt(r)}" for i, r in enumerate(rate))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["serve summary"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def metrics_dict(stats: RunStats, already_done: int, skipped_lines: int, settings: dict) -> dict:
    def num(x):
        return x if isinstance(x, int) or math.isfinite(x) else None

    return {
        "prompts": stats.prompts, "errors": stats.errors, "already_done": already_done,
        "bad_lines_skipped": skipped_lines, "finish_reasons": dict(stats.finish), "failures": dict(stats.failures),
        "tokens": stats.tokens, "seconds": stats.seconds, "tokens_per_second": num(stats.tokens_per_second),
        "load_seconds": stats.load_seconds, "compile_seconds": stats.compile_seconds,
        "rounds": stats.rounds, "mean_accept_length": num(stats.tau),
        "accept_rate_per_position": [num(r) for r in stats.accept_rate_per_position],
        "tau_by_context": stats.by_context.as_dict(),
        "auto_draft": _choice_dict(stats.draft_choice, num),
        "settings": settings,
    }


def _choice_dict(c, num) -> dict | None:
    """What ``--num-draft-tokens auto`` chose (None with a fixed K): the K of the latest run, the round
    speedup over target-only predicted from calibrated and from live round costs, loop iterations
    per K, the live seconds per round per K and the calibration's cost."""
    if c is None:
        return None
    return {"num_draft_tokens": c.num_draft_tokens, "predicted_speedup": num(c.predicted_speedup),
            "measured_speedup": num(c.measured_speedup), "tau": num(c.tau),
            "iterations_per_k": {str(k): n for k, n in sorted(c.rounds_per_k.items())},
            "round_seconds_per_k": {str(k): num(r) for k, r in sorted(c.round_seconds_per_k.items())},
            "target_round_seconds": num(c.target_round_seconds),
            "calibration_seconds": c.calibration_seconds, "compiled_round_programs": c.compiled_programs}


def write_metrics(path: str, data: dict) -> None:
    write_json_atomic(path, data)
