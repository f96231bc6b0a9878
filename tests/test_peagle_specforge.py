"""SpecForge's own P-EAGLE modules as the oracle (installed by `make setup`, loaded by
tests/specforge_modules.py). Its ``PEagleDraftModel``, both ways: it loads our export strictly and
computes our logits; we load its checkpoint and compute its logits, its attention its own (flex
attention under its ``create_peagle_mask_mod`` rollout rule). Its trainer step: the
``specforge`` convention of our P-EAGLE step equals ``PEagleTrainStrategy.forward_loss`` (one
row a device, its target head on the stored final states, its COD sampling) averaged over the
rows, loss and gradients."""

import contextlib
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from eagle3_jax.drafts.loaded import host_params
from eagle3_jax.drafts.peagle.checkpoint import peagle_rules, write_peagle
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.drafts.peagle.objective import pad_rollouts, peagle_loss
from eagle3_jax.train.peagle_trainer import shifted_rows
from tests import specforge_modules as sf
from tests.peagle_fixtures import read_peagle_config, read_peagle_state
from tests.test_peagle import ANCHOR, DEPTH, MASK_ID, TH, V, W, _ours, random_draft, tiny_config


@contextlib.contextmanager
def _patched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _specforge_model(config_dir):
    from transformers import LlamaConfig

    return sf.PEagleDraftModel(LlamaConfig.from_pretrained(str(config_dir))).float().eval()


