"""Attention over the filled prefix: the blocked online softmax equals the whole-capacity softmax,
and the target's cache tests still hold when the loop really runs (small key blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.models import attention, attention_core
from eagle3_jax.models.cache import KVCache, MLACache


def _masked_softmax(scores_BTNS, positions_BT):
    """The oracle: one softmax over the whole capacity, query at position p seeing slots 0..p."""
    visible_BTS = jnp.arange(scores_BTNS.shape[-1]) <= positions_BT[:, :, None]
    return jax.nn.softmax(jnp.where(visible_BTS[:, :, None], scores_BTNS, -jnp.inf), axis=-1)


def _reference(q_lat, q_rope, cache, layer, positions, scale):
    lat, rope = cache.latent_LBSC[layer], cache.rope_LBSP[layer]
    s = (jnp.einsum("btnc,bsc->btns", q_lat, lat) + jnp.einsum("btnp,bsp->btns", q_rope, rope)) * scale
    return jnp.einsum("btns,bsc->btnc", _masked_softmax(s, positions), lat)


@pytest.mark.parametrize("capacity,block", [(40, 8), (37, 8), (40, 40), (16, 128)])
def test_blocked_online_softmax_matches_whole_capacity(capacity, block):
    rng = np.random.default_rng(capacity + block)
    L, B, T, N, C, P = 2, 3, 4, 2, 16, 8
    cache = MLACache(jnp.asarray(rng.normal(size=(L, B, capacity, C)), jnp.float32),
                     jnp.asarray(rng.normal(size=(L, B, capacity, P)), jnp.float32))
    q_lat = jnp.asarray(rng.normal(size=(B, T, N, C)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, T, N, P)), jnp.float32)
    # ragged rows: one short, one ending in the last partial block, one past the capacity
    starts = np.array([0, capacity - T - 1, capacity - 2])
    positions = jnp.asarray(starts[:, None] + np.arange(T)[None, :], jnp.int32)
    got = attention.attend_filled(q_lat, q_rope, cache, 1, positions, 0.3, block)
    want = _reference(q_lat, q_rope, cache, 1, positions, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("capacity,block", [(40, 8), (37, 16), (12, 128)])
def test_draft_gqa_over_filled_slots_matches_whole_capacity(capacity, block):
    rng = np.random.default_rng(capacity)
    B, T, G, R, H = 3, 2, 2, 3, 8
    cache = KVCache(jnp.asarray(rng.normal(size=(B, capacity, G, H)), jnp.float32),
                    jnp.asarray(rng.normal(size=(B, capacity, G, H)), jnp.float32))
    q = jnp.asarray(rng.normal(size=(B, T, G * R, H)), jnp.float32)
    positions = jnp.asarray(np.array([1, capacity // 2, capacity - 2])[:, None] + np.arange(T), jnp.int32)
    fns = attention_core.grouped(q, cache.k_BSGH, cache.v_BSGH)
    got, _ = attention_core.blockwise(*fns, positions, capacity, attention_core.key_block(capacity, T, G * R, block))
    s = jnp.einsum("btgrh,bsgh->btgrs", q.reshape(B, T, G, R, H), cache.k_BSGH) * H ** -0.5
    probs = _masked_softmax(s.reshape(B, T, G * R, capacity), positions)
    want = jnp.einsum("btgrs,bsgh->btgrh", probs.reshape(B, T, G, R, capacity), cache.v_BSGH).reshape(B, T, G * R, H)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_loop_trips_follow_the_filled_length():
    """Slots past the longest row are never read: junk (NaN) there does not reach the output."""
    rng = np.random.default_rng(0)
    B, S, C, P = 2, 64, 8, 4
    lat = rng.normal(size=(1, B, S, C)).astype(np.float32)
    rope = rng.normal(size=(1, B, S, P)).astype(np.float32)
    lat[:, :, 16:] = np.nan   # beyond two blocks of 8: the loop must stop before them
    rope[:, :, 16:] = np.nan
    cache = MLACache(jnp.asarray(lat), jnp.asarray(rope))
    positions = jnp.asarray([[9], [15]], jnp.int32)
    q_lat = jnp.asarray(rng.normal(size=(B, 1, 2, C)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, 1, 2, P)), jnp.float32)
    out = attention.attend_filled(q_lat, q_rope, cache, 0, positions, 0.5, 8)
    assert np.isfinite(np.asarray(out)).all()


def test_target_decode_with_small_key_blocks(monkeypatch, tiny_target_dir):
    """Prefill, then decode and a 5-token extend, against one full forward per row, with the loop
    over 4-slot key blocks (a capacity no other test compiles, so the loop is really traced)."""
    import eagle3_jax as e3

    monkeypatch.setattr(attention_core, "KEY_BLOCK", 4)
    target = e3.load_target(tiny_target_dir)
    rng = np.random.default_rng(5)
    lengths = [6, 3, 11]
    seqs = [rng.integers(0, 256, size=L + 7) for L in lengths]
    prompts = np.zeros((3, max(lengths)), np.int64)
    for b, L in enumerate(lengths):
        prompts[b, :L] = seqs[b][:L]
    refs = [np.asarray(target.forward(np.asarray(s)[None]).logits)[0] for s in seqs]
    cache = target.init_cache(3, 26)
    logits, _, cache, lens = target.prefill(prompts, lengths, cache)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits)[b, :L], refs[b][:L], rtol=1e-4, atol=1e-5)
    nxt = np.array([[s[L]] for s, L in zip(seqs, lengths)])
    lg, _, cache, lens = target.extend(nxt, lens, cache)
    new = np.array([s[L + 1:L + 6] for s, L in zip(seqs, lengths)])
    lg5, _, cache, _ = target.extend(new, lens, cache)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(lg)[b, 0], refs[b][L], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lg5)[b], refs[b][L + 1:L + 6], rtol=1e-4, atol=1e-5)
