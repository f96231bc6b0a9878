"""The same forward on several (data, expert, tensor) meshes equals one device."""

import numpy as np
import pytest

import eagle3_jax as e3


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    ids = np.random.default_rng(5).integers(0, 256, size=(4, 6))
    out = e3.load_target(tiny_target_dir).forward(ids, aux_layer_ids=(0, 1, 2))
    return ids, np.asarray(out.logits), np.asarray(out.aux_hidden)


@pytest.mark.parametrize("mesh_spec", ["data=1,expert=8,tensor=1", "data=2,expert=2,tensor=2", "data=8,expert=1,tensor=1"])
def test_sharded_forward_matches_single_device(tiny_target_dir, reference, mesh_spec):
    ids, ref_logits, ref_aux = reference
    mesh = e3.make_mesh(mesh_spec)
    target = e3.load_target(tiny_target_dir, mesh=mesh)
    w = target.model.layers[1].mlp.w_gate.value
    if mesh.shape["expert"] > 1:
        assert w.sharding.spec[0] == "expert"  # experts really are split, not replicated
        assert len({str(s.index) for s in w.addressable_shards}) == mesh.shape["expert"] * (
            mesh.shape["tensor"] if w.sharding.spec[2] == "tensor" else 1)
    out = target.forward(ids, aux_layer_ids=(0, 1, 2))
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.aux_hidden), ref_aux, rtol=1e-5, atol=1e-5)
