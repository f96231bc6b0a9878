"""Cache consistency: prefill + decode / extend equals one full forward, with ragged rows."""

import jax
import numpy as np
import pytest

import eagle3_jax as e3


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return e3.load_target(tiny_target_dir)


def _full_logits(target, seq):
    return np.asarray(target.forward(np.asarray(seq)[None]).logits)[0]


def test_prefill_then_decode_and_extend_match_full_forward(target):
    rng = np.random.default_rng(3)
    lengths = [7, 4, 9]
    n_new = 6
    seqs = [rng.integers(0, 256, size=L + n_new) for L in lengths]
    T = max(lengths)
    prompts = np.zeros((3, T), np.int64)
    for b, L in enumerate(lengths):
        prompts[b, :L] = seqs[b][:L]
    refs = [_full_logits(target, s) for s in seqs]

    aux_ids = (0, 2)
    cache = target.init_cache(3, 32)
    logits, aux, cache, lens = target.prefill(prompts, lengths, cache, aux_layer_ids=aux_ids)
    logits = np.asarray(logits)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :L], refs[b][:L], rtol=1e-4, atol=1e-5)

    # token by token
    dec_cache = jax.tree_util.tree_map(lambda x: x.copy(), cache)
    dec_lens = lens
    for step in range(n_new):
        nxt = np.array([[s[L + step]] for s, L in zip(seqs, lengths)])
        lg, _, dec_cache, dec_lens = target.extend(nxt, dec_lens, dec_cache)
        lg = np.asarray(lg)
        for b, L in enumerate(lengths):
            np.testing.assert_allclose(lg[b, 0], refs[b][L + step], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(dec_lens), np.array(lengths) + n_new)

    # one extend of 5 tokens (what verification does)
    new = np.array([s[L:L + 5] for s, L in zip(seqs, lengths)])
    lg, aux5, cache, lens5 = target.extend(new, lens, cache, aux_layer_ids=aux_ids)
    lg = np.asarray(lg)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(lg[b], refs[b][L:L + 5], rtol=1e-4, atol=1e-5)
    assert aux5.shape == (3, 5, 2 * target.config.hidden_size)


def test_stale_slots_are_masked_then_overwritten(target):
    """Write junk past the length (a rejected draft), then continue: results equal a clean run."""
    rng = np.random.default_rng(4)
    seq = rng.integers(0, 256, size=12)
    ref = _full_logits(target, seq)
    cache = target.init_cache(1, 16)
    _, _, cache, lens = target.prefill(seq[None, :8], [8], cache)
    junk = rng.integers(0, 256, size=(1, 4))
    _, _, cache, _ = target.extend(junk, lens, cache)  # pretend these 4 were rejected: keep lens
    lg, _, cache, _ = target.extend(seq[None, 8:12], lens, cache)
    np.testing.assert_allclose(np.asarray(lg)[0], ref[8:12], rtol=1e-4, atol=1e-5)


def test_writes_past_capacity_are_dropped(target):
    cache = target.init_cache(1, 4)
    _, _, cache, _ = target.prefill(np.arange(4)[None], [4], cache)
    before = np.asarray(cache.latent_LBSC).copy()
    _, _, cache, _ = target.extend(np.array([[5, 6]]), np.array([4]), cache)
    np.testing.assert_array_equal(np.asarray(cache.latent_LBSC), before)
