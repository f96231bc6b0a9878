"""The ``specforge`` loss convention against SpecForge's own trainer step (its modules, loaded by
tests/specforge_modules.py): its offline EAGLE-3 path as its trainer runs it, on CPU in float32 —
``normalize_offline_sample`` on each stored row, ``DataCollatorWithPadding`` over the rows,
``Eagle3TrainStrategy.forward_loss`` (its target head on the stored final states, the TTT unroll
of its ``LlamaForCausalLMEagle3``, the reference loss) and the backward pass — against our
``step.batch_loss`` (what the train step differentiates) on the same rows as our pipeline pads
them, to ``max_len``, past the longest row, the draft holding SpecForge's draft's weights.

The rows have unequal lengths, loss masks with gaps, and a loss token at each row's end; padded
positions carry nonzero states (an online target computes states for the padding too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.drafts.eagle3.names import draft_rules
from eagle3_jax.train import step, ttt
from eagle3_jax.train.data import Example
from eagle3_jax.train.pipeline import TokenizedSource
from tests import specforge_modules as sf

D, V, W, STEPS = 64, 256, 64, 7
LENGTHS = (20, 14, 9)
T = 24                        # our rows: padded to max_len, past SpecForge's longest row (20)
HF = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D, "intermediate_size": 128,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V, "draft_vocab_size": W,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "num_hidden_layers": 1,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from transformers import LlamaConfig

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    theirs = sf.LlamaForCausalLMEagle3(LlamaConfig(**HF), attention_backend="sdpa").float()
    target_ids = np.sort(np.concatenate([[0], rng.choice(np.arange(1, V), W - 1, replace=False)]))
    embed_VD = (rng.normal(size=(V, D)) * 0.3).astype(np.float32)
    lm_head_DV = (rng.normal(size=(D, V)) * 0.5).astype(np.float32)
    t2d = np.zeros(V, bool)
    t2d[target_ids] = True
    with torch.no_grad():
        for name, p in theirs.named_parameters():   # norms start at ones: perturbed, so a swap would show
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        theirs.embed_tokens.weight.copy_(torch.as_tensor(embed_VD))
        theirs.d2t.copy_(torch.as_tensor(target_ids - np.arange(W)))
        theirs.t2d.copy_(torch.as_tensor(t2d))
    theirs.embed_tokens.weight.requires_grad_(False)   # the target's embedding, frozen

    stored = []   # rows as SpecForge's offline capture stores them
    for n in LENGTHS:
        mask = np.zeros(n, np.int64)
        mask[3:] = 1
        mask[rng.choice(np.arange(4, n - 2), 2, replace=False)] = 0   # gaps; the last token is a loss token
        stored.append({"input_ids": torch.as_tensor(rng.integers(1, V, n)), "loss_mask": torch.as_tensor(mask),
                       "aux_hidden_state": torch.as_tensor(rng.normal(size=(1, n, 3 * D)).astype(np.float32)),
                       "hidden_state": torch.as_tensor(rng.normal(size=(1, n, D)).astype(np.float32))})

    # ours: the pipeline's padded rows (with their lengths), the states continued past each row's end
    source = TokenizedSource([Example(r["input_ids"].numpy().astype(np.int32), r["loss_mask"].numpy().astype(bool))
                              for r in stored], T)
    mb = {k: np.stack([source[i][k] for i in range(len(stored))]) for k in ("ids", "loss_mask", "length")}
    assert list(mb["length"]) == list(LENGTHS)
    aux = rng.normal(size=(len(stored), T, 3 * D)).astype(np.float32)
    hidden = rng.normal(size=(len(stored), T, D)).astype(np.float32)
    for b, r in enumerate(stored):
        aux[b, :LENGTHS[b]], hidden[b, :LENGTHS[b]] = r["aux_hidden_state"][0], r["hidden_state"][0]

    dcfg = DraftConfig.from_hf_dict(HF)
    graphdef, state = nnx.split(Draft(dcfg, 3, jnp.float32, nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(state))
    sd = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    rules = draft_rules(dcfg, 3, own_embedding=False)
    for rule in rules:
        flat[rule.path][...] = jnp.asarray(rule.to_ours([sd[k] for k in rule.hf_keys]))
    graphdef, params, rest = nnx.split(nnx.merge(graphdef, nnx.from_flat_state(flat)), nnx.Param, ...)
    return dict(theirs=theirs, stored=stored, head=sf.target_head(tmp_path_factory.mktemp("head"), lm_head_DV),
                rules=[r for r in rules if r.path[0] not in ("d2t", "t2d")], graphdef=graphdef, params=params,
                rest=rest, embed=jnp.asarray(embed_VD), lm_head=jnp.asarray(lm_head_DV),
                mb={k: jnp.asarray(v) for k, v in mb.items()}, aux=jnp.asarray(aux), hidden=jnp.asarray(hidden))


# ---------------------------------------------------------------------- the two sides
def _specforge_step(case, rows, lk: dict):
    """SpecForge's loss, per-step metrics and gradients (by tensor name) on one device's rows."""
    theirs = case["theirs"]
    theirs.zero_grad(set_to_none=True)
    batch = sf.DataCollatorWithPadding()([sf.normalize_offline_sample(dict(r), max_len=T) for r in rows])
    model = sf.OnlineEagle3Model(theirs, length=STEPS, attention_backend="sdpa", **lk)
    strategy = sf.Eagle3TrainStrategy(model, target_head=case["head"], ploss_decay=0.8)
    out = strategy.forward_loss(sf.TrainBatch([str(i) for i in range(len(rows))], "eagle3", batch,
                                              {"target_repr": "hidden_state"}))
    out.loss.backward()
    grads = {n: p.grad.detach().clone().numpy() for n, p in theirs.named_parameters() if p.grad is not None}
    metrics = {k: np.asarray([float(x) for x in out.metrics[k]]) for k in ("plosses", "acces", "acceptance_rates")}
    return float(out.loss.detach()), metrics, grads


def _specforge_devices(case, groups, lk: dict):
    """SpecForge data-parallel: one collated batch a device, the devices' losses and gradients averaged."""
    runs = [_specforge_step(case, [case["stored"][i] for i in g], lk) for g in groups]
    grads = {k: np.mean([r[2][k] for r in runs], axis=0) for k in runs[0][2]}
    return float(np.mean([r[0] for r in runs])), grads


