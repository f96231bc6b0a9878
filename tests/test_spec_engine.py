"""Continuous batching: refilled rows give exactly what one-at-a-time generation gives."""

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.speculative.engine import Engine, Request


@pytest.fixture(scope="module")
def prompts(tiny_target):
    rng = np.random.default_rng(0)
    base = rng.integers(2, tiny_target.config.vocab_size, size=(48, 6)).tolist()
    # trained-on prompts (long accepted runs) mixed with unseen ones of other lengths
    return [base[0], rng.integers(2, 256, size=3).tolist(), base[1][:5], base[2], rng.integers(2, 256, size=9).tolist()]


def test_refill_equals_one_at_a_time(tiny_target, trained_draft_dir, prompts):
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    one = e3.Generator(tiny_target, draft, num_draft_tokens=3, max_len=48)
    eos = (one.generate([prompts[0]], 20).tokens[0][7],)  # stops prompt 0 early, so its row is refilled
    expected = [one.generate([p], 20, eos_token_ids=eos) for p in prompts]
    eng = Engine(tiny_target, draft, num_draft_tokens=3, max_len=48, batch_size=2, max_new_tokens=20,
                 eos_token_ids=eos, rounds_per_sync=3)
    got = list(eng.run(Request(str(i), p) for i, p in enumerate(prompts)))
    assert sorted(f.key for f in got) == [str(i) for i in range(len(prompts))]
    by_key = {f.key: f for f in got}
    for i, exp in enumerate(expected):
        fin = by_key[str(i)]
        assert fin.tokens == exp.tokens[0]
        assert fin.finish_reason == exp.finish_reasons[0]
        assert fin.stats.rounds == exp.stats.rounds and fin.stats.round_tokens == exp.stats.round_tokens
    assert by_key["0"].finish_reason == "eos"
    assert eng.stats.tokens == sum(len(e.tokens[0]) for e in expected)
    assert eng.stats.mean_accept_length > 1.2


def test_another_token_budget_compiles_nothing(tiny_target, trained_draft_dir, prompts):
    """max_new_tokens is traced, not compiled in: a job with another budget reuses every program of
    the first (same rows, capacity and K), and its greedy output is the longer budget's prefix."""
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=3, max_len=48)
    longer = gen.generate(prompts[:1], 20)
    shorter = gen.generate(prompts[:1], 9)
    assert gen.last_compiled_programs == 0
    assert shorter.tokens[0] == longer.tokens[0][:9] and shorter.finish_reasons == ["length"]


def test_a_rewired_draft_compiles_nothing_and_taps_the_layers_it_names(tiny_target, trained_draft_dir, prompts):
    """The aux layer ids are traced, not compiled in: the same weights wired to other target layers
    (what the doctor measures) reuse every program of the first wiring, stay lossless, and really
    read the other layers (the trained wiring is accepted more; the traced selection of the aux
    states gives the constant one's layers, in its order: equal up to the rounding of two programs
    fused differently)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from eagle3_jax.drafts import LoadedDraft

    draft = e3.load_draft(trained_draft_dir, tiny_target)
    trained = e3.Generator(tiny_target, draft, num_draft_tokens=3, max_len=48).generate(prompts, 20)
    rewired = LoadedDraft(draft.model, tiny_target, (2, 0, 1))
    gen = e3.Generator(tiny_target, rewired, num_draft_tokens=3, max_len=48)
    other = gen.generate(prompts, 20)
    assert gen.last_compiled_programs == 0
    assert other.tokens == trained.tokens
    assert other.stats.mean_accept_length < trained.stats.mean_accept_length

    ids_BT = jnp.asarray([prompts[0][:6]], jnp.int32)
    cache = tiny_target.init_cache(1, 8)
    traced = jax.jit(lambda ids_N: nnx.merge(tiny_target.graphdef, tiny_target.state)(
        ids_BT, jnp.arange(6)[None], cache, ids_N).aux_BTX)(jnp.asarray([2, 0, 1], jnp.int32))
    constant = tiny_target.forward(ids_BT, aux_layer_ids=(2, 0, 1)).aux_hidden
    np.testing.assert_allclose(np.asarray(traced), np.asarray(constant), rtol=0, atol=1e-5)


def test_prompt_too_long_is_refused(tiny_target):
    eng = Engine(tiny_target, None, max_len=8, batch_size=1, max_new_tokens=2)
    with pytest.raises(e3.ConfigError, match="max_len - 1 = 7"):
        list(eng.run([Request("x", list(range(8)))]))


@pytest.mark.parametrize("with_draft", [True, False])
def test_several_admissions_per_sync_equal_one_at_a_time(tiny_target, trained_draft_dir, prompts, with_draft,
                                                          monkeypatch):
    """Rows finish together and are refilled together: admissions of 1..4 rows, by prefill calls of
    the whole batch (or max_admit_rows) or of the refill size only."""
    from eagle3_jax.speculative import engine as engine_module

    draft = e3.load_draft(trained_draft_dir, tiny_target) if with_draft else None
    many = prompts + [p[::-1] for p in prompts]
    one = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=40)
    expected = [one.generate([p], 7).tokens[0] for p in many]
    calls = []   # (rows per call, rows admitted) of each prefill call

    def recorded(*args, **kw):
        rows_A = args[6]
        calls.append((len(rows_A), int((rows_A < 4).sum())))
        return admit_rows(*args, **kw)

    admit_rows = engine_module.admit_rows
    monkeypatch.setattr(engine_module, "admit_rows", recorded)
    for max_admit_rows, sizes in ((None, {1, 4}), (3, {1, 3})):   # 3: four free rows are admitted as 3 + 1
        calls.clear()
        eng = Engine(tiny_target, draft, num_draft_tokens=2, max_len=40, batch_size=4, max_new_tokens=7,
                     rounds_per_sync=2, max_admit_rows=max_admit_rows)
        got = {f.key: f.tokens for f in eng.run(Request(str(i), p) for i, p in enumerate(many))}
        assert [got[str(i)] for i in range(len(many))] == expected, max_admit_rows
        assert {a for a, _ in calls} == sizes and sum(n for _, n in calls) == len(many), (max_admit_rows, calls)


def test_refills_pad_to_a_compiled_prompt_block(tiny_target, trained_draft_dir, monkeypatch):
    """Prompts of buckets 16, 24 and 32 (max_len 48): the first admission compiles block 32, and every
    refill pads to it (at most twice its own bucket) instead of compiling a block per bucket; the
    tokens are those of one-at-a-time generation at each prompt's own block."""
    from eagle3_jax.speculative import engine as engine_module

    draft = e3.load_draft(trained_draft_dir, tiny_target)
    one = e3.Generator(tiny_target, draft, num_draft_tokens=3, max_len=48)
    # prompts that continue the trained-on ones along the target's own greedy text, so the draft is accepted
    base = np.random.default_rng(0).integers(2, tiny_target.config.vocab_size, size=(5, 6)).tolist()
    many = [(b + one.generate([b], 24).tokens[0])[:n] for b, n in zip(base, (30, 20, 10, 25, 12))]
    expected = [one.generate([p], 20).tokens[0] for p in many]
    blocks = set()   # (rows per call, prompt block) of each prefill call
    admit_rows = engine_module.admit_rows

    def recorded(*args, **kw):
        blocks.add((len(args[6]), args[7].shape[1]))
        return admit_rows(*args, **kw)

    monkeypatch.setattr(engine_module, "admit_rows", recorded)
    eng = Engine(tiny_target, draft, num_draft_tokens=3, max_len=48, batch_size=2, max_new_tokens=20, rounds_per_sync=3)
    got = {f.key: f.tokens for f in eng.run(Request(str(i), p) for i, p in enumerate(many))}
    assert [got[str(i)] for i in range(len(many))] == expected
    assert blocks == {(2, 32), (1, 32)}, blocks


