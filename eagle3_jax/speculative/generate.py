"""Speculative generation as one XLA program: prefill, then a ``lax.while_loop`` of rounds
(draft K tokens -> verify K+1 with the target -> accept), with no host round trip per step.

Positions. Let a row's target cache hold positions 0..n-1 and ``last`` be the token at position n
(emitted, not yet run through the target). The draft cache holds, at position p, the pair
(token at p+1, target aux state at p) — the pairing SpecForge trains with. One round:

  1. draft: d1 comes from the draft output at position n-1 (kept from the previous round), d2..dK
     from the draft kind's proposal (``drafts``: the chain feeds d_j and its own hidden state back at
     position n-1+j; P-EAGLE guesses them in one pass);
  2. verify: the target extends [last, d1..dK] at positions n..n+K -> logits, aux;
  3. accept a in 0..K drafts; emit d1..da plus the target's token c (correction or bonus);
  4. catch up: the draft re-reads positions n..n+K with the target's true aux states and the
     emitted tokens, overwriting its own guesses there; its output at n+a seeds the next round.
The target cache now holds n..n+a validly; slots past that are stale, masked by position and
overwritten next round. Everything is static-shaped: rows accept different counts, finish
independently (EOS, max_new_tokens, max_len) and stop advancing, and the loop ends when all are done.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle3_jax import drafts
from eagle3_jax.models.cache import KVCache, MLACache
from eagle3_jax.sharding import constrain
from eagle3_jax.speculative.accept import first_argmax, greedy_accept, rejection_accept, sample_from_probs, target_probs
from eagle3_jax.speculative.prefill import chunked_draft, chunked_target
from eagle3_jax.speculative.static_graph import merge_models

RUNNING, FINISH_EOS, FINISH_LENGTH, FINISH_CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {FINISH_EOS: "eos", FINISH_LENGTH: "length", FINISH_CAPACITY: "max_len"}


@jax.tree_util.register_dataclass
@dataclass
class LoopState:
    tokens_BN: jax.Array       # emitted tokens
    n_out_B: jax.Array         # how many emitted
    budget_B: jax.Array        # min(max_new_tokens, max_len - prompt_len)
    budget_is_max_new_B: jax.Array  # which of the two limits the budget is (for finish reasons)
    finish_B: jax.Array        # RUNNING / FINISH_*
    lengths_B: jax.Array       # target cache length n
    last_B: jax.Array          # token at position n
    tcache: MLACache
    dcache: KVCache | None
    dhidden_BD: jax.Array | None   # draft output at position n-1
    dlogits_BW: jax.Array | None   # its logits (d1 comes from here)
    key: jax.Array
    rounds_B: jax.Array
    round_tokens_B: jax.Array
    accepted_BK: jax.Array     # per row: rounds in which draft position i was accepted


@dataclass(frozen=True)
class DecodeProgram:
    """The static description of one compiled decode program (hashable: a jit static argument).

    ``num_draft_tokens`` is K, the draft tokens per round of this program (0: target-only rounds,
    which leave a draft's state untouched); ``max_draft_tokens`` the largest K of the session, which
    fixes the loop state's layout, so programs of every K <= it run on the same state;
    ``max_len`` the per-row capacity of the caches (prompt + generation). Greedy vs sampling, the
    token budget (traced in ``Sampling``) and the draft's aux layer ids (a traced argument beside the
    draft's state) are not part of it, so one program serves every value.
    """

    batch_size: int
    max_len: int
    num_draft_tokens: int
    # Prompt positions per target call in prefill (``prefill.py``); None runs the whole block at once.
    prefill_chunk: int | None = None
    max_draft_tokens: int | None = None   # None: num_draft_tokens

    def __post_init__(self):
        if self.max_draft_tokens is None:
            object.__setattr__(self, "max_draft_tokens", self.num_draft_tokens)

    def with_draft_tokens(self, num_draft_tokens: int) -> "DecodeProgram":
        if not 0 <= num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(f"num_draft_tokens must be in 0..{self.max_draft_tokens}, found {num_draft_tokens}")
        return dataclasses.replace(self, num_draft_tokens=num_draft_tokens)


# Logical axes of LoopState's sharded arrays by field path, for the planning tools; fields not listed
# are batch-first per-row arrays or replicated scalars.
LOOP_STATE_AXES = {
    **{f"tcache.{f}": a for f, a in MLACache.AXES.items()},
    **{f"dcache.{f}": a for f, a in KVCache.AXES.items()},
    "dhidden_BD": ("batch", "embed"),
    "dlogits_BW": ("batch", "draft_vocab"),
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Sampling:
    """A job's sampling settings and token budget, traced: one program serves every value (``greedy``
    selects, with ``lax.cond``, the argmax path that draws no random numbers)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    eos_E: jax.Array
    greedy: jax.Array   # bool scalar: temperature 0
    max_new_tokens: jax.Array   # int32 scalar: the most tokens a row emits (the loop's tokens are max_len wide)


