"""Routed-expert compute for ``models/moe.py``, one kernel per backend, chosen in one place (``pick``).

Every kernel maps (x_MD, idx_MK, weights_MK, gate, up, down, first_expert) -> y_MD: float kernels
take the stacks [E, D, F] / [E, F, D]; quantized kernels take (values, scales, container) triples
in checkpoint orientation [E, out, in]. Experts outside [first_expert, first_expert + E) are
another device's and contribute 0. All give the same result up to float summation order.

Float stacks (``EXPERT_KERNELS``):
  * ``blocked`` (CPU): assignments sorted by expert, then a loop over fixed-size row blocks of the
    *non-empty* experts only: work O(assignments + experts hit), never O(all experts). Not
    reverse-differentiable (a dynamic-length loop); on GPU every trip is a kernel launch.
  * ``ragged`` (TPU, GPU): ``jax.lax.ragged_dot``, a native grouped matmul. Differentiable.
    XLA:CPU lowers it to O(tokens x all experts).
  * ``padded_blocks``: ``blocked`` with a static trip count (each expert's run padded to whole
    blocks) as one batched matmul. Differentiable: the cheap training kernel on CPU.
Quantized stacks (``QUANT_EXPERT_KERNELS``):
  * ``blocked`` (CPU): the loop above, each trip dequantizing its expert a tile of columns at a time.
  * ``grouped`` (TPU, GPU): three Pallas grouped matmuls that dequantize in the kernel (``quant_gmm*.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from eagle3_jax.errors import ConfigError
from eagle3_jax.kernels import quant_gmm
from eagle3_jax.kernels.dequant import quantized_matmul, take_expert


def sort_assignments(idx_MK, weights_MK, first_expert, num_local):
    """(token per sorted assignment, its weight, rows per local expert), sorted by local expert;
    non-local assignments go last (key = num_local) with weight 0."""
    M, K = idx_MK.shape
    local_A = idx_MK.reshape(-1) - first_expert
    is_local_A = (local_A >= 0) & (local_A < num_local)
    key_A = jnp.where(is_local_A, local_A, num_local)
    order_A = jnp.argsort(key_A, stable=True)
    token_A = (jnp.arange(M * K, dtype=jnp.int32) // K)[order_A]
    weight_A = jnp.where(is_local_A, weights_MK.reshape(-1), 0.0)[order_A]
    counts_E = jnp.bincount(key_A, length=num_local + 1)[:num_local].astype(jnp.int32)
    return token_A, weight_A, counts_E


def pow2_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1.0)) - 1e-6))  # 16.0000001 is 16


def block_rows(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Static block size of the ``blocked`` loop: the mean rows of an expert *that is hit*
    (M p / (1 - (1 - p)^M) with p = top_k / E), rounded up to a power of two in [1, 256]. A trip's
    fixed cost (copying its expert's weights out of the stack) is worth a few rows of compute at
    any D x F, so a block should hold what one expert receives."""
    p = min(1.0, top_k / max(1, num_experts))
    hit_rows = num_tokens * p / (1.0 - (1.0 - p) ** num_tokens) if num_tokens > 0 else 1.0
    return min(256, pow2_at_least(hit_rows), pow2_at_least(num_tokens))


