"""What a serve run shows: live numbers for the progress bar, the periodic acceptance watchdog,
the final table and the ``--metrics`` JSON."""

from __future__ import annotations

import collections
import math
import time

from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.metrics import WATCHDOG_MIN_ROUNDS, GenerationStats, check_acceptance


class RunStats:
    """What the bar, the table and the JSON show: the prompts finished in this run, with their
    generation totals kept as one ``GenerationStats`` (the same type every front end reports)."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens
        self.prompts = 0
        self.errors = 0
        self.finish = collections.Counter()
        self.generation = GenerationStats.empty(num_draft_tokens)
        self.started = time.perf_counter()

    def add(self, finish_reason: str, stats: GenerationStats | None = None) -> None:
        """One finished prompt: its finish reason and, unless it failed before generating, its stats."""
        self.prompts += 1
        if stats is not None:
            seconds = self.generation.seconds
            self.generation = GenerationStats.combine([self.generation, stats])
            self.generation.seconds = seconds
        if finish_reason.startswith("error"):
            self.errors += 1
            self.finish["error"] += 1
        else:
            self.finish[finish_reason] += 1

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def tick(self) -> None:
        self.generation.seconds = time.perf_counter() - self.started

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
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)


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
        ("tokens", str(stats.tokens)),
        ("seconds", _fmt(stats.seconds, 1)),
        ("tok/s", _fmt(stats.tokens_per_second, 1)),
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
        "bad_lines_skipped": skipped_lines, "finish_reasons": dict(stats.finish),
        "tokens": stats.tokens, "seconds": stats.seconds, "tokens_per_second": num(stats.tokens_per_second),
        "rounds": stats.rounds, "mean_accept_length": num(stats.tau),
        "accept_rate_per_position": [num(r) for r in stats.accept_rate_per_position],
        "settings": settings,
    }


def write_metrics(path: str, data: dict) -> None:
    write_json_atomic(path, data)