def _split(key, num: int, sp: Sampling):
    """``num`` subkeys, or at greedy ``num`` copies of the key: greedy rounds do no key work (a
    conditional, so the program stays shared with sampling)."""
    return jax.lax.cond(sp.greedy, lambda k: jnp.stack([k] * num), lambda k: jax.random.split(k, num), key)


def _choose(key, logits_BV, sp: Sampling):
    return jax.lax.cond(
        sp.greedy, lambda k, x: first_argmax(x),
        lambda k, x: sample_from_probs(k, target_probs(x, sp.temperature, sp.top_k, sp.top_p)), key, logits_BV)


def _emit(state: LoopState, new_BJ, n_new_B, eos_E):
    """Appends up to n_new tokens per running row; truncates after EOS and at the budget.
    Returns (tokens, n_out, finish, n_emitted); finish already names the limit that was hit."""
    B, J = new_BJ.shape
    running_B = state.finish_B == RUNNING
    room_B = state.budget_B - state.n_out_B
    n_B = jnp.where(running_B, jnp.minimum(n_new_B, room_B), 0)
    idx_J = jnp.arange(J)
    is_eos_BJ = jnp.isin(new_BJ, eos_E) & (idx_J[None, :] < n_B[:, None])
    first_eos_B = jnp.where(is_eos_BJ.any(-1), jnp.argmax(is_eos_BJ, axis=-1), J)
    hit_eos_B = first_eos_B < n_B
    n_B = jnp.where(hit_eos_B, first_eos_B + 1, n_B)
    slots_BJ = jnp.where(idx_J[None, :] < n_B[:, None], state.n_out_B[:, None] + idx_J[None, :], state.tokens_BN.shape[1])
    rows_BJ = jnp.broadcast_to(jnp.arange(B)[:, None], (B, J))
    tokens_BN = state.tokens_BN.at[rows_BJ, slots_BJ].set(new_BJ, mode="drop")
    n_out_B = state.n_out_B + n_B
    budget_finish_B = jnp.where(state.budget_is_max_new_B, FINISH_LENGTH, FINISH_CAPACITY)
    finish_B = jnp.where(
        ~running_B, state.finish_B,
        jnp.where(hit_eos_B, FINISH_EOS, jnp.where(n_out_B >= state.budget_B, budget_finish_B, RUNNING)))
    return tokens_BN, n_out_B, finish_B.astype(jnp.int32), n_B


