"""Training-time test: the unroll's attention (the core's dense and blockwise forms) equals the literal
unrolled reference, and both equal what the serving loop computes with its KV cache for the same
simulated draft steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.train import ttt
from tests.hf_fixtures import REPO
from tests.spec_fixtures import tiny_draft_config

B, T, V, W, D = 2, 12, 256, 64, 64


def target_signal(logits_BTV, loss_mask_BT, d2t_W, t2d_V, convention="ours", length_B=None) -> ttt.TargetSignal:
    """``ttt.target_signal_from_hidden`` from the logits themselves."""
    return ttt._signal(ttt._signal_fields(logits_BTV, d2t_W, t2d_V), loss_mask_BT, convention, length_B)


@pytest.fixture(scope="module")
def case():
    """A random draft (GQA 4/2, draft vocab 64 of 256 with a scattered map) and random target outputs."""
    cfg = e3.TargetConfig.from_path(REPO / "configs/models/tiny_deepseek_v3.json")
    draft = Draft(tiny_draft_config(cfg, draft_vocab=W), 3, jnp.float32, nnx.Rngs(3))
    rng = np.random.default_rng(0)
    target_ids = np.sort(rng.choice(V, W, replace=False))
    draft.d2t.value = jnp.asarray(target_ids - np.arange(W), jnp.int32)
    t2d = np.zeros(V, bool)
    t2d[target_ids] = True
    draft.t2d.value = jnp.asarray(t2d)
    logits = rng.normal(size=(B, T, V)) * 2
    # Most positions' top token inside the draft vocab, some outside (those must be masked).
    logits[..., target_ids] += 4 * (rng.random((B, T, 1)) < 0.8)
    loss_mask = rng.random((B, T)) < 0.85
    return dict(
        draft=draft,
        aux=jnp.asarray(rng.normal(size=(B, T, 3 * D)), jnp.float32),
        ids=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
        logits=jnp.asarray(logits, jnp.float32),
        loss_mask=jnp.asarray(loss_mask),
        embed=jnp.asarray(rng.normal(size=(V, D)) * 0.3, jnp.float32),
    )


STEPS = 3


def block_mask(T: int, n_steps: int) -> np.ndarray:
    """[T, n_steps * T] explicit mask for a query of the last step: block 0 causal, others diagonal."""
    mask = np.zeros((T, n_steps * T), bool)
    for t in range(T):
        mask[t, :t + 1] = True
        mask[t, np.arange(1, n_steps) * T + t] = True
    return mask


def naive_attend(prev, q_BTNH, k_BTGH, v_BTGH):
    """The literal reference: every step's keys concatenated along the key axis, one softmax under
    the explicit block mask (O(i T^2) per step)."""
    B, T, N, H = q_BTNH.shape
    G = k_BTGH.shape[2]
    keys, values = prev if prev is not None else ((), ())
    keys, values = keys + (k_BTGH,), values + (v_BTGH,)
    k_BSGH, v_BSGH = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
    scores = jnp.einsum("btgrh,bsgh->btgrs", q_BTNH.reshape(B, T, G, N // G, H), k_BSGH) * H ** -0.5
    mask = jnp.asarray(block_mask(T, len(keys)))[None, :, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("btgrs,bsgh->btgrh", probs, v_BSGH).reshape(B, T, N, H), (keys, values)


def _loss_and_grads(case, attention, steps=STEPS):
    draft = case["draft"]
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    signal = target_signal(case["logits"], case["loss_mask"], draft.d2t[...], draft.t2d[...])

    def f(p):
        return ttt.ttt_loss(nnx.merge(graphdef, p, rest), case["aux"], case["ids"], signal, case["embed"],
                            ttt.LossSpec(steps=steps, attention="efficient" if attention == "naive" else attention))

    if attention != "naive":
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    with pytest.MonkeyPatch.context() as mp:   # the unroll with the reference in place of the core
        mp.setattr(ttt, "_attend_fn", lambda spec: naive_attend)
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


@pytest.fixture(scope="module")
def results(case):
    return {a: _loss_and_grads(case, a) for a in ("efficient", "naive")}


def test_efficient_equals_naive_loss_and_gradients(results):
    (loss_e, m_e), g_e = results["efficient"]
    (loss_n, m_n), g_n = results["naive"]
    assert np.isfinite(float(loss_e))
    # The masks really bite: some positions are dropped, and fewer at later steps.
    counts = np.asarray(m_e["count"])
    assert 0 < counts[-1] < counts[0] < B * T
    np.testing.assert_allclose(loss_e, loss_n, rtol=1e-6)
    np.testing.assert_array_equal(m_e["count"], m_n["count"])
    np.testing.assert_allclose(m_e["loss"], m_n["loss"], rtol=1e-6)
    flat_e, flat_n = jax.tree.leaves(g_e), jax.tree.leaves(g_n)
    assert len(flat_e) == len(flat_n) > 10
    for a, b in zip(flat_e, flat_n):
        assert float(jnp.max(jnp.abs(a))) > 0  # every parameter gets a gradient (fc included)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_loss_is_decayed_sum_of_step_losses(results):
    (loss, m), _ = results["efficient"]
    np.testing.assert_allclose(loss, sum(0.8 ** i * m["loss"][i] for i in range(STEPS)), rtol=1e-6)


def test_block_mask_is_causal_then_diagonal():
    mask = block_mask(3, 3)
    expected = np.array([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ], bool)
    np.testing.assert_array_equal(mask, expected)


def _unroll(draft, aux, ids, embed, steps: int) -> list:
    """The draft's logits [B, T, W] at each simulated step."""
    return [draft.head(out) for out in ttt.ttt_outputs(draft, aux, ids, embed, ttt.LossSpec(steps=steps))]


