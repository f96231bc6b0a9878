"""Chunked prefill (the prompt block through the target C positions at a time) changes memory,
never tokens: greedy output is identical for every chunk size, with a draft and without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.speculative.generate import DecodeProgram, generate_loop
from eagle3_jax.speculative.session import SamplingSettings


def run(target, draft, prompts, chunk, k=3, max_new=12, capacity=48):
    T = 16
    ids = np.zeros((len(prompts), T), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    sp = SamplingSettings().traced(max_new)
    out = generate_loop(target.graphdef, target.state, draft.graphdef if draft else None,
                        draft.state if draft else None, jnp.asarray(draft.aux_layer_ids) if draft else None,
                        jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(0),
                        sp, program=DecodeProgram(
                            batch_size=len(prompts), max_len=capacity,
                            num_draft_tokens=k if draft else 0, prefill_chunk=chunk))
    n = np.asarray(out.n_out_B)
    return [np.asarray(out.tokens_BN)[b, :n[b]].tolist() for b in range(len(prompts))], np.asarray(out.finish_B)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(2, 256, size=n).tolist() for n in (16, 3, 9, 12)]


@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_output_is_the_same_for_every_chunk_size(tiny_target, trained_draft_dir, prompts, with_draft):
    draft = e3.load_draft(trained_draft_dir, tiny_target) if with_draft else None
    whole = run(tiny_target, draft, prompts, None)
    # 4 divides the block; 5 leaves a partial last chunk; 1 is token by token.
    for chunk in (1, 4, 5):
        tokens, finish = run(tiny_target, draft, prompts, chunk)
        assert tokens == whole[0], chunk
        np.testing.assert_array_equal(finish, whole[1])


def test_admitting_rows_into_a_running_state_in_chunks(tiny_target, trained_draft_dir, prompts):
    """admit_rows prefills only the admitted rows (chunked here) and leaves the others alone:
    admitting rows 0 and 2 first, then 1 and 3 into the same state, gives generate_loop's tokens."""
    from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds

    draft = e3.load_draft(trained_draft_dir, tiny_target)
    want, _ = run(tiny_target, draft, prompts, None)
    sp = SamplingSettings().traced(12)
    models = (tiny_target.graphdef, tiny_target.state, draft.graphdef, draft.state, jnp.asarray(draft.aux_layer_ids))
    program = DecodeProgram(batch_size=len(prompts), max_len=48, num_draft_tokens=3, prefill_chunk=5)
    state = blank_state(*models, jax.random.key(0), sp, program=program)
    for rows in ([0, 2], [1, 3]):
        ids = np.zeros((len(rows), 16), np.int32)
        for a, b in enumerate(rows):
            ids[a, :len(prompts[b])] = prompts[b]
        lengths = np.array([len(prompts[b]) for b in rows], np.int32)
        state = admit_rows(*models, state, jnp.asarray(rows, jnp.int32), jnp.asarray(ids), jnp.asarray(lengths), sp,
                           program=program)
        if rows == [0, 2]:  # rows 0 and 2 run a few rounds before 1 and 3 arrive
            state = run_rounds(*models, state, jnp.int32(2), jnp.int32(program.batch_size + 1), sp, program=program)
    state = run_rounds(*models, state, jnp.int32(100), jnp.int32(program.batch_size + 1), sp, program=program)
    n = np.asarray(state.n_out_B)
    assert [np.asarray(state.tokens_BN)[b, :n[b]].tolist() for b in range(len(prompts))] == want


def test_generator_passes_its_prefill_chunk_to_the_program(tiny_target, prompts):
    chunked = e3.Generator(tiny_target, None, max_len=48, prefill_chunk=4)
    assert chunked.session.program(len(prompts)).prefill_chunk == 4
    assert chunked.generate(prompts, 12).tokens == e3.Generator(tiny_target, None, max_len=48).generate(prompts, 12).tokens
    with pytest.raises(e3.ConfigError, match="prefill_chunk must be >= 1"):
        e3.Generator(tiny_target, None, prefill_chunk=0)
