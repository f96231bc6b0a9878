"""The target against transformers' DeepseekV3ForCausalLM (independent oracle), float32."""

import numpy as np
import pytest

import eagle3_jax as e3
from tests import hf_fixtures
from tests.hf_fixtures import PARITY_CONFIGS


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(0).integers(0, 256, size=(3, 11))


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_logits_and_aux_match_transformers(hf_target_dirs, prompt_ids, name):
    path, torch_model = hf_target_dirs[name]
    target = e3.load_target(path, dtype="float32")
    L = target.config.num_hidden_layers
    aux_ids = (0, 1, L - 2)
    out = target.forward(prompt_ids, aux_layer_ids=aux_ids)
    ref = hf_fixtures.torch_forward(torch_model, prompt_ids, output_hidden_states=True)
    ref_logits = ref.logits.numpy()
    assert rel_err(out.logits, ref_logits) < 1e-4
    np.testing.assert_array_equal(np.argmax(out.logits, -1), np.argmax(ref_logits, -1))
    # transformers' hidden_states[0] is the embedding, [i + 1] the output of layer i (pre-norm for i < L-1).
    D = target.config.hidden_size
    aux = np.asarray(out.aux_hidden)
    assert aux.shape == (3, 11, len(aux_ids) * D)
    for n, i in enumerate(aux_ids):
        assert rel_err(aux[..., n * D:(n + 1) * D], ref.hidden_states[i + 1].numpy()) < 1e-4


def test_routing_is_exercised(hf_target_dirs):
    """The parity configs must route tokens to several experts, else the MoE test proves little."""
    import jax.numpy as jnp
    from eagle3_jax.models.moe import route

    path, _ = hf_target_dirs["qlora_groups_yarn"]
    target = e3.load_target(path)
    moe = target.model.layers[1].mlp
    x = jnp.asarray(np.random.default_rng(1).normal(size=(64, target.config.hidden_size)), jnp.float32)
    idx, w = route(x, moe.gate.value, moe.e_score_correction_bias.value, target.config)
    assert len(np.unique(np.asarray(idx))) >= 6
    # group limit: with 4 groups of 2 and topk_group 2, each token's experts span at most 2 groups
    groups = np.asarray(idx) // 2
    assert max(len(set(r)) for r in groups) <= 2
