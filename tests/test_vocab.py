"""The draft vocab map from token frequencies, and a draft carrying it round-tripping through export."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.errors import ConfigError
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.train import vocab as vocab_lib
from tests.spec_fixtures import tiny_draft_config


def target_ids(vm: vocab_lib.VocabMap) -> np.ndarray:
    """The target id of each draft id: ``i + d2t[i]``."""
    return np.arange(len(vm.d2t), dtype=np.int64) + vm.d2t


def test_top_tokens_by_frequency_sorted_by_target_id():
    counts = np.zeros(10, np.int64)
    counts[[7, 2, 9, 4, 0]] = [50, 40, 30, 20, 10]
    vm = vocab_lib.build_vocab_map(counts, 3)
    np.testing.assert_array_equal(target_ids(vm), [2, 7, 9])          # top-3 by count, in id order
    np.testing.assert_array_equal(vm.d2t, [2 - 0, 7 - 1, 9 - 2])      # d2t[i] = target_id(i) - i
    np.testing.assert_array_equal(np.flatnonzero(vm.t2d), [2, 7, 9])
    assert vm.d2t.dtype == np.int32 and vm.t2d.dtype == bool


def test_ties_go_to_lower_ids_and_unseen_ids_fill_the_rest():
    counts = np.array([0, 5, 0, 5, 5, 0, 1, 0], np.int64)
    np.testing.assert_array_equal(target_ids(vocab_lib.build_vocab_map(counts, 2)), [1, 3])
    # 4 seen tokens, 6 slots: the two lowest unseen ids (0, 2) complete the map.
    np.testing.assert_array_equal(target_ids(vocab_lib.build_vocab_map(counts, 6)), [0, 1, 2, 3, 4, 6])
    full = vocab_lib.build_vocab_map(counts, 8)
    assert not full.d2t.any() and full.t2d.all()  # the whole vocab: the identity map


def test_counts_only_loss_masked_tokens():
    examples = [(np.array([1, 2, 2, 3]), np.array([0, 1, 1, 0], bool)), (np.array([3, 3]), np.array([1, 1], bool))]
    np.testing.assert_array_equal(vocab_lib.token_counts(examples, 5), [0, 0, 2, 2, 0])
    with pytest.raises(ConfigError, match="outside the target vocab"):
        vocab_lib.token_counts([(np.array([7]), np.array([True]))], 5)


def test_saved_map_is_reused_and_a_mismatch_is_refused(tmp_path):
    path = tmp_path / "vocab.npz"
    counts = np.arange(16, dtype=np.int64)
    first = vocab_lib.load_or_build(path, lambda: counts, 16, 4)
    np.testing.assert_array_equal(target_ids(first), [12, 13, 14, 15])
    again = vocab_lib.load_or_build(path, lambda: counts[::-1].copy(), 16, 4)  # counts ignored: reused
    np.testing.assert_array_equal(again.d2t, first.d2t)
    with pytest.raises(ConfigError, match="draft_vocab_size 8"):
        vocab_lib.load_or_build(path, lambda: counts, 16, 8)


def test_draft_with_a_vocab_map_round_trips_through_export(tiny_target, tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, size=256)
    vm = vocab_lib.build_vocab_map(counts, 48)
    model = Draft(tiny_draft_config(tiny_target.config, aux_ids=(0, 1, 3), draft_vocab=48), 3, jnp.float32,
                  nnx.Rngs(1))
    model.d2t.value = jnp.asarray(vm.d2t)
    model.t2d.value = jnp.asarray(vm.t2d)
    e3.save_draft(e3.LoadedDraft(model, tiny_target, (0, 1, 3)), tmp_path / "d")
    loaded = e3.load_draft(tmp_path / "d", tiny_target)
    assert loaded.aux_layer_ids == (0, 1, 3)
    np.testing.assert_array_equal(loaded.model.d2t[...], vm.d2t)
    np.testing.assert_array_equal(loaded.model.t2d[...], vm.t2d)
    ids = rng.integers(0, 256, size=(1, 5))
    aux = tiny_target.forward(ids, aux_layer_ids=(0, 1, 3)).aux_hidden
    before = e3.LoadedDraft(model, tiny_target, (0, 1, 3)).forward(ids, aux).logits
    np.testing.assert_allclose(loaded.forward(ids, aux).logits, before, rtol=1e-6, atol=1e-6)
    # Draft ids map to the chosen target ids.
    np.testing.assert_array_equal(loaded.model.to_target_ids(jnp.arange(48)), target_ids(vm))
