"""What the compiler's cost analysis does not count in a decode round, computed from the shapes.

The cost analysis counts a loop's body once, whatever its trip count (checked on the TPU
compiler: a static 8-trip ``fori_loop`` over tiles of a matrix reports one tile's bytes), and a
conditional at its costlier branch. What a round's loops leave out is added here:

* attention over the filled slots (``models/attention.py``): one trip per block of ``kb`` slots,
  ``kb`` from the product's own ``key_block``; the trips after the first read ``kb`` more slots per
  row and read and write the running max, sum and weighted sum (float32). The draft's GQA trip
  also copies its block of keys and of values to the layout its dot wants (read, write, read
  again: ``GQA_BLOCK_PASSES``; seen in the compiled Kimi-K2.5 round on v5p, where the target's MLA
  trips copy nothing);
* FP8 projections (``Fp8Linear``, DeepSeek-V3's checkpoint form) loop over tiles of columns, but
  nothing is added for them: in the compiled DeepSeek-V3 round the tile loop's body takes each
  whole matrix and relays it out inside a fusion, so the one trip counted already charges the
  whole matrix (0.51 GB per MoE layer counted beside 0.23 GB of FP8 values and scales);
* routed experts: the compiled program reserves blocks for the worst routing, so its kernels'
  estimates are replaced by what a routing model expects (``roofline.experts_touched``): the
  experts the busiest chip reads (values and scales, as held) and the rows it computes.

The sampling branch of the accept step (a conditional) is left as the compiler counts it: a
greedy round is priced as if it sampled, a few percent of a full-width round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from eagle3_jax.config import TargetConfig
from eagle3_jax.drafts import DraftConfig
from eagle3_jax.models.attention_core import key_block
from tools.plan.common import Leaf
from tools.plan.roofline import Routing, experts_touched

F32 = 4
GQA_BLOCK_PASSES = 3


@dataclass(frozen=True)
class Shape:
    """A round's shape: rows per chip, draft tokens K, filled slots per row, cache capacity."""

    rows: int
    k: int
    context: int
    capacity: int


def attention_extra(rows: int, tokens: int, heads: int, capacity: int, filled: int, slot_bytes: int,
                    width: int, flops_per_slot: int) -> tuple[float, float]:
    """(bytes, flops) of an attention call's block trips after the first."""
    kb = key_block(capacity, tokens, heads)
    if kb >= capacity:   # one whole-capacity step, no loop: the compiler counts it all
        return 0.0, 0.0
    trips = math.ceil(min(filled, capacity) / kb)
    step_bytes = rows * kb * slot_bytes + 2 * F32 * rows * tokens * heads * (width + 2)
    step_flops = 2 * rows * tokens * heads * kb * flops_per_slot
    return (trips - 1) * step_bytes, (trips - 1) * step_flops


def target_attention_extra(cfg: TargetConfig, layers: int, s: Shape, cache_itemsize: int, tensor: int
                           ) -> tuple[float, float]:
    """MLA over the latent cache: one call per layer in the verify pass (K + 1 tokens; 1 at K = 0)."""
    C, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    T = s.k + 1
    b, f = attention_extra(s.rows, T, cfg.num_attention_heads // tensor, s.capacity, s.context + T,
                           (C + P) * cache_itemsize, C, 2 * C + P)
    return layers * b, layers * f


def draft_attention_extra(d: DraftConfig, s: Shape, cache_itemsize: int, tensor: int) -> tuple[float, float]:
    """The draft's GQA over its cache: K - 1 one-token steps and a catch-up of K + 1 tokens."""
    if s.k == 0:
        return 0.0, 0.0
    G, H, N = d.num_key_value_heads // tensor, d.head_dim, d.num_attention_heads // tensor
    total_b = total_f = 0.0
    for tokens, filled in [(1, s.context + j) for j in range(1, s.k)] + [(s.k + 1, s.context + s.k + 1)]:
        b, f = attention_extra(s.rows, tokens, N, s.capacity, filled, GQA_BLOCK_PASSES * 2 * G * H * cache_itemsize,
                               H, 2 * H)
        total_b, total_f = total_b + b, total_f + f
    return total_b, total_f


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts on one chip: bytes of one expert as held (values and scales,
    this chip's slice of it), flops per routed row, experts per chip group."""

    expert_bytes: float
    row_flops: float
    row_bytes: float
    n_experts: int
    top_k: int
    groups: int

    def cost(self, tokens: float, routing: Routing) -> tuple[float, float, float]:
        """(bytes, flops, experts read) on the busiest chip for ``tokens`` routed tokens."""
        touched, rows = experts_touched(tokens, self.n_experts, self.top_k, self.groups, routing)
        return touched * self.expert_bytes + rows * self.row_bytes, rows * self.row_flops, touched


def expert_layer(cfg: TargetConfig, target_leaves: list[Leaf], mesh_shape: dict[str, int], itemsize: int
                 ) -> ExpertLayer | None:
    """From the routed-expert leaves of a (cut) target: what one expert costs a chip to read."""
    routed = [leaf for leaf in target_leaves if leaf.routed_expert]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if not routed or not moe_layers:
        return None
    groups = mesh_shape.get("expert", 1)
    per_chip_experts = cfg.n_routed_experts // groups
    tensor = mesh_shape.get("tensor", 1)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    return ExpertLayer(
        expert_bytes=sum(leaf.device_bytes for leaf in routed) / moe_layers / per_chip_experts,
        row_flops=2.0 * 3 * D * F / tensor,
        # a row in and out of each projection: x and the output (D wide), gate/up/hidden (F wide)
        row_bytes=float(itemsize * (2 * D + 3 * F // tensor) + F32 * (D + 2 * F // tensor)),
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, groups=groups)


def moe_layers(cfg: TargetConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize
