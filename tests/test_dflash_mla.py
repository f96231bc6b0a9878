"""DFlash with MLA attention (``dflash_config.attention_mode: mla``, SpecForge commit 62e64faf, after
the installed 0.2.0) against an oracle written here: SpecForge 0.2.0's ``DFlashDraftModel`` (its
context injection, decoder layers, masks and training forward) with each layer's attention
replaced by :class:`TorchMLA`, a plain PyTorch reading of that commit's ``Qwen3DFlashMLAAttention``
that expands keys and values per head (ours attends in the absorbed latent form). The oracle
writes a SpecForge-layout checkpoint that we load through ``e3.load_draft``; blocks' outputs and
logits agree in float32 for full and sliding layers; the training step's loss and gradients equal
the oracle's autograd; the decode loop stays lossless; conversion round-trips byte for byte."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file

import eagle3_jax as e3
from eagle3_jax.drafts.dflash.checkpoint import build as build_dflash_draft
from eagle3_jax.drafts.dflash.checkpoint import dflash_rules
from eagle3_jax.drafts.dflash.config import DFlashConfig
from eagle3_jax.drafts.loaded import rule_tensors
from eagle3_jax.errors import ConfigError
from tests import spec_fixtures
from tests.test_dflash import ANCHORS, BLOCK, MASK_ID, S, WINDOW, _specforge_blocks
from tests.test_train import predictable_target, predictable_target_dir  # noqa: F401  (a peaked tiny target)
from tests.test_train_peagle import corpus, rows_file  # noqa: F401  (its target-written rows)

torch = pytest.importorskip("torch")
dflash = pytest.importorskip("specforge.modeling.draft.dflash")
nn = torch.nn

MLA = dict(num_attention_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=12)
FULL, SLIDING = "full_attention", "sliding_attention"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x, positions, theta, interleaved):
    """x [B, heads, T, P] rotated at positions [B, T]: pairs (2i, 2i + 1) in place, or halves."""
    P = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, P, 2, dtype=torch.float64) / P)
    ang = (positions.double()[..., None] * inv)[:, None].float()   # [B, 1, T, P/2]
    cos, sin = ang.cos(), ang.sin()
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
    a, b = x[..., :P // 2], x[..., P // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


class TorchMLA(nn.Module):
    """The MLA draft attention as the SpecForge commit describes it, keys and values expanded per head."""

    def __init__(self, config):
        super().__init__()
        c, extra = config, config.dflash_config
        D, N, bias = c.hidden_size, c.num_attention_heads, c.attention_bias
        self.N, self.C, self.P, self.Z, self.Y = N, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        rope_params = getattr(c, "rope_parameters", None) or {}   # transformers 5 keeps the theta there
        self.theta = rope_params.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        self.interleaved = extra.get("mla_rope_interleaved", True)
        H = self.Z + self.P
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * H, bias=bias)
        else:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, N * H, bias=bias)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.C + self.P, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.C, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.C, N * (self.Z + self.Y), bias=bias)
        if extra.get("mla_use_output_gate", False):
            self.g_proj = nn.Linear(D, N * self.Y, bias=False)
        self.o_proj = nn.Linear(N * self.Y, D, bias=bias)

    def kv(self, x):
        B, T, _ = x.shape
        lat, k_rope = self.kv_a_proj_with_mqa(x).split([self.C, self.P], -1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(lat)).view(B, T, self.N, -1).split([self.Z, self.Y], -1)
        return k_nope, k_rope, v

    def forward(self, hidden_states, target_hidden, attention_mask, position_ids, **_):
        x, B, T = hidden_states, *hidden_states.shape[:2]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, self.N, -1).transpose(1, 2).split([self.Z, self.P], -1)
        parts = [self.kv(target_hidden), self.kv(x)]
        k_nope, k_rope, v = (torch.cat(p, 1) for p in zip(*parts))
        q_rope = rope(q_rope, position_ids[:, -T:], self.theta, self.interleaved)
        k_rope = rope(k_rope[:, None], position_ids, self.theta, self.interleaved).expand(-1, self.N, -1, -1)
        q = torch.cat((q_nope, q_rope), -1)
        k = torch.cat((k_nope.transpose(1, 2), k_rope), -1)
        s = (q @ k.transpose(-1, -2)) * (self.Z + self.P) ** -0.5
        seen = attention_mask.any(-1, keepdim=True)   # a query that sees nothing (a dropped block): zeros
        p = torch.softmax(s.masked_fill(~attention_mask, float("-inf")).masked_fill(~seen, 0.0), -1) * seen
        out = (p @ v.transpose(1, 2)).transpose(1, 2)   # [B, T, N, Y]
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x)).view(B, T, self.N, self.Y)
        return self.o_proj(out.reshape(B, T, -1)), None


def oracle(config):
    """SpecForge 0.2.0's DFlash model with TorchMLA in every layer."""
    model = dflash.DFlashDraftModel(config).float()
    for layer in model.layers:
        layer.self_attn = TorchMLA(config)
    model.config._attn_implementation = "eager"
    return model.eval()