def prompt_capacity(T: int, program: DecodeProgram) -> int:
    """Cache slots a prefill of a T-token prompt block writes: T rounded up to whole chunks (chunk
    padding writes slots past T), at most the capacity."""
    chunk = program.prefill_chunk
    padded = T if chunk is None or chunk >= T else -(-T // chunk) * chunk
    return min(padded, program.max_len)


def _prefill(target, draft, aux_ids_N, prompt_BT, prompt_len_B, key, sp: Sampling, program: DecodeProgram,
             capacity: int | None = None) -> LoopState:
    """Runs the prompts through the target (and the draft) and emits each row's first token.
    ``capacity``: slots of the caches and of the token buffer it builds (default the program's
    ``max_len``; an admission builds only the prompt block's, see ``admit_rows``)."""
    K = program.max_draft_tokens   # the layout's width, also when the draft is left out (admit_rows)
    max_len = program.max_len
    B, T = prompt_BT.shape
    rows_B = jnp.arange(B)
    tcache = target.init_cache(B, capacity or max_len)   # laid out by the sharding table (cache.py)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    want_aux = aux_ids_N if draft is not None else None
    chunk = program.prefill_chunk
    if chunk is None or chunk >= T:
        out = target(prompt_BT, positions_BT, tcache, want_aux)
        last_hidden_BD = out.hidden_BTD[rows_B, prompt_len_B - 1]
        tcache, aux_BTX = out.cache, out.aux_BTX
    else:
        last_hidden_BD, tcache, aux_BTX = chunked_target(target, prompt_BT, prompt_len_B, tcache, want_aux, chunk)
    key, k0 = _split(key, 2, sp)
    first_B = _choose(k0, target.logits(last_hidden_BD[:, None])[:, 0], sp)

    max_new_B = jnp.full((B,), sp.max_new_tokens, jnp.int32)
    room_B = max_len - prompt_len_B
    budget_B = jnp.minimum(max_new_B, room_B)
    state = LoopState(
        tokens_BN=constrain(jnp.zeros((B, capacity or max_len), jnp.int32), ("batch", None)),
        n_out_B=jnp.zeros((B,), jnp.int32), budget_B=budget_B,
        budget_is_max_new_B=max_new_B <= room_B,
        finish_B=jnp.where(budget_B > 0, RUNNING, FINISH_CAPACITY).astype(jnp.int32),
        lengths_B=prompt_len_B.astype(jnp.int32), last_B=first_B, tcache=tcache, dcache=None,
        dhidden_BD=None, dlogits_BW=None, key=key, rounds_B=jnp.zeros((B,), jnp.int32),
        round_tokens_B=jnp.zeros((B,), jnp.int32), accepted_BK=jnp.zeros((B, max(K, 1)), jnp.int32))
    state.tokens_BN, state.n_out_B, state.finish_B, _ = _emit(
        state, first_B[:, None], jnp.ones((B,), jnp.int32), sp.eos_E)
    if draft is not None:
        # Draft prefill: pair aux at position t with the token at t+1 (the prompt shifted left,
        # with the target's first new token at each row's end).
        shifted_BT = jnp.concatenate([prompt_BT[:, 1:], jnp.zeros((B, 1), prompt_BT.dtype)], axis=1)
        shifted_BT = shifted_BT.at[rows_B, prompt_len_B - 1].set(first_B)
        dcache = draft.init_cache(B, capacity or max_len)
        kind = drafts.of_module(draft)
        if not kind.seeded:   # no anchor output to keep: the prompt's catch-up is the whole prefill
            embed_VD = target.embed_tokens[...]
            state.dcache = kind.catch_up(draft, shifted_BT, aux_BTX, positions_BT, embed_VD, dcache).cache
        elif chunk is None or chunk >= T:
            dstep = draft(shifted_BT, draft.fuse(aux_BTX), positions_BT, target.embed_tokens[...], dcache,
                          with_logits=False)
            state.dcache = dstep.cache
            state.dhidden_BD = dstep.hidden_BTD[rows_B, prompt_len_B - 1]
            state.dlogits_BW = draft.head(state.dhidden_BD[:, None])[:, 0]
        else:
            state.dcache, state.dhidden_BD, state.dlogits_BW = chunked_draft(
                draft, target, shifted_BT, aux_BTX, prompt_len_B, dcache, chunk)
    return state


def _round_fn(target, draft, aux_ids_N, sp: Sampling, program: DecodeProgram):
    """One round of the loop body: speculative with a draft, plain decoding without."""
    embed_VD = target.embed_tokens[...]
    kind = drafts.of_module(draft) if draft is not None else None   # how it proposes and catches up

    def draft_pick(key, logits_BW):
        """The draft's token and its distribution q (zeros at greedy, where nothing reads it)."""
        def sample(k, x):
            q_BW = jax.nn.softmax(x / jnp.maximum(sp.temperature, 1e-6), axis=-1)
            return sample_from_probs(k, q_BW), q_BW
        return jax.lax.cond(sp.greedy, lambda k, x: (first_argmax(x), jnp.zeros(x.shape, jnp.float32)),
                            sample, key, logits_BW)

    def spec_round(s: LoopState) -> LoopState:
        K = program.num_draft_tokens
        B = s.last_B.shape[0]
        rows_B = jnp.arange(B)
        key, k_draft, k_accept = _split(s.key, 3, sp)
        draft_keys = _split(k_draft, K, sp)
        d_BK, q_BKW, dcache = kind.propose(draft, s.dlogits_BW, s.dhidden_BD, s.dcache, s.lengths_B, draft_keys,
                                           draft_pick, embed_VD, s.last_B, target.logits)
        drafts_BK = draft.to_target_ids(d_BK)

        ids_BK1 = jnp.concatenate([s.last_B[:, None], drafts_BK], axis=1)
        pos_BK1 = s.lengths_B[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        tout = target(ids_BK1, pos_BK1, s.tcache, aux_ids_N)
        logits_BK1V = target.logits(tout.hidden_BTD)
        def rejection(k, logits_BK1V, q_BKW):
            p_BK1V = target_probs(logits_BK1V, sp.temperature, sp.top_k, sp.top_p)
            target_ids_W = draft.to_target_ids(jnp.arange(q_BKW.shape[-1]))
            q_BKV = jnp.zeros((B, K, logits_BK1V.shape[-1]), jnp.float32).at[:, :, target_ids_W].set(q_BKW)
            return rejection_accept(k, drafts_BK, q_BKV, p_BK1V)

        n_acc_B, out_BK1 = jax.lax.cond(sp.greedy, lambda k, x, q: greedy_accept(drafts_BK, x), rejection,
                                        k_accept, logits_BK1V, q_BKW)

        running_B = s.finish_B == RUNNING
        tokens_BN, n_out_B, finish_B, n_emit_B = _emit(s, out_BK1, n_acc_B + 1, sp.eos_E)

        # Catch-up: the draft re-reads positions n..n+K with the target's true aux states.
        cstep = kind.catch_up(draft, out_BK1, tout.aux_BTX, pos_BK1, embed_VD, dcache)
        seeds = {}
        if kind.seeded:   # the next round's d1 comes from the output at the last accepted position
            seed_BD = cstep.hidden_BTD[rows_B, n_acc_B]
            seeds = dict(dhidden_BD=jnp.where(running_B[:, None], seed_BD, s.dhidden_BD),
                         dlogits_BW=jnp.where(running_B[:, None], draft.head(seed_BD[:, None])[:, 0], s.dlogits_BW))
        # The state's layout is K_max wide (every K of the session shares it); this round fills 0..K-1.
        hit_BK = (jnp.arange(K)[None, :] < n_acc_B[:, None]) & running_B[:, None]
        accepted_BK = s.accepted_BK.at[:, :K].add(hit_BK.astype(jnp.int32))
        return dataclasses.replace(
            s, tokens_BN=tokens_BN, n_out_B=n_out_B, finish_B=finish_B,
            lengths_B=jnp.where(running_B, s.lengths_B + n_acc_B + 1, s.lengths_B),
            last_B=jnp.where(running_B, out_BK1[rows_B, n_acc_B], s.last_B),
            tcache=tout.cache, dcache=cstep.cache, key=key, rounds_B=s.rounds_B + running_B,
            round_tokens_B=s.round_tokens_B + n_emit_B, accepted_BK=accepted_BK.astype(jnp.int32), **seeds)

    def target_round(s: LoopState) -> LoopState:
        key, k = _split(s.key, 2, sp)
        tout = target(s.last_B[:, None], s.lengths_B[:, None], s.tcache, ())
        next_B = _choose(k, target.logits(tout.hidden_BTD)[:, 0], sp)
        running_B = s.finish_B == RUNNING
        tokens_BN, n_out_B, finish_B, n_emit_B = _emit(s, next_B[:, None], jnp.ones_like(next_B), sp.eos_E)
        return dataclasses.replace(
            s, tokens_BN=tokens_BN, n_out_B=n_out_B, finish_B=finish_B,
            lengths_B=jnp.where(running_B, s.lengths_B + 1, s.lengths_B),
            last_B=jnp.where(running_B, next_B, s.last_B), tcache=tout.cache, key=key,
            rounds_B=s.rounds_B + running_B, round_tokens_B=s.round_tokens_B + n_emit_B)

    return spec_round if draft is not None and program.num_draft_tokens > 0 else target_round


_STATIC = ("tgraph", "dgraph", "program")


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_loop(tgraph, tstate, dgraph, dstate, aux_ids_N, prompt_BT, prompt_len_B, key, sp: Sampling, *,
                  program: DecodeProgram) -> LoopState:
    """Prefill + rounds until every row is done, in one program."""
    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    state = _prefill(target, draft, aux_ids_N, prompt_BT, prompt_len_B, key, sp, program)
    body = _round_fn(target, draft, aux_ids_N, sp, program)
    return jax.lax.while_loop(lambda s: jnp.any(s.finish_B == RUNNING), body, state)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def admit_rows(tgraph, tstate, dgraph, dstate, aux_ids_N, state: LoopState, rows_A, prompt_AT, prompt_len_A,
               sp: Sampling, *, program: DecodeProgram) -> LoopState:
    """Prefills A new prompts (A = ``rows_A.shape[0]``) and writes them into rows ``rows_A`` of the
    running state; every other row is untouched. Only the admitted rows are prefilled, so admitting
    one prompt costs a one-row prefill, not a whole batch. An entry of ``rows_A`` that is out of
    range (``>= batch_size``) is padding: its prefill is computed and dropped.

    Called without the draft (``dgraph``, ``dstate``, ``aux_ids_N`` None), only the target prefills
    and the rows' draft state is left stale, as after a target-only round: K = 0 under auto costs
    what having no draft costs.

    The new rows' caches span only the prompt block's slots (a full-capacity one would be a second
    copy of the state's caches), written over the rows' first slots; the slots past them keep an
    earlier occupant's entries, masked by position like any stale slot."""
    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    key, k_new = jax.random.split(state.key)
    fresh = _prefill(target, draft, aux_ids_N, prompt_AT, prompt_len_A, k_new, sp, program,
                     capacity=prompt_capacity(prompt_AT.shape[1], program))
    return _laid_out(_scatter_rows(rows_A, fresh, dataclasses.replace(state, key=key)))


_DRAFT_FIELDS = ("dcache", "dhidden_BD", "dlogits_BW")


def _scatter_rows(rows_A, new: LoopState, old: LoopState) -> LoopState:
    """old[rows_A] = new, row by row (out-of-range rows dropped); the key stays old's, and so does
    the draft state where ``new`` has none. The target cache keeps layers first and batch second;
    everything else is batch-first. ``new``'s caches and tokens may hold fewer slots than ``old``'s:
    they fill the rows' first slots (what lies past a row's count is never read)."""

    def put(axis):
        def scatter(o, n):
            # Leading slices cover new's extent on every axis after the rows (fewer cache slots).
            tail = tuple(slice(0, d) for d in n.shape[axis + 1:])
            return o.at[(slice(None),) * axis + (rows_A,) + tail].set(n.astype(o.dtype), mode="drop")
        return scatter

    kept = dict(tcache=None, key=None)
    if new.dcache is None:
        kept.update({f: None for f in _DRAFT_FIELDS})
    rest = jax.tree_util.tree_map(put(0), dataclasses.replace(old, **kept), dataclasses.replace(new, **kept))
    return dataclasses.replace(rest, tcache=jax.tree_util.tree_map(put(1), old.tcache, new.tcache), key=old.key,
                               **{f: getattr(old, f) for f in kept if f in _DRAFT_FIELDS})


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def run_rounds(tgraph, tstate, dgraph, dstate, aux_ids_N, state: LoopState, max_rounds, stop_free, sp: Sampling,
               *, program: DecodeProgram) -> LoopState:
    """At most ``max_rounds`` rounds; stops early when no row is running, or once ``stop_free`` rows
    are not running (finished or idle), so that a caller with prompts waiting refills freed rows
    instead of letting them idle to the end of the run (pass batch_size + 1 to never stop early).
    Target-only rounds (K = 0) may be run without the draft (``dgraph``, ``dstate``, ``aux_ids_N``
    None) on a state that has draft fields: they pass through untouched, and no draft weights are
    handed in."""
    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    body = _round_fn(target, draft, aux_ids_N, sp, program)

    def cond(c):
        s, r = c
        running_B = s.finish_B == RUNNING
        free = running_B.shape[0] - jnp.sum(running_B)
        return jnp.any(running_B) & (r < max_rounds) & (free < stop_free)

    state, _ = jax.lax.while_loop(cond, lambda c: (_laid_out(body(c[0])), c[1] + 1), (_laid_out(state), jnp.int32(0)))
    return _laid_out(state)


FINISH_IDLE = 4  # an empty row of a continuous batch


@functools.partial(jax.jit, static_argnames=_STATIC)
def blank_state(tgraph, tstate, dgraph, dstate, aux_ids_N, key, sp: Sampling, *, program: DecodeProgram) -> LoopState:
    """A loop state with every row idle, ready for ``admit_rows``."""
    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    B = program.batch_size
    # Its contents never matter (idle rows do not advance, and admission overwrites a row whole), so
    # it is zeros shaped as a one-token prefill's state: that prefill is traced for its shapes only,
    # never compiled.
    shapes = jax.eval_shape(lambda: _prefill(target, draft, aux_ids_N, jnp.zeros((B, 1), jnp.int32),
                                             jnp.ones((B,), jnp.int32), key, sp, program))
    state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), dataclasses.replace(shapes, key=None))
    return _laid_out(dataclasses.replace(state, key=key, lengths_B=jnp.ones((B,), jnp.int32),
                                         finish_B=jnp.full((B,), FINISH_IDLE, jnp.int32)))


def state_axes(path, x) -> tuple | None:
    """Logical axes of a loop-state leaf (``tree_map_with_path``): ``LOOP_STATE_AXES``'s, else
    batch-first; None for the key, replicated. Also the planner's (``tools/plan``)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return None
    return LOOP_STATE_AXES.get(jax.tree_util.keystr(path).lstrip("."), ("batch",) + (None,) * (x.ndim - 1))


def _laid_out(state: LoopState) -> LoopState:
    """The loop state pinned to ``state_axes``, as ``blank_state``, ``admit_rows`` and every round of
    ``run_rounds`` return it: left to the compiler, the small per-row arrays' layouts differ between
    the three, each program compiles again for another's, and a donated state is not reused."""
    def pin(path, x):
        axes = state_axes(path, x)
        return x if axes is None else constrain(x, axes)

    return jax.tree_util.tree_map_with_path(pin, state)
