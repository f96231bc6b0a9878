"""Continuous batching over the jitted loop: rows that finish are refilled with waiting prompts
between bounded runs of the loop, so one long answer does not hold a batch of finished rows hostage.

The host intervenes after ``rounds_per_sync`` rounds, or earlier, as soon as ``refill_rows`` rows
have finished while prompts are waiting: it reads which rows finished, hands their results out,
and prefills waiting prompts into the freed rows (``admit_rows``: only those
rows are prefilled, then written into the running state). Rows never interact, so each prompt's
output is what it would be alone.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.distributed import fetch, fetch_all
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import GenerationStats, check_acceptance
from eagle3_jax.speculative.autodraft import DraftChoice
from eagle3_jax.speculative.generate import RUNNING, admit_rows, blank_state, run_rounds
from eagle3_jax.speculative.session import DecodeSession, SamplingSettings


@dataclass(frozen=True)
class Request:
    key: str
    prompt: Sequence[int]


@dataclass
class Finished:
    key: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats   # this prompt's own rounds, tokens and per-position acceptance

    @property
    def rounds(self) -> int:
        return self.stats.rounds

    @property
    def round_tokens(self) -> int:
        return self.stats.round_tokens

    @property
    def accepted_per_position(self) -> list[int]:
        return self.stats.accepted_per_position

    @property
    def accept_length(self) -> float:
        return self.stats.mean_accept_length


class Engine:
    """Continuous batching: a thin front end over ``DecodeSession`` that keeps ``batch_size`` rows busy.

    ``num_draft_tokens="auto"`` re-chooses K before every bounded run (autodraft.py); the choice and
    how it went are in ``draft_choice``."""

    def __init__(self, target, draft=None, num_draft_tokens: int | str = 4, max_len: int = 2048, batch_size: int = 8,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, eos_token_ids: Sequence[int] = (), rounds_per_sync: int = 16,
                 max_draft_tokens: int | None = None, session: DecodeSession | None = None,
                 max_admit_rows: int | None = None, prefill_chunk: int | None = None,
                 prompt_len: int | None = None):
        """``session``: run on an existing session (its target, draft and K setting; the arguments
        naming them are then ignored), e.g. a Generator's, so statistics and acceptance carry over.
        ``max_admit_rows``: the most rows one prefill call admits (more free rows are filled by
        several calls); it bounds the prefill's fresh caches, which hold that many rows (None: the
        whole batch). ``python -m tools.plan --admit-rows`` plans the same. ``prefill_chunk``: see
        ``DecodeSession``. ``prompt_len``: every admission pads its prompts to this length (None: the
        longest admitted prompt's bucket). Pinned, one admission program serves every prompt; else
        each prompt bucket compiles its own (measured on the demo pair: three programs for four
        prompts at batch 1, ~3.5 s each to trace and load from the compilation cache)."""
        if rounds_per_sync < 1:
            raise ConfigError(f"rounds_per_sync must be >= 1, found {rounds_per_sync}")
        if max_admit_rows is not None and max_admit_rows < 1:
            raise ConfigError(f"max_admit_rows must be >= 1, found {max_admit_rows}")
        self.session = session or DecodeSession(target, draft, num_draft_tokens, max_len, max_draft_tokens,
                                                 prefill_chunk)
        self.target, self.draft = self.session.target, self.session.draft
        self.sampling = SamplingSettings(temperature, top_p, top_k, seed, tuple(eos_token_ids))
        self.program = self.session.program(batch_size, max_new_tokens, self.sampling)
        self.batch_size = self.program.batch_size
        self.max_len = self.session.max_len
        self.num_draft_tokens = self.session.num_draft_tokens
        self.max_draft_tokens = self.session.max_draft_tokens
        self.rounds_per_sync = rounds_per_sync
        self.max_admit_rows = min(max_admit_rows or self.batch_size, self.batch_size)
        # Rows freed per refill while prompts wait: one at a time keeps every row busy; at large
        # batches a few at a time saves syncs and admission calls.
        self.refill_rows = max(1, self.batch_size // 8)
        self.prompt_len = prompt_len
        self._auto = None
        # (start, end) perf_counter times of the calls that compiled a program (until the call
        # returned: tracing and compiling) and of auto's calibration: what throughput leaves out.
        self.compile_intervals: list[tuple[float, float]] = []

    @property
    def stats(self) -> GenerationStats:
        """Totals over every prompt finished so far; ``seconds`` is the wall time of the runs."""
        return self.session.stats

    @property
    def draft_choice(self) -> DraftChoice | None:
        """Under ``num_draft_tokens="auto"``: the K of the latest run, predicted vs measured speedup."""
        return self._auto.report() if self._auto is not None else None

    @property
    def compile_seconds(self) -> float:
        return sum(end - start for start, end in self.compile_intervals)

    def _call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` for a jitted ``fn``; when the call compiled a new program, the call's
        time until it returned joins ``compile_intervals``: tracing and compiling, not the execution,
        which dispatch leaves running. The first execution is real work: leaving it out of a
        throughput figure would flatter the pass in which a program first ran (a whole bounded run
        at batch 32)."""
        before = fn._cache_size()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if fn._cache_size() != before:
            self.compile_intervals.append((t, time.perf_counter()))
        return out

    def _admit(self, models, state, new: dict[int, list[int]], sp):
        """Prefills only the admitted rows: A = the next power of two >= len(new) (capped at the
        batch), so admissions compile at most log2(batch) + 1 programs per prompt bucket (twice
        under auto: with and without the draft); the padding entries point past the last row and
        are dropped."""
        A = min(1 << (len(new) - 1).bit_length(), self.batch_size)
        rows = list(new) + [self.batch_size] * (A - len(new))
        ids, lengths, _ = self.session.pack_prompts(dict(enumerate(new.values())), A, self.prompt_len)
        return self._call(admit_rows, *models, state, np.asarray(rows, np.int32), ids, lengths, sp, program=self.program)

    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Yields each request's result as soon as its row finishes (completion order)."""
        session, program = self.session, self.program
        models = session.models()
        # target-only runs and admissions are called without the draft's weights (admit_rows, run_rounds)
        target_models = models[:2] + (None, None)
        sp = self.sampling.traced()
        if session.auto and self._auto is None:
            t = time.perf_counter()
            self._auto = session.autodraft(program, sp, self.sampling)
            if (setup := self._auto.claim_setup_seconds()):   # calibrated or read from disk just now
                self.compile_intervals.append((t, t + setup))
        auto = self._auto
        # A sized collection (a list of requests) says when the last one has been admitted, so a
        # single wave is known as one before its first run; an iterator only once it runs dry (no
        # look-ahead: that would take a request before a row is free for it).
        total = len(requests) if hasattr(requests, "__len__") else None
        pending = iter(requests)
        admitted_count = 0
        occupant: list[Request | None] = [None] * self.batch_size
        # Per-row counters after the previous run (admitted rows restart at zero): auto's deltas.
        seen_rounds_B = np.zeros(self.batch_size, np.int64)
        seen_tokens_B = np.zeros(self.batch_size, np.int64)
        seen_acc_BK = np.zeros((self.batch_size, max(self.max_draft_tokens, 1)), np.int64)
        # Rows whose draft state is current: admitted with the draft and not advanced by a
        # target-only run since. Under auto, only they teach acceptance (autodraft.AutoDraft.observe).
        drafted_B = np.zeros(self.batch_size, bool)
        # Under auto: the one K each row has run since its admission (-1: none yet, -2: several), and
        # the tokens it has left (its budget less what it emitted by the previous run).
        row_k_B = np.full(self.batch_size, -1, np.int64)
        left_B = np.zeros(self.batch_size, np.int64)
        wave_B = np.zeros(self.batch_size, np.int64)   # which admission (loop iteration) filled each row
        cycle = None   # under auto: (K, start, tokens per taught row, compiles so far) of the open cycle
        start = time.perf_counter()
        seconds_before = session.stats.seconds
        with session.activate():
            state = self._call(blank_state, *models, jax.random.key(self.sampling.seed), sp, program=program)
            exhausted = False
            while True:
                free = [b for b, o in enumerate(occupant) if o is None]
                new = {}
                if free and not exhausted:
                    for b, req in zip(free, itertools.islice(pending, len(free))):
                        session.check_prompt(req.prompt, f"request {req.key!r}: prompt")
                        occupant[b] = req
                        new[b] = list(req.prompt)
                        left_B[b] = min(program.max_new_tokens, self.max_len - len(req.prompt))
                        row_k_B[b] = -1
                        wave_B[b] = auto.runs if auto is not None else 0
                    admitted_count += len(new)
                    exhausted = len(new) < len(free) or admitted_count == total
                if all(o is None for o in occupant):
                    break
                running = np.array([o is not None for o in occupant])
                occupied = int(running.sum())
                # K is chosen before admitting, so that rows admitted for a target-only run skip the
                # draft's prefill: K = 0 then costs what having no draft costs.
                if auto is not None:
                    # One wave (every row admitted together, none waiting) ends with its slowest row:
                    # priced as such. Rows admitted at different times (a refill's tail) finish at
                    # different times anyway, and the per-row model prices them as measured.
                    wave = exhausted and len(set(wave_B[running].tolist())) == 1
                    k = auto.next_k(drafted_rows=bool(new) or bool((drafted_B & running).any()),
                                    remaining=left_B[running] if wave else None)
                else:
                    k = program.num_draft_tokens
                if new:
                    admitted = list(new.items())
                    for i in range(0, len(admitted), self.max_admit_rows):
                        state = self._admit(models if k else target_models, state,
                                            dict(admitted[i:i + self.max_admit_rows]), sp)
                    for arr in (seen_rounds_B, seen_tokens_B, seen_acc_BK):
                        arr[list(new)] = 0
                    drafted_B[list(new)] = k > 0
                if auto is not None:
                    jax.block_until_ready(state)   # time the run alone
                t = time.perf_counter()
                if cycle is not None and cycle[3] == len(self.compile_intervals):
                    # the previous run's cycle ends here: its results handed out, its rows refilled
                    auto.observe_cycle(cycle[0], cycle[2], t - cycle[1])
                compiles = len(self.compile_intervals)
                # With prompts waiting, the run ends once refill_rows more rows are free, so they are
                # refilled instead of idling until the slowest row's run ends.
                # An exploration run of auto's always runs its full length, so that it is long enough
                # to time (RoundCosts.observe).
                full = exhausted or (auto is not None and auto.last_was_exploration)
                stop_free = self.batch_size + 1 if full else self.batch_size - occupied + self.refill_rows
                # host scalars, not jnp ones: an eager jnp.int32 is a dispatch of its own (~0.25 ms)
                state = self._call(run_rounds, *(models if k else target_models), state,
                                   np.int32(self.rounds_per_sync), np.int32(stop_free), sp,
                                   program=program.with_draft_tokens(k))
                if auto is None:
                    finish = fetch(state.finish_B)
                else:
                    finish, rounds_B, tokens_B, acc_BK, n_out_B, budget_B = fetch_all(
                        state.finish_B, state.rounds_B, state.round_tokens_B, state.accepted_BK, state.n_out_B,
                        state.budget_B)
                    left_B = np.maximum(budget_B.astype(np.int64) - n_out_B, 0)
                    row_k_B[running] = np.where(row_k_B[running] == -1, k,
                                                np.where(row_k_B[running] == k, k, -2))
                    rounds_B, tokens_B, acc_BK = (x.astype(np.int64) for x in (rounds_B, tokens_B, acc_BK))
                    # a run that compiled is timed as 0 s: its rounds still teach acceptance
                    seconds = time.perf_counter() - t if compiles == len(self.compile_intervals) else 0.0
                    d_rounds_B = rounds_B - seen_rounds_B
                    d_tokens_B = tokens_B - seen_tokens_B
                    # acceptance, and the wall clock of speculation, from rows drafting from a current state
                    taught_B = drafted_B & running if k else running
                    auto.observe(k, int(d_rounds_B.max()), seconds, int(d_rounds_B[taught_B].sum()),
                                 int(d_tokens_B[taught_B].sum()), (acc_BK - seen_acc_BK)[taught_B].sum(0))
                    seen_rounds_B, seen_tokens_B, seen_acc_BK = rounds_B, tokens_B, acc_BK
                    cycle = (k, t, d_tokens_B[taught_B].sum() / max(int(taught_B.sum()), 1), compiles)
                if k == 0:
                    drafted_B[running] = False   # their target-only rounds did not reach the draft
                done = [b for b, req in enumerate(occupant) if req is not None and finish[b] != RUNNING]
                for b, (tokens, reason, stats) in zip(done, session.row_results(state, done,
                                                                               program.max_draft_tokens)):
                    fin = Finished(key=occupant[b].key, tokens=tokens, finish_reason=reason, stats=stats)
                    if auto is not None and row_k_B[b] > 0 and drafted_B[b] and stats.rounds:
                        auto.observe_prompt(int(row_k_B[b]), stats.mean_accept_length)
                    occupant[b] = None
                    session.record(stats)
                    session.stats.seconds = seconds_before + time.perf_counter() - start
                    yield fin
        if auto is not None:
            check_acceptance(auto.speculative_stats(), self.max_draft_tokens, context="batch generation")
        elif self.draft is not None:
            check_acceptance(self.stats, self.num_draft_tokens, context="batch generation")
