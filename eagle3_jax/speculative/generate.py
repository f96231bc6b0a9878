"""Speculative generation as one XLA program: prefill, then a ``lax.while_loop`` of rounds
(draft K tokens -> verify K+1 with the target -> accept), with no host round trip per step.

Positions. Let a row's target cache hold positions 0..n-1 and ``last`` be the token at position n
(emitted, not yet run through the target). The draft cache holds, at position p, the pair
(token at p+1, target aux state at p) — the pairing SpecForge trains with. One round:

  1. draft: d1 comes from the draft output at position n-1 (kept from the previous round);
     steps j = 1..K-1 feed (d_j, own hidden) at position n-1+j and give d_{j+1};
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
from flax import nnx

from eagle3_jax.models.cache import KVCache, MLACache
from eagle3_jax.sharding import constrain
from eagle3_jax.speculative.accept import greedy_accept, rejection_accept, sample_from_probs, target_probs

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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Sampling:
    """Sampling settings as traced scalars (one compiled program serves every value)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    eos_E: jax.Array


def _choose(key, logits_BV, greedy, sp: Sampling):
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample_from_probs(key, target_probs(logits_BV, sp.temperature, sp.top_k, sp.top_p))


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


def _chunks(x_BT, chunk):
    """[B, T] -> [T / chunk, B, chunk] (T padded up to a multiple of chunk with zeros)."""
    B, T = x_BT.shape
    n = -(-T // chunk)
    x_BT = jnp.pad(x_BT, ((0, 0), (0, n * chunk - T)))
    return x_BT.reshape(B, n, chunk).transpose(1, 0, 2)


def _prefill(target, draft, prompt_BT, prompt_len_B, key, sp: Sampling, *, num_draft, max_new, capacity,
             aux_ids, greedy, prefill_chunk=None, into: LoopState | None = None, write_B=None) -> LoopState:
    """Runs the prompts through the target (and the draft) and emits each row's first token.

    ``prefill_chunk`` = C: the prompt block goes through the target C positions at a time (a scan
    writing each chunk into the cache before the next attends to it), so the temporaries of one
    call (MoE assignments, attention scores) scale with B x C instead of B x T. Same tokens, same
    cache contents; None runs the whole block at once.

    ``into`` / ``write_B``: write the prompts of the rows marked by ``write_B`` into the caches of
    the running state ``into`` instead of fresh caches (no second set of caches exists). The other
    rows run at positions past the capacity, so their cache writes are dropped and their cache
    entries stay as they were; their outputs are junk for the caller to discard. Slots an admitted
    row's previous occupant left past the new prompt are masked by position like any stale slot.
    """
    K = num_draft if draft is not None else 0
    B, T = prompt_BT.shape
    rows_B = jnp.arange(B)
    if into is None:
        tcache = target.init_cache(B, capacity)
        tcache = MLACache(constrain(tcache.latent_LBSC, (None, "batch", "cache_seq", "kv_lora")),
                          constrain(tcache.rope_LBSP, (None, "batch", "cache_seq", None)))
        offset_B = jnp.zeros((B,), jnp.int32)
    else:
        tcache = into.tcache
        offset_B = jnp.where(write_B, 0, capacity).astype(jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) + offset_B[:, None]
    want_aux = aux_ids if draft is not None else ()
    if prefill_chunk is None or prefill_chunk >= T:
        out = target(prompt_BT, positions_BT, tcache, want_aux)
        last_hidden_BD = out.hidden_BTD[rows_B, prompt_len_B - 1]
        tcache, aux_BTX = out.cache, out.aux_BTX
    else:
        last_hidden_BD, tcache, aux_BTX = _chunked_target(target, prompt_BT, prompt_len_B, tcache, want_aux,
                                                          prefill_chunk, offset_B)
    key, k0 = jax.random.split(key)
    first_B = _choose(k0, target.logits(last_hidden_BD[:, None])[:, 0], greedy, sp)

    max_new_B = jnp.full((B,), max_new, jnp.int32)
    room_B = capacity - prompt_len_B
    budget_B = jnp.minimum(max_new_B, room_B)
    state = LoopState(
        tokens_BN=constrain(jnp.zeros((B, max_new), jnp.int32), ("batch", None)),
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
        dcache = draft.init_cache(B, capacity) if into is None else into.dcache
        if prefill_chunk is None or prefill_chunk >= T:
            dstep = draft(shifted_BT, draft.fuse(aux_BTX), positions_BT, target.embed_tokens[...], dcache)
            state.dcache = dstep.cache
            state.dhidden_BD = dstep.hidden_BTD[rows_B, prompt_len_B - 1]
            state.dlogits_BW = dstep.logits_BTW[rows_B, prompt_len_B - 1]
        else:
            state.dcache, state.dhidden_BD, state.dlogits_BW = _chunked_draft(
                draft, target, shifted_BT, aux_BTX, prompt_len_B, dcache, prefill_chunk, offset_B)
    return state


def _chunked_draft(draft, target, shifted_BT, aux_BTX, prompt_len_B, dcache, chunk, offset_B):
    """The draft prefill ``chunk`` positions per step (its attention over the whole cache and its
    logits are the big temporaries); returns (cache, hidden [B, D] and logits [B, W] at each row's
    last prompt position)."""
    B, T = shifted_BT.shape
    rows_B = jnp.arange(B)
    n = -(-T // chunk)
    ids_NBC = _chunks(shifted_BT, chunk)
    pos_NBC = _chunks(jnp.arange(n * chunk, dtype=jnp.int32)[None, :] + offset_B[:, None], chunk)
    aux_NBCX = jnp.pad(aux_BTX, ((0, 0), (0, n * chunk - T), (0, 0))).reshape(B, n, chunk, -1).transpose(1, 0, 2, 3)
    embed_VD = target.embed_tokens[...]
    last_B = prompt_len_B - 1 + offset_B

    def step(carry, xs):
        cache, h_BD, logits_BW = carry
        ids_BC, pos_BC, aux_BCX = xs
        out = draft(ids_BC, draft.fuse(aux_BCX), pos_BC, embed_VD, cache)
        here_B = (last_B >= pos_BC[:, 0]) & (last_B < pos_BC[:, 0] + chunk)
        at_B = jnp.clip(last_B - pos_BC[:, 0], 0, chunk - 1)
        h_BD = jnp.where(here_B[:, None], out.hidden_BTD[rows_B, at_B].astype(h_BD.dtype), h_BD)
        logits_BW = jnp.where(here_B[:, None], out.logits_BTW[rows_B, at_B], logits_BW)
        return (out.cache, h_BD, logits_BW), None

    h0 = jnp.zeros((B, draft.cfg.hidden_size), draft.dtype)
    l0 = jnp.zeros((B, draft.cfg.draft_vocab_size), jnp.float32)
    (dcache, h_BD, logits_BW), _ = jax.lax.scan(step, (dcache, h0, l0), (ids_NBC, pos_NBC, aux_NBCX))
    return dcache, h_BD, logits_BW


def _chunked_target(target, prompt_BT, prompt_len_B, tcache, aux_ids, chunk, offset_B):
    """The target over the prompt, ``chunk`` positions per step; returns (hidden at each row's last
    prompt position [B, D], cache, aux states [B, T, X] or None)."""
    B, T = prompt_BT.shape
    rows_B = jnp.arange(B)
    ids_NBC = _chunks(prompt_BT, chunk)
    n = ids_NBC.shape[0]
    # Padding positions past T write cache slots >= T, which hold no prompt token: they are
    # masked by position like any stale slot and overwritten by the first decode steps.
    pos_NBC = _chunks(jnp.arange(n * chunk, dtype=jnp.int32)[None, :] + offset_B[:, None], chunk)
    last_B = prompt_len_B - 1 + offset_B

    def step(carry, xs):
        cache, last_hidden_BD = carry
        ids_BC, pos_BC = xs
        out = target(ids_BC, pos_BC, cache, aux_ids)
        here_B = (last_B >= pos_BC[:, 0]) & (last_B < pos_BC[:, 0] + chunk)
        h_BD = out.hidden_BTD[rows_B, jnp.clip(last_B - pos_BC[:, 0], 0, chunk - 1)]
        last_hidden_BD = jnp.where(here_B[:, None], h_BD, last_hidden_BD)
        return (out.cache, last_hidden_BD), out.aux_BTX

    h0 = jnp.zeros((B, target.cfg.hidden_size), target.dtype)
    (tcache, last_hidden_BD), aux_NBCX = jax.lax.scan(step, (tcache, h0), (ids_NBC, pos_NBC))
    aux_BTX = None
    if aux_ids:
        aux_BTX = aux_NBCX.transpose(1, 0, 2, 3).reshape(B, n * chunk, -1)[:, :T]
    return last_hidden_BD, tcache, aux_BTX


def _round_fn(target, draft, sp: Sampling, *, num_draft, aux_ids, greedy):
    """One round of the loop body: speculative with a draft, plain decoding without."""
    embed_VD = target.embed_tokens[...]

    def draft_pick(key, logits_BW):
        if greedy:
            return jnp.argmax(logits_BW, axis=-1).astype(jnp.int32), None
        q_BW = jax.nn.softmax(logits_BW / jnp.maximum(sp.temperature, 1e-6), axis=-1)
        return sample_from_probs(key, q_BW), q_BW

    def spec_round(s: LoopState) -> LoopState:
        K = num_draft
        B = s.last_B.shape[0]
        rows_B = jnp.arange(B)
        key, k_draft, k_accept = jax.random.split(s.key, 3)
        draft_keys = jax.random.split(k_draft, K)
        d_ids, q_list = [], []
        d_B, q_BW = draft_pick(draft_keys[0], s.dlogits_BW)
        d_ids.append(d_B)
        q_list.append(q_BW)
        hidden_BD, dcache = s.dhidden_BD, s.dcache
        for j in range(1, K):
            pos_B1 = (s.lengths_B - 1 + j)[:, None]
            step = draft(draft.to_target_ids(d_B)[:, None], hidden_BD[:, None], pos_B1, embed_VD, dcache)
            hidden_BD, dcache = step.hidden_BTD[:, 0], step.cache
            d_B, q_BW = draft_pick(draft_keys[j], step.logits_BTW[:, 0])
            d_ids.append(d_B)
            q_list.append(q_BW)
        drafts_BK = draft.to_target_ids(jnp.stack(d_ids, axis=1))

        ids_BK1 = jnp.concatenate([s.last_B[:, None], drafts_BK], axis=1)
        pos_BK1 = s.lengths_B[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        tout = target(ids_BK1, pos_BK1, s.tcache, aux_ids)
        logits_BK1V = target.logits(tout.hidden_BTD)
        if greedy:
            n_acc_B, out_BK1 = greedy_accept(drafts_BK, logits_BK1V)
        else:
            p_BK1V = target_probs(logits_BK1V, sp.temperature, sp.top_k, sp.top_p)
            q_BKW = jnp.stack(q_list, axis=1)
            target_ids_W = draft.to_target_ids(jnp.arange(q_BKW.shape[-1]))
            q_BKV = jnp.zeros((B, K, logits_BK1V.shape[-1]), jnp.float32).at[:, :, target_ids_W].set(q_BKW)
            n_acc_B, out_BK1 = rejection_accept(k_accept, drafts_BK, q_BKV, p_BK1V)

        running_B = s.finish_B == RUNNING
        tokens_BN, n_out_B, finish_B, n_emit_B = _emit(s, out_BK1, n_acc_B + 1, sp.eos_E)

        # Catch-up: the draft re-reads positions n..n+K with the target's true aux states.
        cstep = draft(out_BK1, draft.fuse(tout.aux_BTX), pos_BK1, embed_VD, dcache)
        accepted_BK = s.accepted_BK + ((jnp.arange(K)[None, :] < n_acc_B[:, None]) & running_B[:, None])
        return dataclasses.replace(
            s, tokens_BN=tokens_BN, n_out_B=n_out_B, finish_B=finish_B,
            lengths_B=jnp.where(running_B, s.lengths_B + n_acc_B + 1, s.lengths_B),
            last_B=jnp.where(running_B, out_BK1[rows_B, n_acc_B], s.last_B),
            tcache=tout.cache, dcache=cstep.cache,
            dhidden_BD=jnp.where(running_B[:, None], cstep.hidden_BTD[rows_B, n_acc_B], s.dhidden_BD),
            dlogits_BW=jnp.where(running_B[:, None], cstep.logits_BTW[rows_B, n_acc_B], s.dlogits_BW),
            key=key, rounds_B=s.rounds_B + running_B, round_tokens_B=s.round_tokens_B + n_emit_B,
            accepted_BK=accepted_BK.astype(jnp.int32))

    def target_round(s: LoopState) -> LoopState:
        key, k = jax.random.split(s.key)
        tout = target(s.last_B[:, None], s.lengths_B[:, None], s.tcache, ())
        next_B = _choose(k, target.logits(tout.hidden_BTD)[:, 0], greedy, sp)
        running_B = s.finish_B == RUNNING
        tokens_BN, n_out_B, finish_B, n_emit_B = _emit(s, next_B[:, None], jnp.ones_like(next_B), sp.eos_E)
        return dataclasses.replace(
            s, tokens_BN=tokens_BN, n_out_B=n_out_B, finish_B=finish_B,
            lengths_B=jnp.where(running_B, s.lengths_B + 1, s.lengths_B),
            last_B=jnp.where(running_B, next_B, s.last_B), tcache=tout.cache, key=key,
            rounds_B=s.rounds_B + running_B, round_tokens_B=s.round_tokens_B + n_emit_B)

    return spec_round if draft is not None else target_round


def _merge_models(tgraph, tstate, dgraph, dstate):
    return nnx.merge(tgraph, tstate), (nnx.merge(dgraph, dstate) if dgraph is not None else None)


_STATIC = ("tgraph", "dgraph", "num_draft", "max_new", "capacity", "aux_ids", "greedy")
_PREFILL_STATIC = _STATIC + ("prefill_chunk",)


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC)
def generate_loop(tgraph, tstate, dgraph, dstate, prompt_BT, prompt_len_B, key, sp: Sampling,
                  *, num_draft: int, max_new: int, capacity: int, aux_ids: tuple, greedy: bool,
                  prefill_chunk: int | None = None) -> LoopState:
    """Prefill + rounds until every row is done, in one program."""
    target, draft = _merge_models(tgraph, tstate, dgraph, dstate)
    state = _prefill(target, draft, prompt_BT, prompt_len_B, key, sp, num_draft=num_draft, max_new=max_new,
                     capacity=capacity, aux_ids=aux_ids, greedy=greedy, prefill_chunk=prefill_chunk)
    body = _round_fn(target, draft, sp, num_draft=num_draft, aux_ids=aux_ids, greedy=greedy)
    return jax.lax.while_loop(lambda s: jnp.any(s.finish_B == RUNNING), body, state)


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC, donate_argnames=("state",))
def admit_rows(tgraph, tstate, dgraph, dstate, state: LoopState, admit_B, prompt_BT, prompt_len_B, sp: Sampling,
               *, num_draft: int, max_new: int, capacity: int, aux_ids: tuple, greedy: bool,
               prefill_chunk: int | None = None) -> LoopState:
    """Prefills new prompts into the rows marked by ``admit_B``; other rows keep their state."""
    target, draft = _merge_models(tgraph, tstate, dgraph, dstate)
    key, k_new = jax.random.split(state.key)
    fresh = _prefill(target, draft, prompt_BT, prompt_len_B, k_new, sp, num_draft=num_draft, max_new=max_new,
                     capacity=capacity, aux_ids=aux_ids, greedy=greedy, prefill_chunk=prefill_chunk,
                     into=state, write_B=admit_B)
    fresh.key = key
    # The caches were written in place (admitted rows only): no row-wise select, no second copy.
    merged = _merge_rows(admit_B, dataclasses.replace(fresh, tcache=None, dcache=None),
                         dataclasses.replace(state, tcache=None, dcache=None))
    return dataclasses.replace(merged, tcache=fresh.tcache, dcache=fresh.dcache)


def _merge_rows(mask_B, new: LoopState, old: LoopState) -> LoopState:
    """Row-wise select between two loop states; the target cache keeps layers first, batch second."""

    def rows(axis):
        def sel(n, o):
            m = mask_B.reshape((1,) * axis + (-1,) + (1,) * (n.ndim - axis - 1))
            return jnp.where(m, n, o)
        return sel

    merged = jax.tree_util.tree_map(rows(0), dataclasses.replace(new, tcache=None, key=None),
                                    dataclasses.replace(old, tcache=None, key=None))
    return dataclasses.replace(merged, tcache=jax.tree_util.tree_map(rows(1), new.tcache, old.tcache), key=new.key)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def run_rounds(tgraph, tstate, dgraph, dstate, state: LoopState, max_rounds, sp: Sampling,
               *, num_draft: int, max_new: int, capacity: int, aux_ids: tuple, greedy: bool) -> LoopState:
    """At most ``max_rounds`` rounds (stops early when no row is running)."""
    target, draft = _merge_models(tgraph, tstate, dgraph, dstate)
    body = _round_fn(target, draft, sp, num_draft=num_draft, aux_ids=aux_ids, greedy=greedy)

    def cond(c):
        s, r = c
        return jnp.any(s.finish_B == RUNNING) & (r < max_rounds)

    state, _ = jax.lax.while_loop(cond, lambda c: (body(c[0]), c[1] + 1), (state, jnp.int32(0)))
    return state


FINISH_IDLE = 4  # an empty row of a continuous batch


@functools.partial(jax.jit, static_argnames=_STATIC + ("batch",))
def blank_state(tgraph, tstate, dgraph, dstate, batch: int, key, sp: Sampling,
                *, num_draft: int, max_new: int, capacity: int, aux_ids: tuple, greedy: bool) -> LoopState:
    """A loop state with every row idle, ready for ``admit_rows``."""
    target, draft = _merge_models(tgraph, tstate, dgraph, dstate)
    state = _prefill(target, draft, jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32), key, sp,
                     num_draft=num_draft, max_new=max_new, capacity=capacity, aux_ids=aux_ids, greedy=greedy)
    return dataclasses.replace(state, finish_B=jnp.full((batch,), FINISH_IDLE, jnp.int32))
