"""Continuous batching over the jitted loop: rows that finish are refilled with waiting prompts
between bounded runs of the loop, so one long answer does not hold a batch of finished rows hostage.

The host only intervenes every ``rounds_per_sync`` rounds: it reads which rows finished, hands
their results out, and prefills waiting prompts into the freed rows (``admit_rows``). Rows never
interact, so each prompt's output is what it would be alone.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp

from eagle3_jax.distributed import fetch
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import GenerationStats, check_acceptance
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
    """Continuous batching: a thin front end over ``DecodeSession`` that keeps ``batch_size`` rows busy."""

    def __init__(self, target, draft=None, num_draft_tokens: int = 4, max_len: int = 2048, batch_size: int = 8,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, eos_token_ids: Sequence[int] = (), rounds_per_sync: int = 16):
        if rounds_per_sync < 1:
            raise ConfigError(f"rounds_per_sync must be >= 1, found {rounds_per_sync}")
        self.session = DecodeSession(target, draft, num_draft_tokens, max_len)
        self.target, self.draft = target, draft
        self.sampling = SamplingSettings(temperature, top_p, top_k, seed, tuple(eos_token_ids))
        self.program = self.session.program(batch_size, max_new_tokens, self.sampling)
        self.batch_size = self.program.batch_size
        self.max_len = max_len
        self.num_draft_tokens = self.session.num_draft_tokens
        self.rounds_per_sync = rounds_per_sync

    @property
    def stats(self) -> GenerationStats:
        """Totals over every prompt finished so far; ``seconds`` is the wall time of the runs."""
        return self.session.stats

    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Yields each request's result as soon as its row finishes (completion order)."""
        session, program = self.session, self.program
        models = session.models()
        sp = self.sampling.traced()
        pending = iter(requests)
        occupant: list[Request | None] = [None] * self.batch_size
        start = time.perf_counter()
        seconds_before = session.stats.seconds
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
                    exhausted = len(new) < len(free)
                if new:
                    ids, lengths, admit = session.pack_prompts(new, self.batch_size)
                    state = admit_rows(*models, state, jnp.asarray(admit), jnp.asarray(ids), jnp.asarray(lengths),
                                       sp, program=program)
                if all(o is None for o in occupant):
                    break
                state = run_rounds(*models, state, jnp.int32(self.rounds_per_sync), sp, program=program)
                finish = fetch(state.finish_B)
                done = [b for b, req in enumerate(occupant) if req is not None and finish[b] != RUNNING]
                for b, (tokens, reason, stats) in zip(done, session.row_results(state, done,
                                                                               program.num_draft_tokens)):
                    fin = Finished(key=occupant[b].key, tokens=tokens, finish_reason=reason, stats=stats)
                    occupant[b] = None
                    session.record(stats)
                    session.stats.seconds = seconds_before + time.perf_counter() - start
                    yield fin
        if self.draft is not None:
            check_acceptance(self.stats, self.num_draft_tokens, context="batch generation")