def mla_config(tcfg, layer_types, q_lora=True, interleaved=True, gate=True, bias=False, nope=MLA["qk_nope_head_dim"]):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=96, num_key_value_heads=4, head_dim=8,
        vocab_size=tcfg.vocab_size, num_hidden_layers=len(layer_types), layer_types=layer_types,
        use_sliding_window=SLIDING in layer_types, sliding_window=WINDOW, rms_norm_eps=1e-6,
        max_position_embeddings=256, attention_bias=bias, block_size=BLOCK, num_target_layers=tcfg.num_hidden_layers,
        **{**MLA, "q_lora_rank": MLA["q_lora_rank"] if q_lora else None, "qk_nope_head_dim": nope},
        dflash_config={"target_layer_ids": [0, 1, 2], "mask_token_id": MASK_ID, "attention_mode": "mla",
                       "mla_rope_interleaved": interleaved, "mla_use_output_gate": gate})
    cfg.architectures = ["DFlashDraftModel"]
    return cfg


def write_oracle(path, config, seed):
    torch.manual_seed(seed)
    model = oracle(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):   # norms off one, so a swapped norm shows
                p.add_(0.3 * torch.randn_like(p))
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    config.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def sequence(tiny_target):
    return np.random.default_rng(8).integers(0, tiny_target.config.vocab_size, size=(2, S))


CASES = {   # layers, q_lora, interleaved, gate, bias, blocks kept (, qk_nope_head_dim)
    "full-qlora-interleaved-gate": ([FULL, FULL], True, True, True, False, [[True] * 3] * 2),
    "sliding-direct-q-halves-bias-dropped": ([FULL, SLIDING], False, False, False, True,
                                             [[True, True, False], [True] * 3]),
    "sliding-qlora-gate-dropped": ([SLIDING, FULL], True, True, True, False, [[True] * 3, [False, True, True]]),
    "full-rope-only-heads": ([FULL], True, True, False, False, [[True] * 3] * 2, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mla_checkpoint_loads_and_gives_the_oracles_outputs(tiny_target, tmp_path, sequence, case):
    layers, q_lora, interleaved, gate, bias, keep, *nope = CASES[case]
    config = mla_config(tiny_target.config, layers, q_lora, interleaved, gate, bias, *nope)
    model = write_oracle(tmp_path / "sf", config, seed=3)
    draft = e3.load_draft(tmp_path / "sf", tiny_target, dtype="float32")
    assert draft.config.mla is not None and draft.config.mla.output_gate == gate
    aux = np.asarray(tiny_target.forward(sequence, aux_layer_ids=draft.aux_layer_ids).aux_hidden, np.float32)
    ref, _ = _specforge_blocks(model, tiny_target, sequence, aux, ANCHORS, keep)
    out, logits = (np.asarray(a) for a in draft.forward_blocks(sequence, aux, ANCHORS, keep))
    rows = np.repeat(np.asarray(keep), BLOCK, axis=1)   # a dropped block's outputs are never read
    ref_logits = ref @ np.asarray(tiny_target.model.lm_head[...])
    err = np.abs(out - ref)[rows].max() / np.abs(ref[rows]).max()
    lerr = np.abs(logits - ref_logits)[rows].max() / np.abs(ref_logits[rows]).max()
    print(f"DFlash MLA {case}: outputs {err:.2e}, logits {lerr:.2e} (max |ours - oracle| / max |oracle|; "
          f"logits max |ours - oracle| {np.abs(logits - ref_logits)[rows].max():.2e})")
    assert err <= 1e-5 and lerr <= 1e-5, (err, lerr)
    if case == next(iter(CASES)):   # the comparison sees the rope convention: the other one is far off
        d = json.loads((tmp_path / "sf" / "config.json").read_text())
        d["dflash_config"]["mla_rope_interleaved"] = not interleaved
        (tmp_path / "sf" / "config.json").write_text(json.dumps(d))
        flipped = np.asarray(e3.load_draft(tmp_path / "sf", tiny_target, dtype="float32")
                             .forward_blocks(sequence, aux, ANCHORS, keep)[0])
        assert np.abs(flipped - ref)[rows].max() / np.abs(ref[rows]).max() > 1e-3


def test_mla_config_errors_come_before_weights(tiny_target, tmp_path):
    base = mla_config(tiny_target.config, [FULL]).to_dict()
    assert DFlashConfig.from_hf_dict(base).mla.qk_head_dim == 16
    for change, words in [({"kv_lora_rank": None}, r"missing \['kv_lora_rank'\]"),
                          ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 \\(even"),
                          ({"q_lora_rank": 0}, "q_lora_rank=0"), ({"v_head_dim": 0}, "v_head_dim=0"),
                          ({"qk_nope_head_dim": -1}, "qk_nope_head_dim=-1"),
                          ({"dflash_config": {**base["dflash_config"], "attention_mode": "latent"}}, "'mla'")]:
        with pytest.raises(ConfigError, match=words):
            DFlashConfig.from_hf_dict({**base, **change})
    bad = tmp_path / "bad"   # the weights are not even there: the config alone is refused
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**base, "qk_nope_head_dim": None}))
    with pytest.raises(ConfigError, match="qk_nope_head_dim"):
        e3.load_draft(bad, tiny_target)


