"""The public Python surface: load_target, load_draft, save_draft, Generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from eagle3_jax.drafts import DraftOutput, LoadedDraft
from eagle3_jax.errors import ConfigError
from eagle3_jax.loading import (ForwardOutput, LoadedTarget, build_draft, build_target, load_draft, load_target,
                                save_draft)
from eagle3_jax.metrics import GenerationStats
from eagle3_jax.speculative.session import DecodeSession

__all__ = ["DraftOutput", "ForwardOutput", "GenerationResult", "Generator", "LoadedDraft", "LoadedTarget",
           "build_draft", "build_target", "load_draft", "load_target", "save_draft"]


# ====================================================================== generation
@dataclass
class GenerationResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats


class Generator:
    """Batch generation with an optional EAGLE-3 draft; ``draft=None`` is target-only decoding.

    One call of ``generate`` is one run of the refill ``Engine`` on ``batch_size`` rows (None: all
    prompts at once), K fixed or ``num_draft_tokens="auto"``. Greedy output equals target-only
    decoding whatever the rows and Ks."""

    def __init__(self, target: LoadedTarget, draft: LoadedDraft | None = None, num_draft_tokens: int | str = 4,
                 max_len: int = 2048, mesh=None, batch_size: int | None = None, max_draft_tokens: int | None = None,
                 prefill_chunk: int | None = None):
        if mesh is not None and target.mesh is not None and mesh is not target.mesh:
            raise ConfigError("Generator mesh differs from the mesh the target was loaded on; load it with mesh=...")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 (or None: one batch of all prompts), found {batch_size}")
        self.session = DecodeSession(target, draft, num_draft_tokens, max_len, max_draft_tokens, prefill_chunk)
        self.target, self.draft = target, draft
        self.num_draft_tokens = self.session.num_draft_tokens
        self.max_draft_tokens = self.session.max_draft_tokens
        self.max_len = max_len
        self.mesh = target.mesh
        self.batch_size = batch_size
        self.draft_choice = None   # under "auto": the latest DraftChoice (K, predicted vs measured speedup)
        self.last_compile_seconds = 0.0   # what the latest generate() spent compiling (left out of its tok/s)
        self.last_compiled_programs = 0   # how many programs it compiled (or loaded from the persistent cache)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 prompt_len: int | None = None, rounds_per_sync: int = 16) -> GenerationResult:
        """Generates for ``prompts`` (token id lists); results are in prompt order. Calls that pin one
        ``prompt_len`` share one admission program. ``rounds_per_sync``: rounds between refills
        while prompts wait, and between K choices under auto."""
        import time

        from eagle3_jax.speculative.engine import Engine, Request

        if not prompts:
            raise ConfigError("generate() got no prompts")
        rows = min(len(prompts), self.batch_size or len(prompts))
        engine = Engine(None, batch_size=rows, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, eos_token_ids=tuple(eos_token_ids), rounds_per_sync=rounds_per_sync,
                        session=self.session, prompt_len=prompt_len)
        start = time.perf_counter()
        by_key = {int(f.key): f for f in engine.run([Request(str(i), list(p)) for i, p in enumerate(prompts)])}
        done = [by_key[i] for i in range(len(prompts))]
        stats = GenerationStats.combine(f.stats for f in done)
        stats.seconds = time.perf_counter() - start - engine.compile_seconds   # compiles are not throughput
        self.draft_choice = engine.draft_choice
        self.last_compile_seconds = engine.compile_seconds
        self.last_compiled_programs = engine.compiled_programs
        return GenerationResult(tokens=[f.tokens for f in done], finish_reasons=[f.finish_reason for f in done],
                                stats=stats)
