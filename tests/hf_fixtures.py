"""The parity targets: random small DeepseekV3 checkpoints written by transformers' save_pretrained
(the oracle), each the tiny target (tools/random_target.py) with a few fields changed."""

from __future__ import annotations

import torch

from tools.random_target import REPO, save_random_target  # noqa: F401 (the tests' names for them)
from tools.random_target import hf_config_dict

TINY = hf_config_dict()

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


def torch_forward(model, ids, output_hidden_states=False):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=output_hidden_states)