def test_admission_blocks_pad_to_a_compiled_block_until_padding_costs_a_compile():
    from eagle3_jax.speculative.session import AdmissionBlocks

    blocks, p = AdmissionBlocks(), "program"
    assert blocks.block(p, True, 1, 16) == 16   # nothing compiled
    blocks.ran(p, True, 8, 16, 32, 2.0, compiled_seconds=10.0)
    assert blocks.block(p, True, 1, 16) == 32 and blocks.block(p, False, 1, 16) == 16   # the draft's kind apart
    blocks.ran(p, True, 1, 48, 48, 1.0, compiled_seconds=10.0)
    assert blocks.block(p, True, 1, 24) == 48   # this row count's own program first
    assert blocks.block(p, True, 1, 64) == 64 and blocks.block(p, True, 8, 12) == 12   # never smaller, at most 2x
    for _ in range(4):   # 4 x 4 s x (32 - 16) / 32 = 8 s of padding: less than the compile
        assert blocks.block(p, True, 4, 16) == 32
        blocks.ran(p, True, 4, 16, 32, 4.0, compiled_seconds=None)
    blocks.ran(p, True, 4, 16, 32, 4.0, compiled_seconds=None)   # 10 s: a compile's worth
    assert blocks.block(p, True, 4, 16) == 16 and blocks.block(p, True, 2, 16) == 32


def test_every_process_runs_process_0s_choice_of_k(tiny_target, trained_draft_dir, prompts, monkeypatch):
    """Under several processes each run takes process 0's K and run length (a policy's own choice rests
    on timings, which differ between processes). One process here, its broadcast replaced by one
    that answers K = 0: the engine runs target-only rounds, and gives target-only's tokens."""
    from eagle3_jax.speculative import engine as engine_module

    offered = []

    def process_0(obj):
        offered.append(obj)
        return [0, obj[1]] if isinstance(obj, list) else obj

    monkeypatch.setattr(engine_module, "broadcast_json", process_0)
    draft = e3.load_draft(trained_draft_dir, tiny_target)
    eng = Engine(tiny_target, draft, num_draft_tokens=3, max_len=48, batch_size=2, max_new_tokens=20, rounds_per_sync=3)
    got = {f.key: f.tokens for f in eng.run(Request(str(i), p) for i, p in enumerate(prompts))}
    plain = e3.Generator(tiny_target, None, max_len=48)
    assert [got[str(i)] for i in range(len(prompts))] == [plain.generate([p], 20).tokens[0] for p in prompts]
    assert [3, True] in offered and eng.speculative_stats.rounds == 0


def test_admission_calls_use_two_row_counts():
    from eagle3_jax.speculative.engine import admission_calls

    assert [admission_calls(n, 8, 1) for n in range(1, 9)] == [[1], [1, 1], [1, 1, 1], [1] * 4] + [[8]] * 4
    assert admission_calls(16, 32, 4) == [4] * 4 and admission_calls(17, 32, 4) == [32]
    assert admission_calls(4, 3, 1) == [3, 1] and admission_calls(2, 3, 1) == [3]
