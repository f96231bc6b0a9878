"""What chooses K, the draft tokens per round, for each bounded run of the engine. A policy
(``FixedK``, ``autodraft.AutoDraft``) answers: the K of the next run (``next_k``), whether it holds
for the rows now running so the run may go to their end (``settled``), what a run taught it
(``observe``), that the job is over (``finish``), and what it decided, for metrics (``report``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """The rows before a run, as the policy sees them (``_B``: one entry per row of the batch)."""

    running_B: np.ndarray     # occupied rows (the just admitted ones included)
    admitted_B: np.ndarray    # rows admitted for this run; they are prefilled with the draft iff K >= 1
    drafted_B: np.ndarray     # rows whose draft state is current: admitted with the draft and not
    #                           advanced by a target-only run since (a draft on any other row only
    #                           proposes from a stale state)
    last_wave: bool           # no prompt is waiting: the rows running are the job's last

    @property
    def can_draft(self) -> bool:
        """Whether a K >= 1 could help any row: a just admitted row gets its draft state with it."""
        return bool((self.admitted_B | (self.drafted_B & self.running_B)).any())


@dataclass(frozen=True)
class Run:
    """One bounded run as it went: its admission, the loop's rounds and the harvest of its results.

    The per-row counts are this run's own (zero for rows that did not run). ``seconds`` is the wall
    time from the admission to the end of the harvest, ``admit_seconds`` its admission's share, or
    None when a program compiled during it (its time says nothing about decoding)."""

    k: int
    seconds: float | None
    admit_seconds: float | None
    iterations: int               # loop iterations (the slowest row's rounds)
    admitted: int                 # rows prefilled at its start
    taught_B: np.ndarray          # rows whose rounds speak for the draft (current draft state, K >= 1)
    rounds_B: np.ndarray          # verify rounds per row
    round_tokens_B: np.ndarray    # tokens the rounds emitted per row
    emitted_B: np.ndarray         # every token emitted per row (the admission's first token included)
    accepted_BK: np.ndarray       # rounds in which draft position j was accepted, per row

    @property
    def emitted(self) -> int:
        return int(self.emitted_B.sum())


class FixedK:
    """The policy of a fixed K: every run uses it, so it never needs to stop a run to choose again."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self, batch: Batch) -> int:
        return self.k

    def settled(self, batch: Batch) -> bool:
        return True

    def observe(self, run: Run) -> None:   # a fixed K learns nothing
        pass

    def finish(self) -> None:
        pass

    def report(self) -> None:
        return None