def _ours(case, spec: ttt.LossSpec, length=True):
    mb = dict(case["mb"]) if length else {**case["mb"], "length": jnp.full((len(LENGTHS),), T, jnp.int32)}
    f = jax.jit(jax.value_and_grad(step.batch_loss, has_aux=True), static_argnames=("graphdef", "spec"))
    (loss, metrics), grads = f(case["params"], case["rest"], case["embed"], case["lm_head"], case["aux"],
                               case["hidden"], mb, graphdef=case["graphdef"], spec=spec)
    flat = dict(nnx.to_flat_state(grads))
    named = {}
    for rule in case["rules"]:
        (named[rule.hf_keys[0]],) = rule.to_hf(np.asarray(flat[rule.path][...]))
    return float(loss), jax.tree.map(np.asarray, metrics), named


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _assert_same_step(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 13   # every trainable tensor of the draft
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 1e-5, (name, _rel(g, ref_grads[name]))


# ---------------------------------------------------------------------- the tests
LK_CASES = {"kl": ({}, {}),
            "lk_alpha": ({"lk_loss_type": "alpha"}, {}),
            # the trainer's long-row settings: blockwise attention, chunked head and loss, remat
            "lk_lambda_chunked": ({"lk_loss_type": "lambda", "kl_scale": 1.5, "kl_decay": 2.0},
                                  {"attention": "blockwise", "attention_block": 8, "loss_chunk": 5, "remat": True})}


@pytest.mark.parametrize("name", LK_CASES)
def test_specforge_convention_is_its_trainer_step(case, name):
    """One device's batch of the three rows (collated to the longest, 20): loss, per-step losses,
    accuracies and acceptance rates, and every gradient."""
    lk, settings = LK_CASES[name]
    ref_loss, ref_m, ref_grads = _specforge_step(case, case["stored"], lk)
    spec = ttt.LossSpec(steps=STEPS, convention="specforge", specforge_batch=len(LENGTHS), **lk, **settings)
    loss, m, grads = _ours(case, spec)
    _assert_same_step(loss, grads, ref_loss, ref_grads)
    # per-step losses to 1e-5 of the largest: a late step's loss is ~20x smaller than the first's,
    # and the chunked sum's order moves its last float32 bits
    np.testing.assert_allclose(m["loss"], ref_m["plosses"], rtol=1e-5, atol=1e-5 * np.abs(ref_m["plosses"]).max())
    np.testing.assert_allclose(m["acc_all"], ref_m["acces"], rtol=1e-6)
    np.testing.assert_allclose(m["accept"], ref_m["acceptance_rates"], rtol=1e-5)


def test_specforge_batch_one_row_a_device(case):
    """SpecForge's default, one row a device (each divided by its own length), devices averaged."""
    ref_loss, ref_grads = _specforge_devices(case, [[0], [1], [2]], {})
    loss, _, grads = _ours(case, ttt.LossSpec(steps=STEPS, convention="specforge", specforge_batch=1))
    _assert_same_step(loss, grads, ref_loss, ref_grads)


def test_the_case_bites(case):
    """What the convention reproduces matters here, far beyond the tolerance: without the rows'
    lengths (every row taken as max_len long: the rows' last loss tokens counted against the
    padding's logits, the sum divided by 3 x 24 instead of 3 x 20) the gradient is off by 40 %
    (the loss by 0.3 %: the two errors nearly cancel in it), and our own convention is another
    loss altogether."""
    ref_loss, _, ref_grads = _specforge_step(case, case["stored"], {})
    spec = ttt.LossSpec(steps=STEPS, convention="specforge", specforge_batch=len(LENGTHS))
    for s, kw in ((spec, {"length": False}), (ttt.LossSpec(steps=STEPS), {})):
        loss, _, grads = _ours(case, s, **kw)
        assert abs(loss - ref_loss) > 1e-3 * ref_loss and _rel(grads["fc.weight"], ref_grads["fc.weight"]) > 0.05


def test_offline_states_without_lengths_are_refused_for_specforge(tmp_path):
    """Stores prepared before row lengths were kept: refused where the convention divides by them."""
    import shutil

    import eagle3_jax as e3
    from eagle3_jax.errors import ConfigError
    from eagle3_jax.train import TrainConfig, offline
    from tests.hf_fixtures import REPO

    (tmp_path / "target").mkdir()
    shutil.copy(REPO / "configs/models/tiny_deepseek_v3.json", tmp_path / "target" / "config.json")
    tcfg = e3.TargetConfig.from_path(tmp_path / "target")
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n')
    base = dict(target=str(tmp_path / "target"), data=str(tmp_path / "rows.jsonl"), out_dir=str(tmp_path / "o"),
                aux_layer_ids=(0, 1, 2))
    cfg = TrainConfig(**base, loss_convention="specforge")
    plan = cfg.resolve()
    meta = offline.offline_meta_for(plan, offline.file_digest(cfg.data))
    with pytest.raises(ConfigError, match="prepared without the rows' lengths.*rerun mode=prepare"):
        offline.check_offline_meta(meta, plan, str(tmp_path))
    offline.check_offline_meta(meta, TrainConfig(**base).resolve(), str(tmp_path))


def test_simulated_acc_len():
    np.testing.assert_allclose(ttt.simulated_acc_len([0.8, 0.5, 0.5]), 0.8 + 0.4 + 0.2)
    assert ttt.simulated_acc_len([0.0, 1.0]) == 0.0
