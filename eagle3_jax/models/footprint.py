"""What a target's parameters occupy on the devices, by kind of weight and storage."""

from __future__ import annotations

from collections import defaultdict

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.models.attention import MLAttention
from eagle3_jax.models.layers import SwiGLU
from eagle3_jax.models.moe import MoE
from eagle3_jax.models.quantized import Fp8Linear, Fp8Stack, Int4Stack


def leaf_bytes(value) -> int:
    """Bytes an array occupies over all its devices (a replicated array counts once per device)."""
    shards = getattr(value, "addressable_shards", None)
    if shards:
        return int(sum(s.data.nbytes for s in shards))
    return int(np.prod(value.shape) * jnp.dtype(value.dtype).itemsize)


def _role(chain) -> str:
    """chain: [(name, object reached by it)] from the model down to the variable."""
    for i, (name, obj) in enumerate(chain):
        if isinstance(obj, MLAttention):
            return "attention"
        if isinstance(obj, MoE):
            child = chain[i + 1][0] if i + 1 < len(chain) else None
            if child in ("w_gate", "w_up", "w_down"):
                return "routed experts"
            if child == "shared_experts":
                return "shared experts"
            return "router"
        if isinstance(obj, SwiGLU):
            return "dense mlp"
    last = chain[-1][0]
    return "embeddings" if last in ("embed_tokens", "lm_head") else "norms"


def weight_bytes_by_kind(model: nnx.Module) -> dict[str, int]:
    """{"routed experts (int4)": bytes, "attention (fp8)": ..., "norms (float32)": ...}."""
    out: dict[str, int] = defaultdict(int)
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        chain, node = [(None, model)], model
        for p in path:
            node = node[p] if isinstance(p, int) else getattr(node, p)
            chain.append((p, node))
        owner = chain[-2][1]
        if isinstance(owner, Int4Stack):
            storage = "int4"
        elif isinstance(owner, (Fp8Stack, Fp8Linear)):
            storage = "fp8"
        else:
            storage = jnp.dtype(var.get_value().dtype).name
        out[f"{_role(chain)} ({storage})"] += leaf_bytes(var.get_value())
    return dict(sorted(out.items()))