def _specforge_logits(model, ids, aux, anchor=ANCHOR, depth=DEPTH):
    """The steps of SpecForge's P-EAGLE training forward up to the logits, on its module's methods."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    anchor, depth = torch.as_tensor(anchor), torch.as_tensor(depth)
    pos = anchor + depth
    known = depth == 0
    tok = torch.where(known, torch.as_tensor(ids)[pos], torch.tensor(MASK_ID))
    hid = torch.where(known[:, None], torch.as_tensor(aux)[pos], model.mask_hidden.reshape(1, -1))
    mask_mod = sf.peagle_model.create_peagle_mask_mod(anchor, depth, torch.tensor([len(ids)]), len(ids))
    block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=len(pos), KV_LEN=len(pos), device="cpu")
    # torch's own flex attention, run eagerly: SpecForge wraps it in torch.compile, whose inductor
    # build (a C++ toolchain, minutes, a cache under /tmp) is no part of what is compared here.
    with torch.no_grad(), _patched(sf.peagle_draft, "compile_friendly_flex_attention", flex_attention):
        h = model.backbone(model.embed_input_ids(tok[None]), model.project_hidden_states(hid[None]),
                           attention_mask=block, position_ids=pos[None])
        return model.compute_logits(h)[0].numpy()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(5)
    return rng.integers(0, 100, 16), rng.standard_normal((16, 72)).astype(np.float32)


def test_specforge_loads_our_export_strictly_and_agrees(tmp_path, inputs):
    cfg = tiny_config()
    ours = random_draft(cfg, seed=1)
    write_peagle(tmp_path / "d", cfg, host_params(ours), aux_layer_ids=(0, 1, 2))
    theirs = _specforge_model(tmp_path / "d")
    theirs.load_state_dict(load_file(str(tmp_path / "d" / "model.safetensors")), strict=True)
    ids, aux = inputs
    ref = _specforge_logits(theirs, ids, aux)
    assert np.abs(_ours(ours, ids, aux) - ref).max() / np.abs(ref).max() < 1e-4


def test_we_load_specforges_checkpoint_and_agree(tmp_path, inputs):
    cfg = tiny_config()
    config_dir = tmp_path / "sf"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    torch.manual_seed(0)
    theirs = _specforge_model(config_dir)
    # their norms start at ones and d2t at zeros: perturb them so a swap would show
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        theirs.d2t.copy_(torch.randint(0, 60, theirs.d2t.shape))
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(config_dir / "model.safetensors"))
    theirs.config.save_pretrained(str(config_dir))   # the config SpecForge itself writes (no mask id)

    loaded_cfg = read_peagle_config(config_dir, mask_token_id=MASK_ID)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: PEagleDraft(loaded_cfg, 3, jnp.float32, None)))
    ours = nnx.merge(graphdef, read_peagle_state(config_dir, loaded_cfg, abstract, 3))
    np.testing.assert_array_equal(np.asarray(ours.d2t[...]), theirs.d2t.numpy())
    ids, aux = inputs
    ref = _specforge_logits(theirs, ids, aux)
    assert np.abs(_ours(ours, ids, aux) - ref).max() / np.abs(ref).max() < 1e-4


# ---------------------------------------------------------------------- the trainer step
STEP_LENGTHS, STEP_T, DEPTHS = (15, 11, 8), 18, 4   # our rows padded to 18, past the longest


def test_specforge_convention_is_its_trainer_step(tmp_path, monkeypatch):
    """Rows of unequal length, loss masks with gaps and a loss token at each row's end (its label
    the zero row SpecForge's shift appends), one row a device as SpecForge's P-EAGLE trains: our
    step's rows (``shifted_rows``) and ``peagle_loss`` on the padded batch, with the rollouts
    SpecForge sampled, give the devices' mean loss and gradients."""
    import jax
    from transformers import LlamaConfig

    cfg = tiny_config()
    config_dir = tmp_path / "sf"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    theirs = sf.PEagleDraftModel(LlamaConfig.from_pretrained(str(config_dir))).float()
    target_ids = np.sort(np.concatenate([[0], rng.choice(np.arange(1, V), W - 1, replace=False)]))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight") or name == "mask_hidden":
                p.add_(0.3 * torch.randn_like(p))
        theirs.d2t.copy_(torch.as_tensor(target_ids - np.arange(W)))
        theirs.t2d.copy_(torch.as_tensor(np.isin(np.arange(V), target_ids)))
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(config_dir / "model.safetensors"))
    lm_head = (rng.normal(size=(TH, V)) * 0.7).astype(np.float32)
    head = sf.target_head(tmp_path, lm_head)

    rows = []
    for n in STEP_LENGTHS:
        mask = np.zeros(n, np.int64)
        mask[2:] = 1
        mask[rng.choice(np.arange(3, n - 2), 2, replace=False)] = 0
        rows.append({"input_ids": torch.as_tensor(rng.integers(1, V, (1, n))), "attention_mask": torch.ones(1, n),
                     "loss_mask": torch.as_tensor(mask[None]),
                     "hidden_state": torch.as_tensor(rng.normal(size=(1, n, 3 * TH)).astype(np.float32)),
                     "target": torch.as_tensor(rng.normal(size=(1, n, TH)).astype(np.float32))})

    # SpecForge: one row a device; its COD draws recorded for our side
    sampler, draws = sf.peagle_model.generate_cod_sample_indices, []

    def recording(*args, **kwargs):
        anchor, depth = sampler(*args, **kwargs)
        draws.append((anchor.numpy().copy(), depth.numpy().copy()))
        return anchor, depth

    monkeypatch.setattr(sf.peagle_model, "generate_cod_sample_indices", recording)
    monkeypatch.setattr(sf.peagle_draft, "compile_friendly_flex_attention", sf.dense_flex_attention)
    strategy = sf.PEagleTrainStrategy(
        sf.peagle_model.OnlinePEagleModel(theirs, mask_token_id=MASK_ID, num_depths=DEPTHS), target_head=head)
    losses, grads = [], []
    for i, row in enumerate(rows):
        theirs.zero_grad(set_to_none=True)
        out = strategy.forward_loss(sf.TrainBatch([str(i)], "peagle", sf.concatenate_features([row]),
                                                  {"target_repr": "hidden_state"}))
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append({n: p.grad.numpy().copy() for n, p in theirs.named_parameters() if p.grad is not None})
    ref_loss = np.mean(losses)
    ref_grads = {k: np.mean([g[k] for g in grads], axis=0) for k in grads[0]}
    assert all((d[1] > 0).any() for d in draws)   # rollouts were sampled past depth 0

    # ours: the pipeline's padded rows, states continued past each row's end
    loaded_cfg = read_peagle_config(config_dir, mask_token_id=MASK_ID)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: PEagleDraft(loaded_cfg, 3, jnp.float32, None)))
    graphdef, params, rest = nnx.split(nnx.merge(graphdef, read_peagle_state(config_dir, loaded_cfg, abstract, 3)),
                                       nnx.Param, ...)
    B, T, P = len(rows), STEP_T, max(len(a) for a, _ in draws)
    mb = {"ids": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), bool),
          "length": np.asarray(STEP_LENGTHS, np.int32), "anchor": np.zeros((B, P), np.int32),
          "depth": np.zeros((B, P), np.int32), "valid": np.zeros((B, P), bool)}
    aux = rng.normal(size=(B, T, 3 * TH)).astype(np.float32)
    hidden = rng.normal(size=(B, T, TH)).astype(np.float32)
    for b, (row, n) in enumerate(zip(rows, STEP_LENGTHS)):
        mb["ids"][b, :n], mb["loss_mask"][b, :n] = row["input_ids"][0], row["loss_mask"][0].numpy() > 0
        aux[b, :n], hidden[b, :n] = row["hidden_state"][0], row["target"][0]
        mb["anchor"][b], mb["depth"][b], mb["valid"][b] = pad_rollouts(*draws[b], P)

    def loss_fn(p, convention, length_B):
        rows_ = shifted_rows({**jax.tree.map(jnp.asarray, mb), "length": length_B}, jnp.asarray(aux),
                             jnp.asarray(hidden), jnp.asarray(lm_head), convention)
        return peagle_loss(nnx.merge(graphdef, p, rest), *rows_, num_depths=DEPTHS,
                           row_means=convention == "specforge")[0]

    loss, g = jax.value_and_grad(loss_fn)(params, "specforge", jnp.asarray(mb["length"]))
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss, (float(loss), ref_loss)
    flat = dict(nnx.to_flat_state(g))
    rules = [r for r in peagle_rules(loaded_cfg, 3) if r.path in flat]
    assert {r.hf_keys[0] for r in rules} == set(ref_grads)   # every trainable tensor, embedding and mask_hidden too
    for rule in rules:
        (ours,) = rule.to_hf(np.asarray(flat[rule.path][...]))
        ref = ref_grads[rule.hf_keys[0]].reshape(ours.shape)
        assert np.linalg.norm(ours - ref) <= 1e-5 * np.linalg.norm(ref), rule.hf_keys[0]
    # the case bites: without the rows' lengths (the padding's logits label each row's last
    # position) or under our convention, other gradients
    fc = next(r for r in rules if r.hf_keys[0] == "fc.weight")
    for convention, length_B in (("specforge", jnp.full((B,), T, jnp.int32)), ("ours", jnp.asarray(mb["length"]))):
        (other,) = fc.to_hf(np.asarray(jax.grad(loss_fn)(params, convention, length_B)["fc"][...]))
        assert np.linalg.norm(other - ref_grads["fc.weight"]) > 0.05 * np.linalg.norm(ref_grads["fc.weight"])
