"""Shared helpers for the benchmark scripts: timing, table printing, a random HF target checkpoint.

Benchmarks are not tests: they print tables of ratios measured side by side in one run.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def machine() -> str:
    import os

    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}"


def block(x):
    """Waits for every jax array in a pytree (no-op for anything else)."""
    import jax

    for leaf in jax.tree_util.tree_leaves(x):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
    return x


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median seconds per call of fn() after warmup calls; fn's result is blocked on.

    Keeps calling past ``repeats`` until ``min_time`` seconds of samples are collected (fast calls).
    """
    for _ in range(warmup):
        block(fn())
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats or (time.perf_counter() - start) < min_time:
        t0 = time.perf_counter()
        block(fn())
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return statistics.median(samples)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        if c == 0:
            return "0"
        if abs(c) >= 100:
            return f"{c:.0f}"
        if abs(c) >= 1:
            return f"{c:.2f}"
        if abs(c) >= 1e-3:
            return f"{c:.3f}"
        return f"{c:.1e}"
    return str(c)


# A small DeepSeek-V3-shaped model that runs on a laptop CPU: MLA with q-LoRA, group-limited
# sigmoid routing, one dense layer then MoE layers with a shared expert.
BENCH_TARGET_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "use_cache": True,
}


def save_random_hf_target(path: Path, config: dict = BENCH_TARGET_CONFIG, seed: int = 0):
    """Builds a random transformers DeepseekV3ForCausalLM, save_pretrained()s it, returns the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k != "architectures"})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Non-trivial norms and correction biases, so routing is not degenerate.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.rand(b.shape, generator=g))
    model.save_pretrained(path)
    return model