def block_table(idx_MK, weights_MK, first_expert, num_experts: int, b: int):
    """Assignments sorted by local expert and cut into blocks of ``b`` rows of one expert each:
    (expert per block e_J, token per row tok_JB, routing weight per row w_JB (0 on padding rows),
    blocks in use). The static block count is the most any routing needs: every block holds a
    row, and at most one partial block per expert."""
    M, K = idx_MK.shape
    A = M * K
    token_A, weight_A, counts_E = sort_assignments(idx_MK, weights_MK, first_expert, num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    blocks_E = (counts_E + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    block_start_E = block_end_E - blocks_E
    n_blocks = min(A, -(-A // b) + min(num_experts, A))
    j_J = jnp.arange(n_blocks, dtype=jnp.int32)
    # compare_all: a [J, E] comparison, not the default binary search (a while loop of log2(E) trips)
    e_J = jnp.minimum(jnp.searchsorted(block_end_E, j_J, side="right", method="compare_all"),
                      num_experts - 1).astype(jnp.int32)
    row_JB = (j_J - block_start_E[e_J])[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]
    valid_JB = (j_J < block_end_E[-1])[:, None] & (row_JB < counts_E[e_J][:, None])
    a_JB = jnp.where(valid_JB, starts_E[e_J][:, None] + row_JB, 0)
    tok_JB = token_A[a_JB]
    w_JB = jnp.where(valid_JB, weight_A[a_JB], 0.0)   # padding rows add 0
    return e_J, tok_JB, w_JB, block_end_E[-1]


def _blocked_loop(x_MD, idx_MK, weights_MK, first_expert, num_experts, expert_ffn):
    """The ``blocked`` loop: one fori_loop trip per non-empty block of ``block_table``, each only
    gather -> ``expert_ffn(x_bD, e) -> y_bD`` (dense or quantized weights) -> scatter-add."""
    M, K = idx_MK.shape
    e_J, tok_JB, w_JB, used = block_table(idx_MK, weights_MK, first_expert, num_experts,
                                          block_rows(M, K, num_experts))

    def one_block(j, out_MD):
        tok_b = tok_JB[j]
        y_bD = expert_ffn(x_MD[tok_b], e_J[j])
        return out_MD.at[tok_b].add(y_bD * w_JB[j][:, None].astype(y_bD.dtype))

    return jax.lax.fori_loop(0, used, one_block, jnp.zeros_like(x_MD))


def experts_blocked(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    def ffn(x_bD, e):
        return (jax.nn.silu(x_bD @ w_gate_EDF[e]) * (x_bD @ w_up_EDF[e])) @ w_down_EFD[e]

    return _blocked_loop(x_MD, idx_MK, weights_MK, first_expert, w_gate_EDF.shape[0], ffn)


def experts_ragged(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    E = w_gate_EDF.shape[0]
    token_A, weight_A, counts_E = sort_assignments(idx_MK, weights_MK, first_expert, E)
    x_AD = x_MD[token_A]
    # Rows past sum(counts) (non-local assignments) belong to no group: ragged_dot leaves them 0.
    g_AF = jax.lax.ragged_dot(x_AD, w_gate_EDF, counts_E)
    u_AF = jax.lax.ragged_dot(x_AD, w_up_EDF, counts_E)
    y_AD = jax.lax.ragged_dot(jax.nn.silu(g_AF) * u_AF, w_down_EFD, counts_E)
    y_AD = y_AD * weight_A[:, None].astype(y_AD.dtype)
    return jnp.zeros_like(x_MD).at[token_A].add(y_AD)


PADDED_BLOCK_ROWS = 128


def experts_blocked_quantized(x_MD, idx_MK, weights_MK, gate, up, down, first_expert):
    """``experts_blocked`` over quantized (values, scales, container) stacks: each block dequantizes
    its own expert a tile of input columns at a time (``quantized_matmul``), never a whole stack."""
    def matmul(x_bI, w, e):
        values, scales, stack = w
        return quantized_matmul(x_bI, take_expert(values, e), scales[e], stack)

    def ffn(x_bD, e):
        return matmul(jax.nn.silu(matmul(x_bD, gate, e)) * matmul(x_bD, up, e), down, e)

    return _blocked_loop(x_MD, idx_MK, weights_MK, first_expert, gate[0].shape[0], ffn)


def experts_grouped_quantized(x_MD, idx_MK, weights_MK, gate, up, down, first_expert, platform="tpu"):
    """Quantized experts as three grouped matmuls over all expert blocks (``kernels/quant_gmm.py``).
    ``platform``: "tpu" (Mosaic), "gpu" (Triton), anything else the Mosaic kernels interpreted."""
    M, K = idx_MK.shape
    E = gate[0].shape[0]
    b = min(256, max(quant_gmm.min_rows(platform), block_rows(M, K, E)))
    e_J, tok_JB, w_JB, used = block_table(idx_MK, weights_MK, first_expert, E, b)
    tok_A = tok_JB.reshape(-1)
    y_AD = quant_gmm.expert_ffn(x_MD[tok_A], e_J, used, gate, up, down, b, platform)
    y_AD = y_AD * w_JB.reshape(-1, 1).astype(y_AD.dtype)
    return jnp.zeros_like(x_MD).at[tok_A].add(y_AD)


def experts_padded_blocks(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    M, K = idx_MK.shape
    b = min(PADDED_BLOCK_ROWS, pow2_at_least(M * K))
    e_J, tok_JB, w_JB, _ = block_table(idx_MK, weights_MK, first_expert, w_gate_EDF.shape[0], b)
    x_JBD = x_MD[tok_JB]
    g_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_gate_EDF[e_J])
    u_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_up_EDF[e_J])
    y_JBD = jnp.einsum("jbf,jfd->jbd", jax.nn.silu(g_JBF) * u_JBF, w_down_EFD[e_J])
    y_JBD = y_JBD * w_JB[..., None].astype(y_JBD.dtype)
    return jnp.zeros_like(x_MD).at[tok_JB.reshape(-1)].add(y_JBD.reshape(-1, x_MD.shape[-1]))


# (x_MD, idx_MK, weights_MK, w_gate, w_up, w_down, first_expert) -> y_MD
ExpertKernel = Callable[..., jax.Array]
EXPERT_KERNELS: dict[str, ExpertKernel] = {
    "blocked": experts_blocked, "ragged": experts_ragged, "padded_blocks": experts_padded_blocks}
QUANT_EXPERT_KERNELS: dict[str, ExpertKernel] = {
    "blocked": experts_blocked_quantized, "grouped": experts_grouped_quantized}


def pick(name: str | None, platform: str, quantized: bool = False, shards=()) -> str:
    """The expert kernel for ``platform`` (where the program will run, not necessarily
    ``jax.default_backend()``): ``name`` if given and valid, else the platform's default (module
    docstring). Quantized: a float kernel's name means the default, and ``grouped`` falls back to
    ``blocked`` for stacks whose per-device ``shards`` ((container, out, in)) the kernels do not take.
    """
    if not quantized:
        name = name or ("blocked" if platform == "cpu" else "ragged")
        if name not in EXPERT_KERNELS:
            raise ConfigError(f"unknown moe kernel '{name}'; choose one of {', '.join(EXPERT_KERNELS)}")
        return name
    if name not in QUANT_EXPERT_KERNELS:
        name = "blocked" if platform == "cpu" else "grouped"
    if name == "grouped" and not all(quant_gmm.supports(st, o, i, platform) for st, o, i in shards):
        return "blocked"
    return name


def kernel(name: str, platform: str, quantized: bool = False) -> ExpertKernel:
    """The function of a kernel ``pick`` chose."""
    if quantized:
        fn = QUANT_EXPERT_KERNELS[name]
        return functools.partial(fn, platform=platform) if name == "grouped" else fn
    return EXPERT_KERNELS[name]
