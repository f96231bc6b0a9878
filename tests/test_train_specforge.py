"""The loss conventions and the LK objective against a torch reference written from SpecForge's
formulas (its trainer step: target head shift, ``_compute_target_p``, the per-step ``padding``
of the masks, ``_compute_loss``'s mean over B*T, ``compute_acceptance_rate`` and
``compute_lk_loss``, steps weighted 0.8^i).

The reference reduces the same per-step draft logits (our unroll, which the serving-path test in
test_ttt.py pins down); its gradient with respect to those logits, pulled back through our
unroll, is the reference grad(fc)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.train import ttt
from tests.hf_fixtures import REPO
from tests.spec_fixtures import tiny_draft_config

B, T, V, W, D = 2, 14, 256, 64, 64
STEPS = 3


@pytest.fixture(scope="module")
def case():
    """Two conversations: row 0 full length with a gap in its loss mask, row 1 padded after 10
    tokens. Token 0 has a draft id and row 0's last token is a loss token, so SpecForge's zero row
    past the end is counted."""
    cfg = e3.TargetConfig.from_path(REPO / "configs/models/tiny_deepseek_v3.json")
    draft = Draft(tiny_draft_config(cfg, draft_vocab=W), 3, jnp.float32, nnx.Rngs(5))
    rng = np.random.default_rng(1)
    target_ids = np.sort(np.concatenate([[0], rng.choice(np.arange(1, V), W - 1, replace=False)]))
    draft.d2t.value = jnp.asarray(target_ids - np.arange(W), jnp.int32)
    t2d = np.zeros(V, bool)
    t2d[target_ids] = True
    draft.t2d.value = jnp.asarray(t2d)
    logits = rng.normal(size=(B, T, V)) * 2
    logits[..., target_ids] += 4 * (rng.random((B, T, 1)) < 0.8)
    loss_mask = np.zeros((B, T), bool)
    loss_mask[0, 4:8] = loss_mask[0, 10:] = True        # a gap at 8, 9
    loss_mask[1, 3:10] = True                           # padded from 10
    ids = rng.integers(1, V, (B, T))
    ids[1, 10:] = 0
    logits[1, 10:] = 0.0
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    return dict(graphdef=graphdef, params=params, rest=rest, t2d=t2d,
                aux=jnp.asarray(rng.normal(size=(B, T, 3 * D)), jnp.float32),
                ids=jnp.asarray(ids, jnp.int32), logits=np.asarray(logits, np.float32),
                loss_mask=loss_mask, embed=jnp.asarray(rng.normal(size=(V, D)) * 0.3, jnp.float32))


# ---------------------------------------------------------------------- the reference (torch)
def _pad_left_shift(x):
    """SpecForge's ``padding(x, left=False)``: drop the first position, append zeros."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, -1:])], dim=1)


def specforge_loss(step_logits, target_logits, loss_mask, t2d, lk_loss_type=None, kl_scale=1.0, kl_decay=1.0,
                   decay=0.8):
    target = _pad_left_shift(torch.as_tensor(target_logits, dtype=torch.float64))   # online capture's shift
    t2d = torch.as_tensor(t2d)
    top = target.argmax(-1)
    position_mask = t2d[top][..., None].double() * torch.as_tensor(loss_mask)[..., None].double()
    draft_head = target[..., t2d]
    target_p = torch.softmax(draft_head, dim=2)
    p_on_draft = torch.exp(draft_head - torch.logsumexp(target, dim=-1, keepdim=True))
    n = len(step_logits)
    target_p = torch.nn.functional.pad(target_p, (0, 0, 0, n), value=1 / target_p.shape[-1])
    p_on_draft = torch.nn.functional.pad(p_on_draft, (0, 0, 0, n), value=0.0)
    total = 0.0
    for idx, logits in enumerate(step_logits):
        tp = target_p[:, idx:idx + T]
        tpd = p_on_draft[:, idx:idx + T]
        logp = torch.log_softmax(logits, dim=2)
        kl = -torch.sum(position_mask * tp * logp, 2).mean()
        a = torch.minimum(tpd, torch.softmax(logits, dim=-1)).sum(-1)
        m = position_mask.squeeze(-1)
        denom = m.sum().clamp_min(1e-8)
        acc = (a * m).sum() / denom
        log_acc = (torch.where(a > 0, torch.log(a), 0) * m).sum() / denom
        if lk_loss_type is None:
            loss = kl
        elif lk_loss_type == "alpha":
            loss = -log_acc
        else:
            w = kl_scale * torch.exp(-kl_decay * acc.detach())
            loss = w * kl + (1 - w) * (1 - acc)
        total = total + decay ** idx * loss
        position_mask = _pad_left_shift(position_mask)
    return total


