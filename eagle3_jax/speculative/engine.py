"""Continuous batching over the jitted loop: rows that finish are refilled with waiting prompts
between bounded runs of the loop, so one long answer does not hold a batch of finished rows hostage.

After ``rounds_per_sync`` rounds, or as soon as ``refill_rows`` rows have finished while prompts
wait, the host hands out the finished rows' results and prefills waiting prompts into only the freed
rows (``admit_rows``). Rows never interact, so each prompt's output is what it would be alone.
Before each run the K policy (policy.py) sees the rows (``policy.Batch``), after it what each row
did (``policy.Run``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.distributed import broadcast_json, fetch, fetch_all
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import CompileTally, GenerationStats, check_acceptance, compile_log
from eagle3_jax.speculative.generate import RUNNING, admit_rows, blank_state, run_rounds
from eagle3_jax.speculative.policy import Batch, Run
from eagle3_jax.speculative.session import DecodeSession, SamplingSettings, bucket_prompt_len, target_only


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


def admission_calls(n: int, whole: int, part: int) -> list[int]:
    """Rows per prefill call (padding included) that admit ``n`` rows: a call of ``whole`` rows (the
    batch, or ``max_admit_rows``) while it would be more than half used, then calls of ``part`` (the
    refill size). An engine so compiles two admission programs per prompt block, not one per power
    of two up to the batch: each is a compile of the whole target, and a few rows admitted together
    are the rare case (a bounded run ends once ``part`` rows are free). Where ``whole`` is not a power
    of two this can pad more than that rule did (13 rows of 24: one 24-row call, not 16)."""
    calls = []
    while n > 0:
        calls.append(whole if n > whole // 2 else part)
        n -= calls[-1]
    return calls


class Engine:
    """Continuous batching: a thin front end over ``DecodeSession`` that keeps ``batch_size`` rows busy.

    ``num_draft_tokens="auto"`` re-chooses K before every bounded run (autodraft.py); the choice and
    how it went are in ``draft_choice``."""

    def __init__(self, target, draft=None, num_draft_tokens: int | str = 4, max_len: int = 2048, batch_size: int = 8,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, eos_token_ids: Sequence[int] = (), rounds_per_sync: int = 16,
                 max_draft_tokens: int | None = None, session: DecodeSession | None = None,
                 max_admit_rows: int | None = None, prefill_chunk: int | None = None,
                 prompt_len: int | None = None, calibration=None, k_table: dict[int, int] | None = None):
        """``session``: run on an existing session (its target, draft and K setting; the arguments
        naming them are then ignored), so statistics and acceptance carry over. ``max_admit_rows``:
        the most rows one prefill call admits, which bounds the prefill's fresh caches (None: the
        whole batch). ``prompt_len``: every admission pads its prompts to this length, so one
        admission program serves every prompt (None: the longest admitted prompt's bucket).
        ``prefill_chunk``, ``calibration``, ``k_table``: see ``DecodeSession``."""
        if rounds_per_sync < 1:
            raise ConfigError(f"rounds_per_sync must be >= 1, found {rounds_per_sync}")
        if max_admit_rows is not None and max_admit_rows < 1:
            raise ConfigError(f"max_admit_rows must be >= 1, found {max_admit_rows}")
        self.session = session or DecodeSession(target, draft, num_draft_tokens, max_len, max_draft_tokens,
                                                 prefill_chunk, calibration, k_table)
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, found {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)
        self.sampling = SamplingSettings(temperature, top_p, top_k, seed, tuple(eos_token_ids))
        self.program = self.session.program(batch_size)
        self.batch_size = self.program.batch_size
        self.max_draft_tokens = self.session.max_draft_tokens
        self.rounds_per_sync = rounds_per_sync
        self.max_admit_rows = min(max_admit_rows or self.batch_size, self.batch_size)
        # Rows freed per refill while prompts wait: one at a time keeps every row busy; at large
        # batches a few at a time saves syncs and admission calls.
        self.refill_rows = max(1, self.batch_size // 8)
        self.prompt_len = prompt_len
        self.policy = None
        # The rounds with K >= 1 of rows whose draft state was current: what the acceptance-collapse
        # watchdog judges (rounds that could not accept anything would hide a collapse or fake one).
        self.speculative_stats = GenerationStats.empty(self.max_draft_tokens)
        self._compile_mark: int | None = None   # compile_log().count when the first run started

    @property
    def stats(self) -> GenerationStats:
        """Totals over every prompt finished so far; ``seconds`` is the wall time of the runs."""
        return self.session.stats

    @property
    def draft_choice(self):
        """Under ``num_draft_tokens="auto"``: the policy's report (autodraft.DraftChoice); else None."""
        return self.policy.report() if self.policy is not None else None

    @property
    def compiles(self) -> CompileTally:
        """What this engine's runs compiled or loaded from the persistent cache, and for how long."""
        return compile_log().since(self._compile_mark) if self._compile_mark is not None else CompileTally()

    @property
    def compile_seconds(self) -> float:
        return self.compiles.seconds

    @property
    def compiled_programs(self) -> int:
        return self.compiles.programs

    def _admit(self, models, state, new: dict[int, list[int]], sp):
        """Prefills only the admitted rows, in calls of ``admission_calls`` rows each, at the prompt
        block ``session.admission_blocks`` picks; the padding entries point past the last row and are
        dropped."""
        pending, log, blocks = list(new.items()), compile_log(), self.session.admission_blocks
        for A in admission_calls(len(pending), self.max_admit_rows, min(self.refill_rows, self.max_admit_rows)):
            part, pending = dict(pending[:A]), pending[A:]
            rows = list(part) + [self.batch_size] * (A - len(part))
            prompts = dict(enumerate(part.values()))
            shape = (self.program, models[2] is not None, A, bucket_prompt_len(max(map(len, prompts.values())),
                                                                               self.session.max_len))
            # process 0's block on every process: the timings behind it differ, the program called must not
            T = self.prompt_len or broadcast_json(blocks.block(*shape))
            ids, lengths, _ = self.session.pack_prompts(prompts, A, T)
            mark, t = log.count, time.perf_counter()
            state = jax.block_until_ready(admit_rows(*models, state, np.asarray(rows, np.int32), ids, lengths, sp,
                                                     program=self.program))
            if self.prompt_len is None:
                blocks.ran(*shape, T, time.perf_counter() - t, log.since(mark).seconds if log.count > mark else None)
        return state

    def _first_admission(self, new: dict[int, list[int]]) -> tuple[int, int]:
        """(rows per call, prompt block) of a job's first admission, whose prompts are ``new``: where
        an auto job's cost probe admits, so that the probe compiles the job's first admission
        programs instead of two of its own."""
        first = list(new.values())[:self.max_admit_rows]
        return self.max_admit_rows, self.prompt_len or bucket_prompt_len(max(map(len, first)), self.session.max_len)

    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Yields each request's result as soon as its row finishes (completion order)."""
        session, program, B = self.session, self.program, self.batch_size
        log = compile_log()
        if self._compile_mark is None:
            self._compile_mark = log.count
        mark = log.count
        models = session.models()
        # target-only runs and admissions are called without the draft's weights (admit_rows, run_rounds)
        target_models = target_only(models)
        sp = self.sampling.traced(self.max_new_tokens)
        # A sized collection (a list of requests) says when the last one has been admitted, so a
        # single wave is known as one before its first run; an iterator only once it runs dry (no
        # look-ahead: that would take a request before a row is free for it).
        total = len(requests) if hasattr(requests, "__len__") else None
        pending = iter(requests)
        admitted_count = 0
        occupant: list[Request | None] = [None] * B
        # Per-row counters after the previous run (admitted rows restart at zero): each run's own counts.
        seen = {name: np.zeros(B, np.int64) for name in ("rounds", "round_tokens", "emitted")}
        seen["accepted"] = np.zeros((B, max(self.max_draft_tokens, 1)), np.int64)
        drafted_B = np.zeros(B, bool)   # rows whose draft state is current (policy.Batch)
        start = time.perf_counter()
        seconds_before = session.stats.seconds
        try:
            with session.activate():
                state = blank_state(*models, jax.random.key(self.sampling.seed), sp, program=program)
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
                    running_B = np.array([o is not None for o in occupant])
                    admitted_B = np.zeros(B, bool)
                    admitted_B[list(new)] = True
                    batch = Batch(running_B, admitted_B, drafted_B & ~admitted_B, exhausted)
                    if self.policy is None:   # made once the first prompts are in: see _first_admission
                        self.policy = session.policy(program, self.sampling, self.max_new_tokens,
                                                     self._first_admission(new), sp)
                    policy = self.policy
                    # K is chosen before admitting, so that rows admitted for a target-only run skip the
                    # draft's prefill: K = 0 then costs what having no draft costs.
                    k, settled = policy.next_k(batch), policy.settled(batch)
                    # Process 0's choice on every process: a policy's rests on timings, which differ
                    # between processes; the programs run and their lengths must not.
                    k, settled = broadcast_json([int(k), bool(settled)])
                    compiles, t = log.count, time.perf_counter()
                    if new:
                        state = self._admit(models if k else target_models, state, new, sp)
                        for counts in seen.values():
                            counts[admitted_B] = 0
                    admit_seconds = time.perf_counter() - t
                    taught_B = (drafted_B | admitted_B) & running_B if k else np.zeros(B, bool)
                    drafted_B = (drafted_B | admitted_B) & running_B if k else drafted_B & ~running_B
                    # The policy's K holding for these rows (and nothing left to admit): one run to the
                    # end, no syncs. Else a bounded run, which with prompts waiting ends once
                    # refill_rows more rows are free.
                    final = exhausted and settled
                    max_rounds = self.max_new_tokens if final else self.rounds_per_sync
                    stop_free = B + 1 if exhausted else B - int(running_B.sum()) + self.refill_rows
                    # host scalars, not jnp ones: an eager jnp.int32 is a dispatch of its own (~0.25 ms)
                    state = run_rounds(*(models if k else target_models), state, np.int32(max_rounds),
                                       np.int32(stop_free), sp, program=program.with_draft_tokens(k))
                    finish, rounds_B, round_tokens_B, acc_BK, n_out_B = (
                        np.asarray(x, np.int64) for x in fetch_all(state.finish_B, state.rounds_B, state.round_tokens_B,
                                                                   state.accepted_BK, state.n_out_B))
                    done = [b for b, req in enumerate(occupant) if req is not None and finish[b] != RUNNING]
                    now = {"rounds": rounds_B, "round_tokens": round_tokens_B, "emitted": n_out_B, "accepted": acc_BK}
                    delta = {name: np.where(running_B.reshape((B,) + (1,) * (x.ndim - 1)), x - seen[name], 0)
                             for name, x in now.items()}
                    seen = now
                    # The tokens (B x capacity) cross to the host only when a row has finished.
                    results = session.row_results(fetch(state.tokens_BN), dict(now, finish=finish), done,
                                                  program.max_draft_tokens) if done else []
                    timed = log.count == compiles
                    run = Run(k=k, seconds=time.perf_counter() - t if timed else None,
                              admit_seconds=admit_seconds if timed else None,
                              iterations=int(delta["rounds"].max()), admitted=len(new), taught_B=taught_B,
                              rounds_B=delta["rounds"], round_tokens_B=delta["round_tokens"],
                              emitted_B=delta["emitted"], accepted_BK=delta["accepted"])
                    policy.observe(run)
                    self._record_speculation(run)
                    for b, (tokens, reason, stats) in zip(done, results):
                        fin = Finished(key=occupant[b].key, tokens=tokens, finish_reason=reason, stats=stats)
                        occupant[b] = None
                        session.stats = GenerationStats.combine([session.stats, stats])
                        session.stats.seconds = seconds_before + time.perf_counter() - start
                        yield fin
            if self.policy is not None:
                self.policy.finish()
            if session.draft is not None:
                check_acceptance(self.speculative_stats, self.max_draft_tokens, context="batch generation")
        finally:
            session.compiled_programs += log.count - mark

    def _record_speculation(self, run: Run) -> None:
        taught = run.taught_B
        if run.k and taught.any():
            tokens = int(run.round_tokens_B[taught].sum())
            self.speculative_stats = GenerationStats.combine([self.speculative_stats, GenerationStats(
                rounds=int(run.rounds_B[taught].sum()), tokens=tokens, round_tokens=tokens, seconds=0.0,
                accepted_per_position=[int(a) for a in run.accepted_BK[taught].sum(0)])])
