"""The P-EAGLE draft against an independent torch implementation of SpecForge's ``PEagleDraftModel``
(written here from its description: EAGLE-3 first layer, plain Llama layers after, ``mask_hidden``
substituted before ``fc`` at guessed positions, the rollout attention rule), its checkpoint layout
(the exact key set and shapes), and the KV-cache realisation of the rollout mask used in serving."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

from eagle3_jax.drafts.loaded import host_params
from eagle3_jax.drafts.peagle.checkpoint import write_peagle
from eagle3_jax.drafts.peagle.config import PEagleConfig
from eagle3_jax.errors import CheckpointError, ConfigError
from eagle3_jax.drafts.peagle.model import PEagleDraft, rollout_mask
from tests.peagle_fixtures import read_peagle_config, read_peagle_state

D, LAYERS, N, G, H, V, W, TH, F = 32, 3, 4, 2, 8, 100, 40, 24, 64
MASK_ID = 7


def tiny_config(**extra) -> PEagleConfig:
    d = {"architectures": ["PEagleDraftModel"], "model_type": "llama", "hidden_size": D, "intermediate_size": F,
         "num_attention_heads": N, "num_key_value_heads": G, "head_dim": H, "num_hidden_layers": LAYERS,
         "vocab_size": V, "draft_vocab_size": W, "target_hidden_size": TH, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "max_position_embeddings": 64, "mask_token_id": MASK_ID,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    d.update(extra)
    return PEagleConfig.from_hf_dict(d)


def random_draft(cfg, seed=0) -> PEagleDraft:
    """Random weights everywhere, norms and vocab maps included (ones would hide a swapped norm)."""
    model = PEagleDraft(cfg, 3, jnp.float32, nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if path[-1] == "weight":
            var[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(var[...].shape), jnp.float32)
    state["d2t"][...] = jnp.asarray(rng.integers(0, V - W, W), jnp.int32)
    state["t2d"][...] = jnp.asarray(rng.random(V) < 0.5)
    return nnx.merge(graphdef, state)


# A rollout layout as SpecForge's sampler makes one: depth 0 at every position, then for some
# anchors positions anchor + d carrying the MASK token, grouped by depth.
ANCHOR = np.array(list(range(10)) + [0, 2, 5, 7] + [2, 5] + [5])
DEPTH = np.array([0] * 10 + [1] * 4 + [2] * 2 + [3])


# ---------------------------------------------------------------- independent torch reference
# the same RMSNorm and rotate-half RoPE as the chain draft's torch oracle
from tests.test_draft_oracle import _rms, _rope  # noqa: E402


def reference_logits(sd, cfg, ids, aux, anchor, depth):
    """Logits [1, T, W] of one packed rollout sequence (batch 1, as SpecForge trains)."""
    T = len(anchor)
    anchor, depth = torch.as_tensor(anchor), torch.as_tensor(depth)
    known = depth == 0
    pos = anchor + depth
    tok = torch.where(known, torch.as_tensor(ids)[pos], torch.tensor(cfg["mask_token_id"]))
    a = torch.where(known[:, None], torch.as_tensor(aux)[pos], sd["mask_hidden"].reshape(1, -1))
    emb, hid = sd["embed_tokens.weight"][tok][None], (a @ sd["fc.weight"].T)[None]
    seen = ((depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])) | (
        (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None]))
    h = None
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        if i == 0:
            residual = hid
            x = torch.cat([_rms(emb, sd[p + "input_layernorm.weight"]), _rms(hid, sd[p + "hidden_norm.weight"])], -1)
        else:
            residual, x = h, _rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(1, T, N, H)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(1, T, G, H)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(1, T, G, H)
        q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
        k, v = k.repeat_interleave(N // G, dim=2), v.repeat_interleave(N // G, dim=2)
        att = torch.einsum("bqnh,bknh->bnqk", q, k) / H ** 0.5
        att = att.masked_fill(~seen, float("-inf")).softmax(-1)
        h = residual + torch.einsum("bnqk,bknh->bqnh", att, v).reshape(1, T, N * H) @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(h, sd[p + "post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
                 ) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def specforge_keys(cfg) -> dict:
    """name -> shape of ``PEagleDraftModel.state_dict()`` for this config (from its description)."""
    X = 3 * cfg["target_hidden_size"]
    keys = {"embed_tokens.weight": (V, D), "fc.weight": (D, X), "mask_hidden": (1, 1, X), "norm.weight": (D,),
            "lm_head.weight": (W, D), "d2t": (W,), "t2d": (V,)}
    for i in range(cfg["num_hidden_layers"]):
        p, width = f"layers.{i}.", 2 * D if i == 0 else D
        keys.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_proj.weight": (N * H, width), p + "self_attn.k_proj.weight": (G * H, width),
                     p + "self_attn.v_proj.weight": (G * H, width), p + "self_attn.o_proj.weight": (D, N * H),
                     p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                     p + "mlp.down_proj.weight": (D, F)})
        if i == 0:
            keys[p + "hidden_norm.weight"] = (D,)
    return keys


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = tiny_config()
    model = random_draft(cfg)
    path = tmp_path_factory.mktemp("peagle") / "draft"
    write_peagle(path, cfg, host_params(model), aux_layer_ids=(0, 1, 2))
    return model, path


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(3)
    return rng.integers(0, V, 16), rng.standard_normal((16, 3 * TH)).astype(np.float32)


def _ours(model, ids, aux, anchor=ANCHOR, depth=DEPTH):
    pos = anchor + depth
    step = model.forward_rollouts(jnp.asarray(ids[pos])[None], jnp.asarray(aux[pos])[None], jnp.asarray(depth)[None],
                                  jnp.asarray(pos)[None], rollout_mask(jnp.asarray(anchor)[None], jnp.asarray(depth)[None]))
    return np.asarray(step.logits_BTW[0])


# ---------------------------------------------------------------- tests
def test_export_has_exactly_specforges_keys_and_shapes(exported):
    _, path = exported
    sd = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    assert {k: tuple(v.shape) for k, v in sd.items()} == specforge_keys(cfg)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert cfg["architectures"] == ["PEagleDraftModel"] and cfg["num_hidden_layers"] == LAYERS
    assert cfg["mask_token_id"] == MASK_ID


def test_rollouts_match_torch_reference(exported, inputs):
    model, path = exported
    ids, aux = inputs
    sd = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    with torch.no_grad():
        ref = reference_logits(sd, cfg, ids, torch.as_tensor(aux), ANCHOR, DEPTH)[0].numpy()
    ours = _ours(model, ids, aux)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
    # the mask positions really use mask_hidden and the rollout rule: a plain causal pass differs
    causal = _ours(model, ids, aux, ANCHOR, np.zeros_like(DEPTH))
    assert np.abs(causal[10:] - ref[10:]).max() > 1e-2


def test_load_round_trip_is_exact(exported):
    model, path = exported
    cfg = read_peagle_config(path)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: PEagleDraft(cfg, 3, jnp.float32, None)))
    state = read_peagle_state(path, cfg, abstract, 3)
    back = host_params(nnx.merge(graphdef, state))
    for k, v in host_params(model).items():
        np.testing.assert_array_equal(back[k], v, err_msg=str(k))


def test_loader_names_missing_and_unexpected_tensors(exported, tmp_path):
    from safetensors.numpy import load_file as np_load, save_file

    _, path = exported
    tensors = np_load(str(path / "model.safetensors"))
    tensors.pop("layers.2.mlp.up_proj.weight")
    tensors["layers.3.norm.weight"] = np.ones(D, np.float32)
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    cfg = read_peagle_config(tmp_path / "bad")
    _, abstract = nnx.split(nnx.eval_shape(lambda: PEagleDraft(cfg, 3, jnp.float32, None)))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.up_proj\.weight.*layers\.3\.norm\.weight"):
        read_peagle_state(tmp_path / "bad", cfg, abstract, 3)


def test_config_rules():
    with pytest.raises(ConfigError, match="not a P-EAGLE draft"):
        tiny_config(architectures=["LlamaForCausalLMEagle3"])
    with pytest.raises(ConfigError, match="pass the id the draft was trained with"):
        tiny_config(mask_token_id=None).require_mask_token()
    with pytest.raises(ConfigError, match="outside the draft embedding"):
        tiny_config(mask_token_id=V)
    # SpecForge's P-EAGLE builds its rotary table from rope_theta alone: scaling is not applied
    cfg = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0


@pytest.mark.parametrize("anchor,k", [(9, 4), (6, 3), (6, 5)])
def test_cache_serving_equals_rollout_mask(exported, inputs, anchor, k):
    """Serving: known positions 0..9 go through the cache (prefill / catch-up), then one pass at
    anchor + 1 .. anchor + k - 1 with the MASK inputs. Its logits, and the anchor's own, equal the
    explicit-mask forward of that rollout, also when the cache holds stale known positions past
    the anchor (anchor 6: slots 7..9 were written but are no longer valid)."""
    model, _ = exported
    ids, aux = inputs
    pos = np.arange(10)
    cache = model.init_cache(1, 32)
    pre = model(jnp.asarray(ids[1:11])[None], model.fuse(jnp.asarray(aux[:10])[None]), jnp.asarray(pos)[None],
                cache=cache)
    step = model.propose(jnp.asarray(anchor + np.arange(1, k))[None], pre.cache)
    rollout_anchor = np.concatenate([np.arange(anchor + 1), np.full(k - 1, anchor)])
    rollout_depth = np.concatenate([np.zeros(anchor + 1, int), np.arange(1, k)])
    # forward_rollouts reads ids at anchor + depth; the serving pairing is (aux at p, token at p + 1)
    ref = _ours(model, np.concatenate([ids[1:], [0]]), aux, rollout_anchor, rollout_depth)
    np.testing.assert_allclose(np.asarray(pre.logits_BTW[0, anchor]), ref[anchor], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(step.logits_BTW[0]), ref[anchor + 1:], rtol=1e-5, atol=1e-5)
