"""A differentiable routed-expert kernel for pre-training the demo target on CPU.

``eagle3_jax.models.moe`` offers ``blocked`` (fast, but a loop of dynamic length: not
reverse-differentiable) and ``ragged`` (differentiable, but on the CPU backend ``ragged_dot`` costs
as much as running every expert on every assignment: measured at ~60 % of a demo training step).
This kernel is ``blocked`` with a static trip count: assignments sorted by expert, each expert's
run padded to whole blocks of ``block`` rows, and a fixed number of blocks — the most any routing
can need, ceil(A / block) + E — computed as one batched matmul against the per-block gathered
expert weights. Padding rows carry weight 0. It is dropless and exact (same sums as ``ragged``, in
another order), and its cost is about (A + E · block) rows instead of A · E.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.models import moe

NAME = "padded_blocks"
BLOCK_ROWS = 128


def experts_padded_blocks(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    E = w_gate_EDF.shape[0]
    M, K = idx_MK.shape
    A = M * K
    b = BLOCK_ROWS
    n_blocks = -(-A // b) + E
    token_A, weight_A, counts_E = moe._sort_assignments(idx_MK, weights_MK, first_expert, E)
    starts_E = jnp.cumsum(counts_E) - counts_E
    blocks_E = (counts_E + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    block_start_E = block_end_E - blocks_E

    j_J = jnp.arange(n_blocks, dtype=jnp.int32)
    used_J = j_J < block_end_E[-1]
    e_J = jnp.minimum(jnp.searchsorted(block_end_E, j_J, side="right"), E - 1)
    row_JB = (j_J - block_start_E[e_J])[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]
    valid_JB = used_J[:, None] & (row_JB < counts_E[e_J][:, None])
    a_JB = jnp.where(valid_JB, starts_E[e_J][:, None] + row_JB, 0)
    tok_JB = token_A[a_JB]
    w_JB = jnp.where(valid_JB, weight_A[a_JB], 0.0)

    x_JBD = x_MD[tok_JB]
    g_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_gate_EDF[e_J])
    u_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_up_EDF[e_J])
    y_JBD = jnp.einsum("jbf,jfd->jbd", jax.nn.silu(g_JBF) * u_JBF, w_down_EFD[e_J])
    y_JBD = y_JBD * w_JB[..., None].astype(y_JBD.dtype)
    return jnp.zeros_like(x_MD).at[tok_JB.reshape(-1)].add(y_JBD.reshape(-1, x_MD.shape[-1]))


def register() -> str:
    """Makes the kernel selectable as ``Target(..., moe_kernel="padded_blocks")`` in this process."""
    moe.EXPERT_KERNELS.setdefault(NAME, experts_padded_blocks)
    return NAME
