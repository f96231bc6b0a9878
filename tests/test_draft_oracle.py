"""The draft against an independent torch implementation of the SpecForge/SGLang EAGLE-3 layer,
fed by transformers' own hidden states of the target (the aux states SGLang would capture)."""

import numpy as np
import torch
from safetensors.torch import load_file

import eagle3_jax as e3
from tests import hf_fixtures


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[None, :, None] + rot * sin[None, :, None]


def reference_draft_logits(sd, cfg, embed, aux, ids):
    B, T = ids.shape
    N, G, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "midlayer."
    fused = aux @ sd["fc.weight"].T
    x = torch.cat([_rms(embed[ids], sd[p + "input_layernorm.weight"]), _rms(fused, sd[p + "hidden_norm.weight"])], -1)
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, N, H)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, G, H)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, G, H)
    pos = torch.arange(T)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(N // G, dim=2), v.repeat_interleave(N // G, dim=2)
    att = torch.einsum("bqnh,bknh->bnqk", q, k) / H ** 0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("bnqk,bknh->bqnh", att, v).reshape(B, T, N * H) @ sd[p + "self_attn.o_proj.weight"].T
    h = fused + o
    m = _rms(h, sd[p + "post_attention_layernorm.weight"])
    out = h + (torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
               ) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_draft_matches_torch_reference(hf_target_dirs, random_draft_dir):
    import json

    path, torch_target = hf_target_dirs["qlora_groups_yarn"]
    target = e3.load_target(path)
    draft = e3.load_draft(random_draft_dir, target)
    ids = np.random.default_rng(11).integers(0, 256, size=(2, 9))
    ref_out = hf_fixtures.torch_forward(torch_target, ids, output_hidden_states=True)
    # SGLang captures the output of layer i = transformers' hidden_states[i + 1]
    aux = torch.cat([ref_out.hidden_states[i + 1] for i in draft.aux_layer_ids], -1)
    sd = load_file(str(random_draft_dir / "model.safetensors"))
    cfg = json.loads((random_draft_dir / "config.json").read_text())
    with torch.no_grad():
        ref = reference_draft_logits(sd, cfg, torch_target.model.embed_tokens.weight, aux, torch.as_tensor(ids))
    ours = np.asarray(draft.forward(ids, target.forward(ids, aux_layer_ids=draft.aux_layer_ids).aux_hidden).logits)
    ref = ref.numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
