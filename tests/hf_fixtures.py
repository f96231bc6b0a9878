"""Random small DeepseekV3 checkpoints written by transformers' save_pretrained (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
TINY = json.loads((REPO / "configs/models/tiny_deepseek_v3.json").read_text())

# Together these cover: q_lora set and null; n_group > 1 with topk_group < n_group; YaRN with
# mscale_all_dim; first_k_dense_replace >= 1; norm_topk_prob true and false; several experts per
# token; 1 and > 1 shared experts; interleaved and half-split rope.
PARITY_CONFIGS = {
    "qlora_groups_yarn": {},  # tiny_deepseek_v3.json: q_lora 32, 4 groups keep 2, YaRN, 2 shared, k=3
    "noqlora_plain_rope": {
        "q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
        "rope_scaling": None, "rope_parameters": None, "rope_theta": 50000.0, "rope_interleave": False,
        "num_hidden_layers": 5, "routed_scaling_factor": 1.7,
    },
    "yarn_mscale_softmax_scale": {
        "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 32},
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    },
}


def hf_config(overrides: dict) -> transformers.DeepseekV3Config:
    d = {k: v for k, v in TINY.items() if k != "architectures"}
    d.update(overrides)
    if overrides.get("rope_scaling") is None and "rope_scaling" in overrides:
        d.pop("rope_scaling", None)
        d.pop("rope_parameters", None)
    elif "rope_scaling" in overrides:
        d["rope_parameters"] = dict(overrides["rope_scaling"], rope_theta=d.get("rope_theta", 10000.0))
        d.pop("rope_scaling")
    d["initializer_range"] = 0.1
    return transformers.DeepseekV3Config(**d)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial norms and correction biases, so a mapping mistake cannot hide behind ones/zeros."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.rand(b.shape, generator=g))


def save_random_target(path: Path, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(overrides)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return path, model


def torch_forward(model, ids, output_hidden_states=False):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=output_hidden_states)
