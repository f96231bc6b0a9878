"""Small DeepSeek-V3-shaped targets: the one definition the tests, the benchmarks and the demo recipe
start from.

``configs/models/tiny_deepseek_v3.json`` is the tiny target (MLA with a q LoRA, YaRN, grouped
sigmoid routing, shared experts). A caller that needs another size states only the fields it
changes; everything else (architecture, activation, router method, norms) comes from that file.
``save_random_target`` writes a random checkpoint of such a shape with transformers'
``save_pretrained``, the oracle the tests compare against (torch and transformers: the ``dev``
extra).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "models" / "tiny_deepseek_v3.json"


def hf_config_dict(**overrides) -> dict:
    """The tiny target's config.json with ``overrides`` applied (``rope_scaling=None``: plain RoPE)."""
    return {**json.loads(TINY_CONFIG.read_text()), **overrides}


def transformers_config(overrides: dict | None = None):
    """``hf_config_dict(**overrides)`` as a transformers ``DeepseekV3Config`` (rope_scaling written the
    way transformers 5 reads it), with weights drawn wide enough (std 0.1) that logits are not flat."""
    import transformers

    overrides = overrides or {}
    d = {k: v for k, v in hf_config_dict(**overrides).items() if k != "architectures"}
    if "rope_scaling" in overrides and overrides["rope_scaling"] is None:
        d.pop("rope_scaling", None)
        d.pop("rope_parameters", None)
    elif "rope_scaling" in overrides:
        d["rope_parameters"] = dict(d.pop("rope_scaling"), rope_theta=d.get("rope_theta", 10000.0))
    d["initializer_range"] = 0.1
    return transformers.DeepseekV3Config(**d)


def randomize(model, seed: int) -> None:
    """Non-trivial norms and correction biases, so a mapping mistake cannot hide behind ones/zeros."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.rand(b.shape, generator=g))


def save_random_target(path: Path, overrides: dict | None = None, seed: int = 0):
    """A random ``DeepseekV3ForCausalLM`` of that shape, saved to ``path``; returns (path, torch model)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers_config(overrides)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return path, model