def test_conversion_round_trip_is_byte_identical(tiny_target, tmp_path, sequence):
    from tests.test_dflash import assert_round_trip

    write_oracle(tmp_path / "sf", mla_config(tiny_target.config, [FULL, SLIDING], q_lora=False, bias=True), seed=7)
    assert_round_trip(tmp_path, tiny_target, sequence)


def tiny_mla_draft(tiny_target, seed):
    cfg = DFlashConfig.from_hf_dict(mla_config(tiny_target.config, [FULL, SLIDING]).to_dict())
    return build_dflash_draft(dataclasses.replace(cfg, hf_config={}), tiny_target, seed=seed, dtype="float32")


def test_serving_pass_equals_the_training_forward(tiny_target):
    """The decode loop's pass over the latent cache (blockwise for the full layer, the gathered window
    for the sliding one) gives the training forward's outputs for a block at the same anchor."""
    model = nnx.merge(*(lambda d: (d.graphdef, d.state))(tiny_mla_draft(tiny_target, seed=4)))
    rng = np.random.default_rng(2)
    n = 20
    ids = jnp.asarray(rng.integers(0, 256, size=(3, n)))
    aux = jnp.asarray(rng.standard_normal((3, n, 3 * 64)), jnp.float32)
    anchors, embed = jnp.asarray([3, 11, 15]), tiny_target.model.embed_tokens[...]
    cache = model.write_context(aux, jnp.broadcast_to(jnp.arange(n), (3, n)), model.init_cache(3, 32))
    assert cache[0].k_BSGH.shape == (3, 32, 1, 16 + 8) and cache[0].v_BSGH.shape == (3, 32, 1, 16)
    served = model.propose(ids[jnp.arange(3), anchors], anchors, cache, embed)
    trained = model.forward_blocks(aux, embed, ids, anchors[:, None], jnp.ones((3, 1), bool))
    err = float(jnp.max(jnp.abs(served - trained)) / jnp.max(jnp.abs(trained)))
    print(f"DFlash MLA serving pass vs training forward: {err:.2e}")
    assert err <= 1e-5


def test_trained_mla_draft_is_lossless_and_accepted(tiny_target, tiny_target_dir, tmp_path):
    """An MLA draft trained here on SpecForge's objective, exported and loaded back through its
    config.json: greedy output equals the target alone, on one device and on a mesh, and its
    guesses are accepted."""
    from tests.test_dflash_serving import BLOCK as SERVE_BLOCK
    from tests.test_dflash_serving import train_dflash

    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=32)
    prompts = [seqs[i, :n].tolist() for i, n in enumerate([6, 9, 12, 7, 6, 10, 8, 11])]
    ref = e3.Generator(tiny_target, None, max_len=48).generate(prompts, 24)
    d = {**mla_config(tiny_target.config, [FULL, SLIDING]).to_dict(), "block_size": SERVE_BLOCK, "sliding_window": 6,
         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "q_lora_rank": None,
         "intermediate_size": 128}
    draft = build_dflash_draft(dataclasses.replace(DFlashConfig.from_hf_dict(d), hf_config={}), tiny_target, seed=2)
    # wider than the oracle's shapes, and longer than the GQA draft's run: MLA's queries and keys have no
    # per-head norm, so at this init its attention takes ~150 steps to sharpen before the loss falls
    draft, losses, _ = train_dflash(tiny_target, draft, seqs, steps=300)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    e3.save_draft(draft, tmp_path / "d")
    draft = e3.load_draft(tmp_path / "d", tiny_target)
    assert draft.config.mla is not None
    res = e3.Generator(tiny_target, draft, num_draft_tokens=SERVE_BLOCK - 1, max_len=48).generate(prompts, 24)
    print(f"DFlash MLA training: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}; served: mean accept length "
          f"{res.stats.mean_accept_length:.2f}")
    assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
    assert res.stats.mean_accept_length > 1.3, res.stats
    # on a data x expert x tensor mesh (heads split, the one shared latent head not): the same tokens
    target = e3.load_target(tiny_target_dir, mesh=e3.make_mesh("data=2,expert=2,tensor=2"))
    sharded = e3.Generator(target, e3.load_draft(tmp_path / "d", target), num_draft_tokens=SERVE_BLOCK - 1, max_len=48)
    assert sharded.generate(prompts[:4], 24).tokens == ref.tokens[:4]


