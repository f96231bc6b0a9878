"""SpecForge's P-EAGLE objective: the depth sampler's rules, and the loss against the torch
reference of test_peagle (its logits, then soft-label cross-entropy over the draft vocab)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3_jax.drafts.peagle.objective import CODSettings, cod_budget, cod_sample, pad_rollouts, peagle_loss
from tests.test_peagle import V, W, exported, reference_logits  # noqa: F401  (module fixture)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cod_sampler_rules(seed):
    s = CODSettings()
    rng = np.random.default_rng(seed)
    T = 60
    loss_mask = (rng.random(T) < 0.8).astype(np.int64)
    doc = np.repeat([0, 1, 2], [25, 25, 10])
    anchor, depth = cod_sample(loss_mask, s, rng, doc)
    assert len(anchor) <= cod_budget(T, s)
    np.testing.assert_array_equal(anchor[depth == 0], np.arange(T))
    n_valid = int(loss_mask.sum())
    prev = None
    for d in range(1, s.num_depths):
        a = anchor[depth == d]
        if not len(a):
            break
        pos = a + d
        assert (loss_mask[pos] == 1).all() and (doc[pos] == doc[a]).all()
        assert len(a) <= int((n_valid - d) * s.ratio(d))
        assert (np.diff(pos) > 0).all()
        if prev is not None:   # a depth-d rollout extends a depth-(d-1) one
            assert np.isin(a, prev).all()
        prev = a


def test_loss_matches_torch_reference(exported):
    model, path = exported
    rng = np.random.default_rng(4)
    T = 12
    # a vocab map consistent with t2d: W ascending target ids
    chosen = np.sort(rng.choice(V, W, replace=False))
    model.d2t[...] = jnp.asarray(chosen - np.arange(W), jnp.int32)
    t2d = np.zeros(V, bool)
    t2d[chosen] = True
    model.t2d[...] = jnp.asarray(t2d)
    ids, aux = rng.integers(0, V, T), rng.standard_normal((T, 72)).astype(np.float32)
    target = rng.standard_normal((T, V)).astype(np.float32) * 3
    target[3, chosen[5]] = 30.0           # in the draft vocab
    target[4, np.flatnonzero(~t2d)[0]] = 30.0   # outside: weighs nothing
    loss_mask = np.ones(T, np.float32)
    loss_mask[7] = 0
    anchor, depth = cod_sample(loss_mask, CODSettings(num_depths=4, down_sample_ratio=0.8), rng)
    a, d, valid = pad_rollouts(anchor, depth, len(anchor) + 5)
    loss, metrics = peagle_loss(model, *(jnp.asarray(x)[None] for x in (ids, aux, target, loss_mask, a, d, valid)),
                                num_depths=4)

    sd = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    with torch.no_grad():
        logits = reference_logits(sd, cfg, ids, torch.as_tensor(aux), anchor, depth)[0]
    pos = anchor + depth
    tl = torch.as_tensor(target)[pos]
    p = tl[:, torch.as_tensor(t2d)].softmax(-1)
    w = torch.as_tensor(loss_mask)[pos] * torch.as_tensor(t2d)[tl.argmax(-1)]
    ce = -(p * logits.log_softmax(-1)).sum(-1)
    ref = float((w * ce).sum() / w.sum())
    assert abs(float(loss) - ref) / abs(ref) < 1e-5
    assert int(np.asarray(metrics["acc_total"]).sum()) == int(w.sum())
