"""What a serve run shows: live numbers for the progress bar, the periodic acceptance watchdog,
the final table and the ``--metrics`` JSON.

Time is split three ways so that tokens per second means decoding speed: ``load_seconds`` (reading
the models), ``compile_seconds`` (XLA compilations during generation, from JAX's compile events) and
the rest of the generation wall time, ``seconds``.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time

from eagle3_jax.metrics import WATCHDOG_MIN_ROUNDS, CompileTally, GenerationStats, check_acceptance, compile_log
from eagle3_jax.train_serve import ContextBuckets


class RunStats:
    """What the bar, the table and the JSON show: the prompts finished in this run, with their
    generation totals kept as one ``GenerationStats`` (the same type every front end reports)."""

    def __init__(self, num_draft_tokens: int, pair: tuple[str, str] | None = None):
        self.num_draft_tokens = num_draft_tokens
        self.pair = pair   # (target, draft) directories: the doctor's command line names them
        self.prompts = 0
        self.errors = 0
        self.finish = collections.Counter()
        self.failures = collections.Counter()   # why prompts failed: a short reason -> how many
        self.generation = GenerationStats.empty(num_draft_tokens)
        self.by_context = ContextBuckets()   # tau per context-length bucket
        self.started = time.perf_counter()
        self.load_seconds = 0.0
        self._compile_mark: int | None = None   # compile_log().count when generation started
        self.draft_choice = None   # under --num-draft-tokens auto: the engine's latest DraftChoice

    @property
    def compiles(self) -> CompileTally:
        """What generation compiled or loaded from the compile cache (metrics.CompileLog)."""
        return compile_log().since(self._compile_mark) if self._compile_mark is not None else CompileTally()

    @property
    def compile_seconds(self) -> float:
        return self.compiles.seconds

    @contextlib.contextmanager
    def compiling(self, on_trace):
        """While active, ``on_trace()`` is called whenever JAX starts tracing (a compile follows)."""
        log = compile_log()
        log.on_trace.append(on_trace)
        try:
            yield
        finally:
            log.on_trace.remove(on_trace)

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
        self._compile_mark = compile_log().count

    def tick(self) -> None:
        """Generation time so far, compilations excluded."""
        self.generation.seconds = max(time.perf_counter() - self.started - self.compile_seconds, 0.0)

    @property
    def tau(self) -> float:
        return self.generation.mean_accept_length if self.num_draft_tokens else float("nan")

    def postfix(self) -> str:
        parts = [f"{self.generation.tokens_per_second:.1f} tok/s"]
        c = self.draft_choice
        if c is not None:
            measured = f", measured {c.measured_speedup:.2f}x" if c.measured_speedup is not None else ""
            parts.append(f"K={c.num_draft_tokens} (tau {c.tau:.2f}, predicted {c.predicted_speedup:.2f}x{measured})")
        elif self.num_draft_tokens:
            parts.append(f"tau {self.tau:.2f}")
        verdict = speculation_verdict(self)
        if verdict is not None and verdict["costs_time"]:
            parts.append("SLOWER than target-only, see the summary")
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)

    def failure_summary(self) -> str:
        """``2 prompt too long for max_len, 1 empty prompt``: why prompts failed, most common first."""
        return ", ".join(f"{n} {why}" for why, n in self.failures.most_common())


# Below this τ a draft costs time on any backend: a round drafts K tokens and verifies K + 1, so it
# costs more than a target step, while emitting little more than the one token a step emits.
SLOW_TAU = 1.3


def speculation_verdict(stats: RunStats) -> dict | None:
    """Whether the draft is making this run slower than target-only would be, why, and what to do
    (None: no draft, or too few rounds to say). A fixed K is judged by τ; auto by its measured
    rates (target-only's and the current K's, both run here) and by whether it gave up drafting."""
    if not stats.num_draft_tokens:
        return None
    c = stats.draft_choice
    if c is not None:
        drafted = sum(n for k, n in c.rounds_per_k.items() if k)
        if c.measured_speedup is not None and c.measured_speedup < 1.0:
            why = (f"K={c.num_draft_tokens} measured {c.measured_speedup:.2f}x target-only's tokens per second "
                   f"in this run (tau {c.tau:.2f})")
        elif c.num_draft_tokens == 0 and drafted:
            tried = ", ".join(f"K={k}" for k in sorted(c.rounds_per_k) if k)
            return {"costs_time": False, "reason": f"auto found that drafting does not pay here ({tried} ran "
                    f"{drafted} iterations) and decodes target-only", "advice": _advice(stats)}
        else:
            return {"costs_time": False, "reason": None, "advice": None}
    elif stats.generation.rounds < WATCHDOG_MIN_ROUNDS:
        return None
    elif stats.tau < SLOW_TAU:
        why = (f"tau {stats.tau:.2f} with K={stats.num_draft_tokens}: a round emits little more than the one token "
               "a target step emits, and costs more")
    else:
        return {"costs_time": False, "reason": None, "advice": None}
    return {"costs_time": True, "reason": f"speculation is costing time: {why}", "advice": _advice(stats)}


def _advice(stats: RunStats) -> str:
    from eagle3_jax.metrics import doctor_command

    doctor = doctor_command(*stats.pair) if stats.pair else "python -m tools.doctor --target T --draft D"
    return (f"serve target-only with --num-draft-tokens 0; check the pair's wiring with `{doctor}`; "
            "or train the draft longer (a draft that accepts more pays at more batch sizes)")


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
        if (not self.num_draft_tokens or stats.generation.rounds < WATCHDOG_MIN_ROUNDS
                or now - self.last < self.interval):
            return False
        self.last = now
        return check_acceptance(stats.generation, self.num_draft_tokens, self.context, self.pair)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def summary_table(stats: RunStats, already_done: int, skipped_lines: int) -> str:
    g = stats.generation
    rows = [
        ("prompts", f"{stats.prompts} this run ({stats.errors} errors), {already_done} already done"
                    + (f", {skipped_lines} bad lines skipped" if skipped_lines else "")),
        ("finish", ", ".join(f"{k} {v}" for k, v in sorted(stats.finish.items())) or "-"),
    ]
    if stats.errors:
        rows.append(("failed", f"{stats.errors}: {stats.failure_summary()}; a rerun retries them"))
    rows += [
        ("tokens", str(g.tokens)),
        ("seconds", f"{_fmt(g.seconds, 1)} generating, {_fmt(stats.compile_seconds, 1)} compiling, "
                    f"{_fmt(stats.load_seconds, 1)} loading"),
        ("tok/s", _fmt(g.tokens_per_second, 1) + " (generating time only)"),
        ("tau", _fmt(stats.tau) if stats.num_draft_tokens else "- (no draft)"),
    ]
    if stats.num_draft_tokens:
        rates = g.accept_rate_per_position
        rows.append(("accept by position", "  ".join(f"{i + 1}:{_fmt(r)}" for i, r in enumerate(rates))))
    verdict = speculation_verdict(stats)
    if verdict is not None and verdict["reason"]:
        rows.append(("speculation", f"{verdict['reason']}. What to do: {verdict['advice']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["serve summary"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def metrics_dict(stats: RunStats, already_done: int, skipped_lines: int, settings: dict) -> dict:
    def num(x):
        return x if isinstance(x, int) or math.isfinite(x) else None

    g = stats.generation
    return {
        "prompts": stats.prompts, "errors": stats.errors, "already_done": already_done,
        "bad_lines_skipped": skipped_lines, "finish_reasons": dict(stats.finish), "failures": dict(stats.failures),
        "tokens": g.tokens, "seconds": g.seconds, "tokens_per_second": num(g.tokens_per_second),
        "load_seconds": stats.load_seconds, "compile_seconds": stats.compile_seconds,
        "compiles": stats.compiles.as_dict(),
        "rounds": g.rounds, "mean_accept_length": num(stats.tau),
        "accept_rate_per_position": [num(r) for r in g.accept_rate_per_position],
        "tau_by_context": stats.by_context.as_dict(),
        "auto_draft": _choice_dict(stats.draft_choice, num),
        "speculation": speculation_verdict(stats),
        "settings": settings,
    }


def _choice_dict(c, num) -> dict | None:
    """What ``--num-draft-tokens auto`` chose (None with a fixed K): the K of the latest run and the
    table's K it started from, the speedup over target-only predicted by its model and measured
    (tokens per wall second at K over those at K = 0, both run in this job; null when either did
    not run), loop iterations per K, live seconds per round per K and the probe's cost."""
    if c is None:
        return None
    return {"num_draft_tokens": c.num_draft_tokens, "start_k": c.start_k, "table_source": c.table_source,
            "predicted_speedup": num(c.predicted_speedup),
            "measured_speedup": num(c.measured_speedup) if c.measured_speedup is not None else None,
            "tau": num(c.tau), "iterations_per_k": {str(k): n for k, n in sorted(c.rounds_per_k.items())},
            "explored_iterations": c.explored_rounds, "switches": c.switches,
            "round_seconds_per_k": {str(k): num(r) for k, r in sorted(c.round_seconds_per_k.items())},
            "target_round_seconds": num(c.target_round_seconds), "calibration_seconds": c.calibration_seconds}