def test_unrolled_steps_equal_the_serving_path_with_a_kv_cache(case):
    """Step i at index t sees step 0's keys 0..t and one key per simulated step: exactly the cache
    slots the serving loop has filled when it drafts its i-th token after position t."""
    draft, aux, ids, embed = case["draft"], case["aux"], case["ids"], case["embed"]
    graphdef, state = nnx.split(draft)
    steps = STEPS + 1
    unrolled = jax.jit(lambda st: _unroll(nnx.merge(graphdef, st), aux, ids, embed, steps))(state)
    unrolled = [np.asarray(x) for x in unrolled]

    @jax.jit
    def serve(st, t_ids, hidden, pos, cache):
        out = nnx.merge(graphdef, st)(t_ids, hidden, pos, embed, cache)
        return out.logits_BTW, out.hidden_BTD, out.cache

    for t in (0, 4, T - steps - 1):
        cache = draft.init_cache(B, T + steps)
        pos = jnp.broadcast_to(jnp.arange(t + 1, dtype=jnp.int32), (B, t + 1))
        logits, hidden, cache = serve(state, ids[:, 1:t + 2], draft.fuse(aux[:, :t + 1]), pos, cache)
        np.testing.assert_allclose(logits[:, t], unrolled[0][:, t], rtol=1e-4, atol=1e-5)
        hidden = hidden[:, t:t + 1]
        for i in range(1, steps):
            p = jnp.full((B, 1), t + i, jnp.int32)
            logits, hidden, cache = serve(state, ids[:, t + 1 + i:t + 2 + i], hidden, p, cache)
            np.testing.assert_allclose(logits[:, 0], unrolled[i][:, t], rtol=1e-4, atol=1e-5)


def test_target_signal_masks_and_restricts(case):
    draft = case["draft"]
    logits, mask = case["logits"], case["loss_mask"]
    sig = target_signal(logits, mask, draft.d2t[...], draft.t2d[...])
    target_ids = np.arange(W) + np.asarray(draft.d2t[...])
    np.testing.assert_allclose(sig.probs_BTW, jax.nn.softmax(np.asarray(logits)[..., target_ids], -1), rtol=1e-6)
    top = np.asarray(logits).argmax(-1)
    next_mask = np.concatenate([np.asarray(mask)[:, 1:], np.zeros((B, 1), bool)], 1)
    np.testing.assert_array_equal(sig.usable_BT, np.isin(top, target_ids) & next_mask)