def test_training_step_loss_and_gradients_equal_the_oracles(predictable_target_dir, predictable_target,  # noqa: F811
                                                            rows_file, tmp_path):  # noqa: F811
    """``train.py``'s DFlash step on an MLA draft file (full and sliding layers): its loss and every
    gradient equal the oracle's autograd under SpecForge's ``OnlineDFlashModel``; the step runs."""
    from tests.test_train_dflash import _config, _dflash_file, _online_specforge, block_loss_and_grads
    from eagle3_jax.train.dflash_trainer import DFlashTrainer
    from eagle3_jax.train.step import micro_features

    mla = {**MLA, "dflash_config": {"target_layer_ids": [0, 1, 2], "attention_mode": "mla",
                                    "mla_rope_interleaved": True, "mla_use_output_gate": True}}
    cfg = _config(predictable_target_dir, rows_file, tmp_path / "run", draft={},
                  draft_config_file=_dflash_file(tmp_path, **mla))
    trainer = DFlashTrainer(cfg, progress=False)
    batch = trainer.next_batch()
    draft = trainer.draft_model()
    trainer.export(tmp_path / "start")
    from transformers import Qwen3Config

    theirs = oracle(Qwen3Config.from_pretrained(str(tmp_path / "start"))).train()
    missing, unexpected = theirs.load_state_dict(load_torch(str(tmp_path / "start" / "model.safetensors")),
                                                 strict=True)
    assert not missing and not unexpected
    online = _online_specforge(theirs, predictable_target, trainer.dcfg.mask_token_id)
    params, loss_and_grads = block_loss_and_grads(trainer, draft)
    mb = {k: v[0] for k, v in batch.items()}
    aux, _ = micro_features(mb, trainer.target.graphdef, trainer.target.state, trainer.aux_ids, cfg.target_chunk)
    (loss, _), grads = loss_and_grads(params, aux, mb)
    width = int(np.asarray(mb["keep"]).sum(1).max())
    anchors = torch.as_tensor(np.asarray(mb["anchor"], np.int64)[:, :width])
    keep = torch.as_tensor(np.asarray(mb["keep"])[:, :width])
    online._sample_anchor_positions = lambda *args, **kw: (anchors, keep)
    ref, _, _ = online(torch.as_tensor(np.asarray(mb["ids"], np.int64)), torch.as_tensor(np.array(aux)),
                       torch.as_tensor(np.array(mb["loss_mask"], np.float32)))
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (float(loss), float(ref))
    ours = dict(rule_tensors(dflash_rules(trainer.dcfg, 3),
                             {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}))
    worst = 0.0
    for name, p in theirs.named_parameters():
        g = p.grad.numpy()
        if name.endswith("kv_b_proj.bias"):   # only its value part: a key bias never moves a softmax
            g = g.reshape(MLA["num_attention_heads"], -1)[:, MLA["qk_nope_head_dim"]:]
            ours[name] = ours[name].reshape(g.shape[0], -1)[:, MLA["qk_nope_head_dim"]:]
        err = np.abs(ours[name] - g).max() / max(np.abs(g).max(), 1e-30)
        worst = max(worst, err)
        assert err <= 1e-5, (name, err)
    print(f"DFlash MLA step vs oracle: loss {float(loss):.7f} vs {float(ref):.7f}, worst gradient {worst:.2e}")
    result = trainer.run_step(batch)
    assert np.isfinite(result["loss"])
    trainer.close()
