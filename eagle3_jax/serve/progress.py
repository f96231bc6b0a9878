"""What the batch job says while it runs: a progress bar when stderr is a terminal (a log file would
keep its redraws as frames on one line), else a log line every ``PLAIN_EVERY_S`` seconds and at the end."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

log = logging.getLogger("eagle3_jax")

PLAIN_EVERY_S = 10.0


def wants_bar(no_progress: bool) -> bool:
    return not no_progress and sys.stderr.isatty()


class Progress:
    """``note(text)``: what is happening now (a compile); ``advance(status)``: one prompt done.
    ``quiet``: says nothing (the processes other than 0 of a multi-host run)."""

    def __init__(self, total: int, bar: bool, quiet: bool = False):
        self.total, self.done, self.bar, self.quiet = total, 0, None, quiet
        self._stack = contextlib.ExitStack()
        self._last_line = time.perf_counter()
        self._last_note = None
        if bar and not quiet:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._stack.enter_context(logging_redirect_tqdm())
            self.bar = self._stack.enter_context(tqdm(total=total, unit="prompt", desc="serve",
                                                      dynamic_ncols=True, mininterval=0.5))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)
        elif text != self._last_note and not self.quiet:
            log.info("serve: %s", text)
        self._last_note = text

    def advance(self, status: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.quiet:
            return
        if self.done == self.total or now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            log.info("serve: %d/%d prompts, %s", self.done, self.total, status)
