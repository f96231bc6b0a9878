"""What the training loop says on stderr: its phases with their timings, and (without a progress
bar) a line every ``log_every`` steps with the loss, accuracy, throughput and time left."""

from __future__ import annotations

import logging

from eagle3_jax import distributed

log = logging.getLogger("eagle3_jax")


def info(msg: str, *args) -> None:
    """A progress line, from process 0 only (every process runs the same loop)."""
    if distributed.is_writer():
        log.info(msg, *args)


def duration(seconds: float) -> str:
    if seconds != seconds:   # NaN: no steady-state step timed yet
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class StepReport:
    """Per-step timing for steps ``first..end``; the first one compiles the training step, so the
    time left is estimated from the later ones only."""

    def __init__(self, first: int, end: int, total: int, log_every: int, plain: bool):
        self.first, self.end, self.total, self.log_every, self.plain = first, end, total, log_every, plain
        self.steady_steps, self.steady_time = 0, 0.0

    def step(self, step: int, seconds: float, m: dict) -> None:
        if step == self.first:
            info("step %d took %.1fs (compiling the training step)", step, seconds)
        else:
            self.steady_steps += 1
            self.steady_time += seconds
        if self.plain and (step % self.log_every == 0 or step == self.end):
            left = self.steady_time / self.steady_steps * (self.end - step) if self.steady_steps else float("nan")
            info("step %d/%d  loss %.4f  acc %s  %.0f tok/s  ETA %s", step, self.total, m["loss"],
                 " ".join(f"{a:.2f}" for a in m["acc"]), m["tokens_per_s"], duration(left))
