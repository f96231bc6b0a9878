"""Continuous batching over the jitted loop: rows that finish are refilled with waiting prompts
between bounded runs of the loop, so one long answer does not hold a batch of finished rows hostage.

The host intervenes after ``rounds_per_sync`` rounds, or earlier, as soon as ``refill_rows`` rows
have finished while prompts are waiting: it reads which rows finished, hands their results out,
and prefills waiting prompts into the freed rows (``admit_rows``: only those
rows are prefilled, then written into the running state). Rows never interact, so each prompt's
output is what it would be alone. ``Generator.generate`` is one ``Engine.run`` too: a static batch is
simply a run whose prompts all fit at once.

K per run comes from a policy (``DecodeSession.policy``): a fixed K, or ``AutoDraft``, which is
told how each run went (its rounds, seconds and acceptance) and picks the next run's K.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.distributed import fetch_all
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import GenerationStats, check_acceptance, compile_log
from eagle3_jax.speculative.autodraft import AutoDraft, DraftChoice, Wave
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
        longest admitted prompt's bucket, see ``session.bucket_prompt_len``). Pinned, one admission
        program serves every prompt; else each prompt bucket compiles its own."""
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
        self.policy = None
        # (start, end) perf_counter times of the calls that compiled a program (tracing and
        # compiling, until the call returned) or probed auto's round costs: what throughput leaves out.
        self.compile_intervals: list[tuple[float, float]] = []
        self.compiled_programs = 0   # programs those calls compiled (or loaded from the persistent cache)

    @property
    def stats(self) -> GenerationStats:
        """Totals over every prompt finished so far; ``seconds`` is the wall time of the runs."""
        return self.session.stats

    @property
    def draft_choice(self) -> DraftChoice | None:
        """Under ``num_draft_tokens="auto"``: the K of the latest run, predicted vs measured speedup."""
        return self.policy.report() if self.policy is not None else None

    @property
    def compile_seconds(self) -> float:
        return sum(end - start for start, end in self.compile_intervals)

    def _call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; when the call compiled (JAX's compile events, ``metrics.compile_log``),
        its time until it returned joins ``compile_intervals``: tracing and compiling, not the
        execution, which dispatch leaves running."""
        log = compile_log()
        before = log.count
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if log.count != before:
            self.compile_intervals.append((t, time.perf_counter()))
            self.compiled_programs += log.count - before
            self.session.compiled_programs += log.count - before
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
        if self.policy is None:   # under auto, a new shape probes its round costs here
            self.policy = self._call(session.policy, program, sp, self.sampling)
        policy = self.policy
        auto = isinstance(policy, AutoDraft)
        # A sized collection (a list of requests) says when the last one has been admitted, so a
        # single wave is known as one before its first run; an iterator only once it runs dry (no
        # look-ahead: that would take a request before a row is free for it).
        total = len(requests) if hasattr(requests, "__len__") else None
        pending = iter(requests)
        admitted_count = 0
        occupant: list[Request | None] = [None] * self.batch_size
        # Per-row counters after the previous run (admitted rows restart at zero): the policy's deltas.
        seen_rounds_B = np.zeros(self.batch_size, np.int64)
        seen_acc_BK = np.zeros((self.batch_size, max(self.max_draft_tokens, 1)), np.int64)
        seen_tokens_B = np.zeros(self.batch_size, np.int64)
        # Each row's own acceptance since admission and what it has left to emit: the last wave's
        # pricing (autodraft.Wave).
        row_acc_BK, row_off_BK = np.zeros_like(seen_acc_BK), np.zeros_like(seen_acc_BK)
        left_B = np.zeros(self.batch_size, np.int64)
        # Rows whose draft state is current: admitted with the draft and not advanced by a
        # target-only run since. Only they teach acceptance, and only they can speculate usefully.
        drafted_B = np.zeros(self.batch_size, bool)
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
                    admitted_count += len(new)
                    exhausted = len(new) < len(free) or admitted_count == total
                if all(o is None for o in occupant):
                    break
                running = np.array([o is not None for o in occupant])
                if new:   # a new row has its whole budget (at most) ahead and no counts yet
                    left_B[list(new)] = program.max_new_tokens
                    for arr in (row_acc_BK, row_off_BK):
                        arr[list(new)] = 0
                # K is chosen before admitting, so that rows admitted for a target-only run skip the
                # draft's prefill: K = 0 then costs what having no draft costs.
                wave = Wave(left_B[running], row_acc_BK[running], row_off_BK[running]) if auto and exhausted else None
                k = policy.next_k(drafted_rows=bool(new) or bool((drafted_B & running).any()),
                                  all_new=bool(new) and int(running.sum()) == len(new), wave=wave)
                if new:
                    admitted = list(new.items())
                    for i in range(0, len(admitted), self.max_admit_rows):
                        state = self._admit(models if k else target_models, state,
                                            dict(admitted[i:i + self.max_admit_rows]), sp)
                    for arr in (seen_rounds_B, seen_tokens_B, seen_acc_BK):
                        arr[list(new)] = 0
                    drafted_B[list(new)] = k > 0
                    if auto:
                        jax.block_until_ready(state)   # the run's timing leaves the admission out
                # Nothing left to admit and K fixed for the rest (a fixed K, or target-only on rows
                # without a current draft state): one run to the end, no syncs. Else a bounded run,
                # which with prompts waiting ends once refill_rows more rows are free.
                final = exhausted and (not auto or not (drafted_B & running).any())
                max_rounds = program.max_new_tokens if final else self.rounds_per_sync
                stop_free = self.batch_size + 1 if exhausted else self.batch_size - int(running.sum()) + self.refill_rows
                compiles = len(self.compile_intervals)
                t = time.perf_counter()
                # host scalars, not jnp ones: an eager jnp.int32 is a dispatch of its own (~0.25 ms)
                state = self._call(run_rounds, *(models if k else target_models), state, np.int32(max_rounds),
                                   np.int32(stop_free), sp, program=program.with_draft_tokens(k))
                finish, rounds_B, tokens_B, acc_BK, n_out_B, budget_B = (np.asarray(x, np.int64) for x in fetch_all(
                    state.finish_B, state.rounds_B, state.round_tokens_B, state.accepted_BK, state.n_out_B,
                    state.budget_B))
                left_B = budget_B - n_out_B
                seconds = time.perf_counter() - t if compiles == len(self.compile_intervals) else 0.0
                taught_B = drafted_B & running if k else running
                d_rounds_B = rounds_B - seen_rounds_B
                policy.observe(k, int(d_rounds_B.max()), seconds, int(d_rounds_B[taught_B].sum()),
                               int((tokens_B - seen_tokens_B)[taught_B].sum()), (acc_BK - seen_acc_BK)[taught_B].sum(0))
                if k:   # position j was offered in the rounds that accepted j-1 (j = 0: every round)
                    d_acc_BK = np.where(taught_B[:, None], acc_BK - seen_acc_BK, 0)[:, :k]
                    row_acc_BK[:, :k] += d_acc_BK
                    row_off_BK[:, :k] += np.concatenate([np.where(taught_B, d_rounds_B, 0)[:, None],
                                                         d_acc_BK[:, :-1]], axis=1)
                seen_rounds_B, seen_tokens_B, seen_acc_BK = rounds_B, tokens_B, acc_BK
                if k == 0:
                    drafted_B[running] = False   # their target-only rounds did not reach the draft
                done = [b for b, req in enumerate(occupant) if req is not None and finish[b] != RUNNING]
                if auto:
                    policy.rows_finished(row_acc_BK[done], row_off_BK[done])
                for b, (tokens, reason, stats) in zip(done, session.row_results(state, done,
                                                                               program.max_draft_tokens)):
                    fin = Finished(key=occupant[b].key, tokens=tokens, finish_reason=reason, stats=stats)
                    occupant[b] = None
                    session.record(stats)
                    session.stats.seconds = seconds_before + time.perf_counter() - start
                    yield fin
        if auto:
            check_acceptance(policy.speculative_stats(), self.max_draft_tokens, context="batch generation")
        elif self.draft is not None:
            check_acceptance(self.stats, self.num_draft_tokens, context="batch generation")
