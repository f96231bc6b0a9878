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
import numpy as np

from eagle3_jax.distributed import fetch
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import GenerationStats, check_acceptance
from eagle3_jax.speculative.generate import (FINISH_NAMES, RUNNING, Sampling, admit_rows, blank_state, run_rounds)


@dataclass(frozen=True)
class Request:
    key: str
    prompt: Sequence[int]


@dataclass
class Finished:
    key: str
    tokens: list[int]
    finish_reason: str
    rounds: int
    round_tokens: int
    accepted_per_position: list[int]

    @property
    def accept_length(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else float("nan")


class Engine:
    def __init__(self, target, draft=None, num_draft_tokens: int = 4, max_len: int = 2048, batch_size: int = 8,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, eos_token_ids: Sequence[int] = (), rounds_per_sync: int = 16):
        if draft is not None and draft.target is not target:
            raise ConfigError("the draft was loaded for a different target object; pass target=... to load_draft")
        if batch_size < 1 or max_new_tokens < 1 or rounds_per_sync < 1:
            raise ConfigError(
                f"batch_size={batch_size}, max_new_tokens={max_new_tokens}, rounds_per_sync={rounds_per_sync}: "
                "each must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ConfigError(f"sampling settings out of range: temperature={temperature} (>= 0), "
                              f"top_p={top_p} (0, 1], top_k={top_k} (>= 0)")
        self.target, self.draft = target, draft
        self.mesh = target.mesh
        data = self.mesh.shape["data"] if self.mesh is not None else 1
        self.batch_size = -(-batch_size // data) * data
        self.max_len = max_len
        self.rounds_per_sync = rounds_per_sync
        self.num_draft = num_draft_tokens if draft is not None else 0
        self.greedy = temperature == 0.0
        self.sampling = Sampling(jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p),
                                 jnp.asarray(list(eos_token_ids) or [-1], jnp.int32))
        self.static = dict(num_draft=self.num_draft, max_new=int(max_new_tokens), capacity=max_len,
                           aux_ids=draft.aux_layer_ids if draft else (), greedy=self.greedy)
        self.seed = seed
        self.stats = GenerationStats(rounds=0, tokens=0, round_tokens=0, seconds=0.0,
                                     accepted_per_position=[0] * self.num_draft)

    def _models(self):
        d = self.draft
        return (self.target.graphdef, self.target.state, d.graphdef if d else None, d.state if d else None)

    def _prompt_batch(self, prompts: dict[int, Sequence[int]]):
        B = self.batch_size
        T = min(-(-max(len(p) for p in prompts.values()) // 16) * 16, self.max_len - 1)
        ids = np.zeros((B, T), np.int32)
        lengths = np.ones((B,), np.int32)
        admit = np.zeros((B,), bool)
        for b, p in prompts.items():
            ids[b, :len(p)] = p
            lengths[b] = len(p)
            admit[b] = True
        return jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(admit)

    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Yields each request's result as soon as its row finishes (completion order)."""
        from eagle3_jax.api import mesh_context

        pending = iter(requests)
        occupant: list[Request | None] = [None] * self.batch_size
        models = self._models()
        start = time.perf_counter()
        with mesh_context(self.mesh):
            state = blank_state(*models, self.batch_size, jax.random.key(self.seed), self.sampling, **self.static)
            exhausted = False
            while True:
                free = [b for b, o in enumerate(occupant) if o is None]
                new = {}
                if free and not exhausted:
                    for b, req in zip(free, itertools.islice(pending, len(free))):
                        if not 1 <= len(req.prompt) < self.max_len:
                            raise ConfigError(
                                f"request {req.key!r}: prompt has {len(req.prompt)} tokens; it must have between 1 "
                                f"and max_len - 1 = {self.max_len - 1}")
                        occupant[b] = req
                        new[b] = list(req.prompt)
                    exhausted = len(new) < len(free)
                if new:
                    state = admit_rows(*models, state, *self._swap(self._prompt_batch(new)), self.sampling,
                                       **self.static)
                if all(o is None for o in occupant):
                    break
                state = run_rounds(*models, state, jnp.int32(self.rounds_per_sync), self.sampling, **self.static)
                finish, n_out, tokens, rounds, round_tokens, accepted = (fetch(x) for x in (
                    state.finish_B, state.n_out_B, state.tokens_BN, state.rounds_B, state.round_tokens_B,
                    state.accepted_BK))
                for b, req in enumerate(occupant):
                    if req is None or finish[b] == RUNNING:
                        continue
                    occupant[b] = None
                    fin = Finished(key=req.key, tokens=tokens[b, : n_out[b]].tolist(),
                                   finish_reason=FINISH_NAMES.get(int(finish[b]), "error"), rounds=int(rounds[b]),
                                   round_tokens=int(round_tokens[b]),
                                   accepted_per_position=[int(a) for a in accepted[b, : self.num_draft]])
                    self._account(fin, time.perf_counter() - start)
                    yield fin
        if self.draft is not None:
            check_acceptance(self.stats, self.num_draft, context="batch generation")

    @staticmethod
    def _swap(batch):
        ids, lengths, admit = batch
        return admit, ids, lengths

    def _account(self, fin: Finished, elapsed: float) -> None:
        s = self.stats
        s.rounds += fin.rounds
        s.tokens += len(fin.tokens)
        s.round_tokens += fin.round_tokens
        s.seconds = elapsed
        s.accepted_per_position = [a + b for a, b in zip(s.accepted_per_position, fin.accepted_per_position)]
        s.per_row_accept_length.append(fin.accept_length)
