"""What a serve run shows: live numbers for the progress bar, the periodic acceptance watchdog,
the final table and the ``--metrics`` JSON."""

from __future__ import annotations

import collections
import math
import time

from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.metrics import WATCHDOG_MIN_ROUNDS, GenerationStats, check_acceptance


class RunStats:
    """Totals over the prompts finished in this run (what the bar, the table and the JSON show)."""

    def __init__(self, num_draft_tokens: int):
        self.k = num_draft_tokens
        self.prompts = 0
        self.errors = 0
        self.tokens = 0
        self.rounds = 0
        self.round_tokens = 0
        self.accepted = [0] * num_draft_tokens
        self.finish = collections.Counter()
        self.started = time.perf_counter()
        self.seconds = 0.0

    def add(self, num_tokens: int, finish_reason: str, rounds: int = 0, round_tokens: int = 0,
            accepted_per_position=()) -> None:
        self.prompts += 1
        self.tokens += num_tokens
        self.rounds += rounds
        self.round_tokens += round_tokens
        for i, a in enumerate(list(accepted_per_position)[: self.k]):
            self.accepted[i] += int(a)
        if finish_reason.startswith("error"):
            self.errors += 1
            self.finish["error"] += 1
        else:
            self.finish[finish_reason] += 1

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def tick(self) -> None:
        self.seconds = time.perf_counter() - self.started

    def as_generation_stats(self) -> GenerationStats:
        return GenerationStats(rounds=self.rounds, tokens=self.tokens, round_tokens=self.round_tokens,
                               seconds=self.seconds, accepted_per_position=list(self.accepted))

    @property
    def tau(self) -> float:
        return self.round_tokens / self.rounds if self.k and self.rounds else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def postfix(self) -> str:
        parts = [f"{self.tokens_per_second:.1f} tok/s"]
        if self.k:
            parts.append(f"tau {self.tau:.2f}")
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)


class Watchdog:
    """Runs the acceptance check as soon as enough rounds exist, then every ``interval`` seconds."""

    def __init__(self, num_draft_tokens: int, context: str, interval: float = 300.0):
        self.k = num_draft_tokens
        self.context = context
        self.interval = interval
        self.last = -math.inf

    def maybe_check(self, stats: RunStats) -> bool:
        now = time.perf_counter()
        if not self.k or stats.rounds < WATCHDOG_MIN_ROUNDS or now - self.last < self.interval:
            return False
        self.last = now
        return check_acceptance(stats.as_generation_stats(), self.k, self.context)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def summary_table(stats: RunStats, already_done: int, skipped_lines: int) -> str:
    rate = [a / stats.rounds if stats.rounds else float("nan") for a in stats.accepted]
    rows = [
        ("prompts", f"{stats.prompts} this run ({stats.errors} errors), {already_done} already done"
                    + (f", {skipped_lines} bad lines skipped" if skipped_lines else "")),
        ("finish", ", ".join(f"{k} {v}" for k, v in sorted(stats.finish.items())) or "-"),
        ("tokens", str(stats.tokens)),
        ("seconds", _fmt(stats.seconds, 1)),
        ("tok/s", _fmt(stats.tokens_per_second, 1)),
        ("tau", _fmt(stats.tau) if stats.k else "- (no draft)"),
    ]
    if stats.k:
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
        "accept_rate_per_position": [a / stats.rounds if stats.rounds else None for a in stats.accepted],
        "settings": settings,
    }


def write_metrics(path: str, data: dict) -> None:
    write_json_atomic(path, data)