# ---------------------------------------------------------------------- the comparison
def _ours(case, spec):
    def f(p):
        draft = nnx.merge(case["graphdef"], p, case["rest"])
        signal = ttt.target_signal(jnp.asarray(case["logits"]), jnp.asarray(case["loss_mask"]), draft.d2t[...],
                                   draft.t2d[...], spec.convention)
        return ttt.ttt_loss(draft, case["aux"], case["ids"], signal, case["embed"], spec)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(case["params"])
    return float(loss), np.asarray(grads["fc"]), metrics


@pytest.fixture(scope="module")
def unrolled(case):
    """Our per-step draft logits and their pullback to the parameters (shared by every reference)."""
    def unroll(p):
        draft = nnx.merge(case["graphdef"], p, case["rest"])
        return ttt.ttt_unroll(draft, case["aux"], case["ids"], case["embed"], STEPS)

    return jax.vjp(unroll, case["params"])


def _reference(case, unrolled, **lk):
    step_logits, pullback = unrolled
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in step_logits]
    loss = specforge_loss(leaves, case["logits"], case["loss_mask"], case["t2d"], **lk)
    loss.backward()
    (grads,) = pullback([jnp.asarray(x.grad.numpy(), jnp.float32) for x in leaves])
    return float(loss.detach()), np.asarray(grads["fc"])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("lk", [{}, {"lk_loss_type": "alpha"},
                                {"lk_loss_type": "lambda", "kl_scale": 1.5, "kl_decay": 2.0}],
                         ids=["kl", "lk_alpha", "lk_lambda"])
def test_specforge_convention_equals_its_trainer(case, unrolled, lk):
    loss, grad_fc, m = _ours(case, ttt.LossSpec(steps=STEPS, convention="specforge", **lk))
    ref_loss, ref_grad = _reference(case, unrolled, **lk)
    # the case bites: padded and gap positions dropped, SpecForge's zero row past the end counted
    assert 0 < int(m["count"][-1]) <= int(m["count"][0]) < B * T
    sig = ttt.target_signal(jnp.asarray(case["logits"]), jnp.asarray(case["loss_mask"]),
                            case["rest"]["d2t"].value, jnp.asarray(case["t2d"]), "specforge")
    assert bool(sig.usable_BT[0, T]) and not bool(sig.usable_BT[1, T])
    np.testing.assert_allclose(sig.probs_BTW[0, T], 1 / W, rtol=1e-6)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    assert _rel(grad_fc, ref_grad) <= 1e-3


def test_our_convention_differs_where_it_should(case, unrolled):
    """Ours counts loss_mask[t+i+2] and divides by the counted positions: a different loss and
    gradient on this batch (the reference is not trivially satisfied by either)."""
    loss, grad_fc, m = _ours(case, ttt.LossSpec(steps=STEPS))
    ref_loss, ref_grad = _reference(case, unrolled)
    assert abs(loss - ref_loss) > 0.05 * abs(ref_loss)
    assert _rel(grad_fc, ref_grad) > 0.05
    # ours: the step loss is the mean over usable positions, whose count is the shifted mask's
    lm = case["loss_mask"]
    counts = np.asarray(m["count"])
    assert counts[0] <= lm[:, 2:].sum() and counts[-1] < counts[0]


def test_simulated_acc_len():
    np.testing.assert_allclose(ttt.simulated_acc_len([0.8, 0.5, 0.5]), 0.8 + 0.4 + 0.2)
    assert ttt.simulated_acc_len([0.0, 1.0]) == 0.0
