"""One decode session: a target, an optional draft and the settings of the programs they run.

``Generator`` (one static batch) and ``Engine`` (refilled rows) are thin front ends over a
``DecodeSession``, which decides once what both need: sampling ranges, that the draft belongs to
the target, batch padding to the mesh's data axis, prompt-length buckets, the mesh context, the
K policy and the statistics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.distributed import fetch
from eagle3_jax.errors import ConfigError
from eagle3_jax.metrics import GenerationStats
from eagle3_jax.sharding import axis_size, mesh_context
from eagle3_jax.speculative.autodraft import AUTO, DEFAULT_MAX_DRAFT_TOKENS, Acceptance, AutoDraft, Costs
from eagle3_jax.speculative.calibration import CalibrationStore
from eagle3_jax.speculative.generate import FINISH_NAMES, DecodeProgram, Sampling
from eagle3_jax.speculative.policy import FixedK
from eagle3_jax.speculative.static_graph import StaticGraph

# Prompts are right-padded to a bucket, so nearby lengths share one compiled program. Buckets grow
# geometrically from PROMPT_BUCKET (16, 24, 32, 48, 64, 96, ...), so there are O(log max_len) of
# them and a prompt is padded by < 50 %.
PROMPT_BUCKET = 16
# AdmissionBlocks: the most an admission pads its prompts' bucket to reuse a compiled block.
PAD_TO_COMPILED = 2
# ``probe_costs``: PROBE_REPEATS interleaved admissions and runs of PROBE_ROUNDS rounds per K of ``probe_ks``.
PROBE_ROUNDS = 8
PROBE_REPEATS = 3
PROBE_KS = (0, 1, 2)


def probe_ks(max_draft_tokens: int, batch_size: int) -> list[int]:
    """PROBE_KS, and at batch 1 the largest K too, so that every K up to it is priced between
    measured ones. Above batch 1 a loop iteration lasts as long as its slowest row, a tail the
    per-token rate leaves out and that grows with K (benchmarks/RESULTS.md, serve_paired): there
    it prices only up to K = 2 unless its own runs measured more."""
    top = {max_draft_tokens} if batch_size == 1 else set()
    return sorted({k for k in PROBE_KS if k <= max_draft_tokens} | top)


@dataclass(frozen=True)
class SamplingSettings:
    """What a user sets; ``traced()`` turns it into the loop's traced ``Sampling`` scalars."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature >= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(
                f"sampling settings out of range: temperature={self.temperature} (>= 0), top_p={self.top_p} "
                f"(0, 1], top_k={self.top_k} (>= 0)")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def traced(self, max_new_tokens: int) -> Sampling:
        return Sampling(jnp.float32(max(self.temperature, 1e-6)), jnp.int32(self.top_k), jnp.float32(self.top_p),
                        jnp.asarray(list(self.eos_token_ids) or [-1], jnp.int32), jnp.bool_(self.greedy),
                        jnp.int32(max_new_tokens))


def bucket_prompt_len(longest: int, max_len: int) -> int:
    """The padded prompt length: the smallest bucket >= ``longest`` (capped at max_len - 1)."""
    bucket = PROMPT_BUCKET
    while bucket < longest:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return min(bucket, max_len - 1)


class AdmissionBlocks:
    """Which prompt block an admission runs at. Each (rows, block, with the draft or not) is a program
    of the whole target; refills, a prompt or two at a time at varied lengths, would compile one per
    bucket they meet. So an admission pads its prompts to a block already compiled, at most
    PAD_TO_COMPILED times its own bucket, until the padding of that shape has cost as much prefill
    time as the last admission compile took (a rent-or-buy rule: a long job pays at most one compile's
    worth of padding per shape before it compiles the shape's own block, a short one no compile)."""

    def __init__(self):
        self.compiled: dict[tuple, set[tuple[int, int]]] = {}   # (program, drafted) -> {(rows, block)}
        self.padding: dict[tuple, float] = {}   # (program, drafted, rows, bucket) -> seconds padded so far
        self.compile_seconds = math.inf   # the last admission compile's (none seen yet: pad)

    def block(self, program, drafted: bool, rows: int, bucket: int) -> int:
        """The smallest fitting block compiled for these rows; else (a compile either way) the smallest
        fitting one of another row count, the lengths this session met; else ``bucket``."""
        if self.padding.get((program, drafted, rows, bucket), 0.0) >= self.compile_seconds:
            return bucket
        fits = {(a == rows, T) for a, T in self.compiled.get((program, drafted), ())
                if bucket <= T <= PAD_TO_COMPILED * bucket}
        own = [T for same, T in fits if same]
        return min(own) if own else min((T for _, T in fits), default=bucket)

    def ran(self, program, drafted: bool, rows: int, bucket: int, block: int, seconds: float,
            compiled_seconds: float | None) -> None:
        """An admission at ``block`` took ``seconds``; ``compiled_seconds``: what compiling it took
        (None: nothing was compiled). Prefill time is taken as proportional to the block."""
        self.compiled.setdefault((program, drafted), set()).add((rows, block))
        if compiled_seconds is not None:
            self.compile_seconds = compiled_seconds
        elif block > bucket:
            key = (program, drafted, rows, bucket)
            self.padding[key] = self.padding.get(key, 0.0) + seconds * (block - bucket) / block