def test_blockwise_attention_equals_dense_in_loss_and_gradients(case, results):
    """Key blocks of 5 over 12 positions (a partial last block), the head and loss in chunks of 5, each
    step recomputed in the backward pass:
    the same loss and gradients as the dense attention, float32."""
    draft = case["draft"]
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    signal = target_signal(case["logits"], case["loss_mask"], draft.d2t[...], draft.t2d[...])

    def f(p):
        spec = ttt.LossSpec(steps=STEPS, attention="blockwise", attention_block=5, loss_chunk=5, remat=True)
        return ttt.ttt_loss(nnx.merge(graphdef, p, rest), case["aux"], case["ids"], signal, case["embed"], spec)

    (loss_b, m_b), g_b = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    (loss_e, m_e), g_e = results["efficient"]
    np.testing.assert_allclose(loss_b, loss_e, rtol=1e-5)
    np.testing.assert_allclose(m_b["loss"], m_e["loss"], rtol=1e-5)
    np.testing.assert_array_equal(m_b["count"], m_e["count"])
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_e)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def _assert_signal_in_chunks_equals_whole(case, chunk: int):
    """``target_signal_from_hidden`` in chunks (jitted: under a mesh, as the train step runs it)
    equals the signal of the whole row's logits, in both conventions."""
    draft = case["draft"]
    rng = np.random.default_rng(7)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)
    chunked_fn = jax.jit(ttt.target_signal_from_hidden, static_argnums=(5, 6))
    for convention in ttt.CONVENTIONS:
        whole = target_signal(ttt.target_logits(hidden, head), case["loss_mask"], draft.d2t[...],
                                  draft.t2d[...], convention)
        chunked = chunked_fn(hidden, head, case["loss_mask"], draft.d2t[...], draft.t2d[...], convention, chunk)
        for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_target_signal_in_chunks_equals_whole(case):
    _assert_signal_in_chunks_equals_whole(case, 5)


def test_sequence_parallel_loss_gradients_and_memory(case, results):
    """On a mesh whose ``draft_seq`` axis (expert) has 4 devices, a row's 12 positions are split 4
    ways (3 each; loss chunks of 2 leave a padded chunk per shard): the loss, counts and gradients
    equal the one-device dense result, and the target's signal equals the unchunked one in both
    conventions (specforge's 13 positions pad the last shard). Split for real: at 256 positions the
    compiled step's temporaries per device are well under the one-device program's."""
    draft = case["draft"]
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    signal = target_signal(case["logits"], case["loss_mask"], draft.d2t[...], draft.t2d[...])
    spec = ttt.LossSpec(steps=STEPS, attention="blockwise", attention_block=4, loss_chunk=2, remat=True)

    def f(p, aux, ids, sig):
        return ttt.ttt_loss(nnx.merge(graphdef, p, rest), aux, ids, sig, case["embed"], spec)

    step = jax.jit(jax.value_and_grad(f, has_aux=True))
    mesh = e3.make_mesh("data=1,expert=4,tensor=2")
    with jax.set_mesh(mesh):
        assert ttt._seq_chunks(T, 2) == (4, 2, 2)
        (loss_s, m_s), g_s = step(params, case["aux"], case["ids"], signal)
        _assert_signal_in_chunks_equals_whole(case, 2)
    (loss_e, m_e), g_e = results["efficient"]
    np.testing.assert_allclose(loss_s, loss_e, rtol=1e-5)
    np.testing.assert_allclose(m_s["loss"], m_e["loss"], rtol=1e-5)
    np.testing.assert_array_equal(m_s["count"], m_e["count"])
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_e)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))

    # memory: 256 positions, 64-position loss chunks and key blocks
    long_T = 256
    long_spec = ttt.LossSpec(steps=STEPS, attention="blockwise", attention_block=64, loss_chunk=64, remat=True)
    rng = np.random.default_rng(1)
    aux = jnp.asarray(rng.normal(size=(1, long_T, 3 * D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (1, long_T)), jnp.int32)
    sig = target_signal(jnp.asarray(rng.normal(size=(1, long_T, V)), jnp.float32),
                            jnp.ones((1, long_T), bool), draft.d2t[...], draft.t2d[...])

    def g(p, aux, ids, sig):
        return ttt.ttt_loss(nnx.merge(graphdef, p, rest), aux, ids, sig, case["embed"], long_spec)

    def temp_bytes(mesh_spec):
        with jax.set_mesh(e3.make_mesh(mesh_spec)):
            compiled = jax.jit(jax.value_and_grad(g, has_aux=True)).lower(params, aux, ids, sig).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, split4 = temp_bytes("data=1,expert=1,tensor=1"), temp_bytes("data=1,expert=4,tensor=1")
    assert split4 < 0.5 * one, (split4, one)