def target_only(models: tuple) -> tuple:
    """``DecodeSession.models()`` without the draft: what target-only runs and admissions are called with."""
    return models[:2] + (None, None, None)


class DecodeSession:
    """A target and an optional draft, validated once, with the mesh and statistics their programs share."""

    def __init__(self, target, draft=None, num_draft_tokens: int | str = 4, max_len: int = 2048,
                 max_draft_tokens: int | None = None, prefill_chunk: int | None = None,
                 calibration: CalibrationStore | None = None, k_table: dict[int, int] | None = None):
        """``num_draft_tokens``: K per round, or ``"auto"`` (K in 0..max_draft_tokens chosen from
        costs and acceptance measured end to end, see autodraft.py; ``max_draft_tokens`` defaults
        to 6). Under auto, ``calibration`` keeps what jobs of this pair measured for the next one
        (None: nothing is kept, every new shape is probed) and ``k_table`` (batch size -> K) gives
        the first K of a batch size instead.
        ``prefill_chunk``: prompt positions per target call in prefill (None: the whole prompt block;
        a chunk bounds prefill temporaries and never changes the tokens)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 (or None), found {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if draft is not None and draft.target is not target:
            raise ConfigError("the draft was loaded for a different target object; pass target=... to load_draft")
        self.auto = num_draft_tokens == AUTO and draft is not None
        if num_draft_tokens == AUTO:
            max_draft_tokens = DEFAULT_MAX_DRAFT_TOKENS if max_draft_tokens is None else max_draft_tokens
            if max_draft_tokens < 1:
                raise ConfigError(f"max_draft_tokens must be >= 1, found {max_draft_tokens}")
        elif not isinstance(num_draft_tokens, (int, np.integer)) or isinstance(num_draft_tokens, bool):
            raise ConfigError(f"num_draft_tokens must be an integer or 'auto', found {num_draft_tokens!r}")
        elif draft is not None and num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1 with a draft (or 'auto'), found {num_draft_tokens}")
        else:
            max_draft_tokens = int(num_draft_tokens)
        if max_len < 2:
            raise ConfigError(f"max_len must be >= 2, found {max_len}")
        block = getattr(draft.config, "block_size", None) if draft is not None else None
        if block is not None and max_draft_tokens > block - 1:   # a block draft (DFlash): one pass, block - 1 guesses
            raise ConfigError(f"num_draft_tokens (or max_draft_tokens) {max_draft_tokens} exceeds what this block "
                              f"draft guesses in a pass, block_size - 1 = {block - 1}; ask for at most that")
        self.target = target
        self.draft = draft
        # The setting as given ("auto" or K; 0 without a draft) and the largest K any round may use.
        self.num_draft_tokens = num_draft_tokens if draft is not None else 0
        self.max_draft_tokens = max_draft_tokens if draft is not None else 0
        self.max_len = max_len
        self.mesh = target.mesh
        self.stats = GenerationStats.empty(self.max_draft_tokens)
        # Under auto: acceptance per sampling setting (greedy and T = 1 accept very differently),
        # costs per batch shape (autodraft.Costs).
        self._acceptance: dict[tuple, Acceptance] = {}
        self._costs: dict[tuple, Costs] = {}
        self.admission_blocks = AdmissionBlocks()
        self.calibration = calibration
        self.k_table = {int(b): int(k) for b, k in (k_table or {}).items()}
        self._static = None   # the graphdefs as StaticGraph, made on first use
        # Programs compiled (or loaded from the persistent cache) by this session's calls.
        self.compiled_programs = 0

    # ---------------------------------------------------------------- settings
    def activate(self):
        """The mesh context every program of this session runs in."""
        return mesh_context(self.mesh)

    def program(self, batch_size: int) -> DecodeProgram:
        """The program of one batch shape (rows rounded up to a multiple of the mesh's data axis); its
        K is the fixed K, or K_max under auto (whose runs switch with ``program.with_draft_tokens``)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, found {batch_size}")
        data = axis_size(self.mesh, "batch")
        return DecodeProgram(
            batch_size=-(-batch_size // data) * data, max_len=self.max_len,
            num_draft_tokens=self.max_draft_tokens, max_draft_tokens=self.max_draft_tokens,
            prefill_chunk=self.prefill_chunk)

    def policy(self, program: DecodeProgram, sampling: SamplingSettings, max_new_tokens: int,
               admission: tuple[int, int] | None = None, traced: Sampling | None = None):
        """What chooses K for each run of one job on this program: ``FixedK``, or under auto an
        ``AutoDraft`` on the session's costs of this batch shape and greedy-or-sampled, and its
        acceptance of this sampling setting across batch shapes. Both start from the calibration
        when there is one; a shape without is probed, once per session, admitting as ``admission``
        says (``probe_costs``) with the job's ``traced`` sampling scalars (default: made here; the
        scalars must be the job's own, as ones made inside a mesh context are committed to the
        mesh, which makes every program they enter another program)."""
        if not self.auto:
            return FixedK(program.num_draft_tokens)
        shape = (program, sampling.greedy)
        setting = (sampling.temperature, sampling.top_p, sampling.top_k)
        store = self.calibration
        shape_key, setting_key = CalibrationStore.shape_key(program, sampling.greedy), CalibrationStore.setting_key(sampling)
        if setting not in self._acceptance:
            self._acceptance[setting] = acc = Acceptance(max(self.max_draft_tokens, 1))
            if store is not None and (carried := store.acceptance(setting_key)):
                acc.carry(carried["accepted"], carried["offered"])
        if shape not in self._costs:
            record = store.costs(shape_key) if store is not None else None
            ks = probe_ks(self.max_draft_tokens, program.batch_size)
            sp = traced if traced is not None else sampling.traced(max_new_tokens)
            self._costs[shape] = Costs.from_record(record) if record else probe_costs(self, program, sp, ks, admission)
        on_update = (lambda policy: store.update(shape_key, setting_key, policy)) if store is not None else None
        return AutoDraft(self._costs[shape], self.max_draft_tokens, self._acceptance[setting], program.batch_size,
                         max_new_tokens, self.k_table.get(program.batch_size), on_update)

    def models(self) -> tuple:
        """(target graphdef, target state, draft graphdef, draft state, aux layer ids): the loop's
        leading arguments (graphdefs wrapped once per session as ``StaticGraph``, so a call does not
        rehash them; the ids traced, so drafts wired to other layers share the programs)."""
        d = self.draft
        if self._static is None:
            self._static = (StaticGraph(self.target.graphdef), StaticGraph(d.graphdef) if d else None)
        return (self._static[0], self.target.state, self._static[1], d.state if d else None,
                np.asarray(d.aux_layer_ids, np.int32) if d else None)

    # ---------------------------------------------------------------- prompts
    def check_prompt(self, prompt: Sequence[int], name: str = "a prompt") -> None:
        if not 1 <= len(prompt) < self.max_len:
            raise ConfigError(f"{name} has {len(prompt)} tokens; it must have between 1 and max_len - 1 = "
                              f"{self.max_len - 1} (raise max_len)")

    def pack_prompts(self, prompts: dict[int, Sequence[int]], batch_size: int, prompt_len: int | None = None):
        """Prompts by row -> right-padded ids [batch_size, T], lengths [B] and the rows given [B].

        T is the longest prompt's bucket, or ``prompt_len`` when given (batches that pin one
        prompt_len share one compiled program)."""
        if not prompts:
            raise ConfigError("no prompts to generate for")
        for row, p in prompts.items():
            self.check_prompt(p, f"prompt {row}")
        longest = max(len(p) for p in prompts.values())
        T = bucket_prompt_len(longest, self.max_len)
        if prompt_len is not None:
            if not longest <= prompt_len < self.max_len:
                raise ConfigError(f"prompt_len={prompt_len} must hold the longest prompt ({longest} tokens) and "
                                  f"be below max_len={self.max_len}")
            T = prompt_len
        ids = np.zeros((batch_size, T), np.int32)
        lengths = np.ones((batch_size,), np.int32)
        given = np.zeros((batch_size,), bool)
        for row, p in prompts.items():
            ids[row, :len(p)] = p
            lengths[row] = len(p)
            given[row] = True
        return ids, lengths, given

    # ---------------------------------------------------------------- results
    def row_results(self, tokens_BN: np.ndarray, host: dict, rows: Sequence[int], num_draft_tokens: int):
        """Per-row results from host copies of a loop state (``tokens_BN`` and ``host``'s "emitted",
        "finish", "rounds", "round_tokens", "accepted"): a list of (tokens, finish reason,
        GenerationStats of that row) for each row in ``rows``."""
        n_out, finish, rounds, round_tokens, accepted = (
            host[k] for k in ("emitted", "finish", "rounds", "round_tokens", "accepted"))
        out = []
        for b in rows:
            stats = GenerationStats(
                rounds=int(rounds[b]), tokens=int(n_out[b]), round_tokens=int(round_tokens[b]), seconds=0.0,
                accepted_per_position=[int(a) for a in accepted[b, :num_draft_tokens]],
                per_row_accept_length=[float(round_tokens[b] / rounds[b]) if rounds[b] else float("nan")])
            out.append((tokens_BN[b, : n_out[b]].tolist(), FINISH_NAMES.get(int(finish[b]), "error"), stats))
        return out


def probe_costs(session, program, sp, ks, admission: tuple[int, int] | None = None) -> Costs:
    """Times ``ks`` on a scratch state of ``program``, admission and rounds each: one untimed pass
    per K (it compiles), then PROBE_REPEATS interleaved ones, the fewest seconds of each (other load
    on the machine only ever adds time). Random prompts: a MoE round costs what its distinct
    experts cost; identical rows would be too cheap.

    ``admission``: (rows per prefill call, prompt block) of the job's admissions (None: the whole
    batch at the smallest bucket). Each admission program is a compile of the whole target, so the
    probe fills every row in calls of the job's shape, and the job's first admission then runs a
    program the probe compiled; the prompts stay PROMPT_BUCKET tokens long, so the rounds are timed
    from the same positions at any block."""
    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds

    start = time.perf_counter()
    models = session.models()
    B = program.batch_size
    A, T = admission or (B, min(PROMPT_BUCKET, session.max_len - 1))
    rng = np.random.default_rng(0)
    length = min(PROMPT_BUCKET, T)
    # rows past the last one (B) are the padding entries admit_rows drops
    calls = [(np.minimum(np.arange(first, first + A), B).astype(np.int32),
              session.pack_prompts({i: rng.integers(0, session.target.config.vocab_size, length).tolist()
                                    for i in range(A)}, A, T)[:2])
             for first in range(0, B, A)]

    def timed(k: int) -> tuple[float, float]:
        run_models = models if k else target_only(models)   # as the Engine runs K = 0
        state = blank_state(*models, jax.random.key(0), sp, program=program)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for rows, (ids, lengths) in calls:
            state = admit_rows(*run_models, state, rows, ids, lengths, sp, program=program)
        jax.block_until_ready(state)
        admit = (time.perf_counter() - t) / B
        before = fetch(state.rounds_B).max()
        t = time.perf_counter()
        state = run_rounds(*run_models, state, np.int32(PROBE_ROUNDS), np.int32(B + 1), sp,
                           program=program.with_draft_tokens(k))
        executed = fetch(state.rounds_B).max() - before   # the fetch waits for the run
        return admit, (time.perf_counter() - t) / max(int(executed), 1)

    with session.activate():
        for k in ks:
            timed(k)
        samples = {k: [] for k in ks}
        for _ in range(PROBE_REPEATS):
            for k in ks:
                samples[k].append(timed(k))
    admit = {False: min(a for a, _ in samples[0])} if 0 in samples else {}
    if any(k > 0 for k in ks):
        admit[True] = min(a for k in ks if k > 0 for a, _ in samples[k])
    noise = {k: float(np.std(c) / np.mean(c) / np.sqrt(len(c))) for k, v in samples.items() for c in [[c for _, c in v]]}
    return Costs({k: min(c for _, c in v) for k, v in samples.items()}, admit, time.perf_counter() - start,
                 noise=noise)
