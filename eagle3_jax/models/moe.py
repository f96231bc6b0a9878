"""Mixture of experts: the DeepSeek-V3 router and routed-expert compute whose cost follows top-k.

Routing (DeepSeek-V3 "noaux_tc"): float32 scores (sigmoid or softmax); the correction bias is added
for *choosing* experts only; experts are chosen within the ``topk_group`` best groups (a group is
scored by the sum of its two best biased scores); the weights are the unbiased scores of the chosen
experts, normalized when ``norm_topk_prob``, times ``routed_scaling_factor``.

Expert compute. Every kernel has one signature (``ExpertKernel``) and is chosen by name from
``EXPERT_KERNELS`` (the ``moe_kernel`` argument of ``Target``/``load_target``); all give the same
result up to float summation order:
  * ``blocked``: assignments (token, expert) sorted by expert, then a loop over fixed-size row blocks
    of the *non-empty* experts only; each block is a [b, D] x [D, F] matmul with that expert's
    weights. Work = O(assignments + experts hit), never O(all experts). Not reverse-differentiable
    (a dynamic-length loop); on GPU every trip is a kernel launch plus a host-visible predicate.
    (Gathering every assignment's expert weights at once, ``w_EDF[expert_ids]``, instead of the
    loop at decode sizes was measured 10x slower on CPU: benchmarks/moe_dispatch.py.)
  * ``ragged``: tokens sorted by expert through ``jax.lax.ragged_dot``, a grouped matmul (native on
    TPU and GPU). Differentiable. On the CPU backend XLA lowers it to O(tokens x all experts)
    (measured in benchmarks/moe_dispatch.py), so it is not the CPU default.
  * ``padded_blocks``: ``blocked`` with a static trip count: each expert's run padded to whole
    blocks, and the most blocks any routing can need, ceil(A / b) + E, computed as one batched
    matmul against per-block gathered weights. Cost about (A + E b) rows. Differentiable, so it is
    the cheap training kernel on CPU.
With a mesh, experts are sharded over the expert mesh axis and expert width over the tensor axis
(the table in ``sharding.py``): inside ``jax.shard_map`` each device runs only its local experts on
the tokens routed to them, and a psum combines the partial outputs.

Routing statistics: ``capture_routes(fn)`` returns the expert ids every MoE layer chose during
``fn(model, ...)`` (sown as ``nnx.Intermediate`` ``expert_ids`` while recording is on).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.layers import SwiGLU, param
from eagle3_jax.models.quantized import Int4Stack, QuantLayout, expert_stack, quantized_matmul, take_expert
from eagle3_jax.sharding import mesh_axis

# (x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert) -> y_MD. Experts
# outside [first_expert, first_expert + E) are someone else's (another device's) and contribute 0.
ExpertKernel = Callable[..., jax.Array]


def route(x_MD: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array, cfg: TargetConfig):
    """Returns (expert ids [M, K] int32, weights [M, K] float32)."""
    logits_ME = jnp.einsum("md,de->me", x_MD.astype(jnp.float32), w_router_DE.astype(jnp.float32))
    if cfg.scoring_func == "sigmoid":
        scores_ME = jax.nn.sigmoid(logits_ME)
    else:
        scores_ME = jax.nn.softmax(logits_ME, axis=-1)
    choice_ME = scores_ME + bias_E[None, :]
    E, n_group = cfg.n_routed_experts, cfg.n_group
    if n_group > 1:
        grouped_MGE = choice_ME.reshape(-1, n_group, E // n_group)
        group_score_MG = jax.lax.top_k(grouped_MGE, 2)[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_score_MG, cfg.topk_group)
        group_keep_MG = jnp.zeros_like(group_score_MG, dtype=bool).at[
            jnp.arange(group_score_MG.shape[0])[:, None], top_groups].set(True)
        keep_ME = jnp.repeat(group_keep_MG, E // n_group, axis=1)
        choice_ME = jnp.where(keep_ME, choice_ME, -jnp.inf)
    _, idx_MK = jax.lax.top_k(choice_ME, cfg.num_experts_per_tok)
    weights_MK = jnp.take_along_axis(scores_ME, idx_MK, axis=1)
    if cfg.norm_topk_prob:
        weights_MK = weights_MK / (weights_MK.sum(-1, keepdims=True) + 1e-20)
    return idx_MK.astype(jnp.int32), weights_MK * cfg.routed_scaling_factor


def sort_assignments(idx_MK, weights_MK, first_expert, num_local):
    """(token per sorted assignment, its weight, rows per local expert), sorted by local expert.

    Non-local assignments go last (key = num_local) with weight 0.
    """
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
    """Static block size of the ``blocked`` loop: the mean rows of an expert *that is hit*, rounded
    up to a power of two in [1, 256].

    A trip's fixed cost is copying its expert's three weight matrices out of the stack (XLA:CPU
    does not read a dynamic slice in place: ~15 us a trip at the demo's 256 x 48 experts, the
    price of about five rows of compute at any D x F, since both scale with D x F). So blocks
    should hold what one expert receives: each expert is hit by a token with probability
    p = top_k / E, and an expert that is hit holds M p / (1 - (1 - p)^M) rows on average. Sizing by
    the mean over *all* experts (A / E) made one trip per row when A < 2E: verifying 7 tokens of
    the demo target took 28 trips a layer instead of ~14.
    """
    p = min(1.0, top_k / max(1, num_experts))
    hit_rows = num_tokens * p / (1.0 - (1.0 - p) ** num_tokens) if num_tokens > 0 else 1.0
    return min(256, pow2_at_least(hit_rows), pow2_at_least(num_tokens))


def _blocked_loop(x_MD, idx_MK, weights_MK, first_expert, num_experts, expert_ffn):
    """The ``blocked`` loop: assignments sorted by expert, one fori_loop trip per non-empty block of
    rows of one expert; ``expert_ffn(x_bD, e) -> y_bD`` runs expert e on a block (dense or quantized
    weights). Experts outside [first_expert, first_expert + num_experts) contribute 0.

    Which expert and rows each block j takes is computed for all blocks before the loop (a few
    vector ops), so a trip is only gather -> expert -> scatter-add."""
    M, K = idx_MK.shape
    A = M * K
    token_A, weight_A, counts_E = sort_assignments(idx_MK, weights_MK, first_expert, num_experts)
    b = block_rows(M, K, num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    blocks_E = (counts_E + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    block_start_E = block_end_E - blocks_E
    # No routing needs more blocks than this: every block holds a row, and at most one partial per expert.
    n_blocks = min(A, -(-A // b) + min(num_experts, A))
    j_J = jnp.arange(n_blocks, dtype=jnp.int32)
    e_J = jnp.minimum(jnp.searchsorted(block_end_E, j_J, side="right"), num_experts - 1).astype(jnp.int32)
    row_JB = (j_J - block_start_E[e_J])[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]
    valid_JB = row_JB < counts_E[e_J][:, None]
    a_JB = jnp.where(valid_JB, starts_E[e_J][:, None] + row_JB, 0)
    tok_JB = token_A[a_JB]
    w_JB = jnp.where(valid_JB, weight_A[a_JB], 0.0)   # padding rows add 0

    def one_block(j, out_MD):
        tok_b = tok_JB[j]
        y_bD = expert_ffn(x_MD[tok_b], e_J[j])
        return out_MD.at[tok_b].add(y_bD * w_JB[j][:, None].astype(y_bD.dtype))

    return jax.lax.fori_loop(0, block_end_E[-1], one_block, jnp.zeros_like(x_MD))


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
    """``experts_blocked`` over quantized stacks: each block dequantizes only its own expert.

    ``gate`` / ``up`` / ``down`` are (values, scales, container) with values/scales the stacked
    ``[E, out, ...]`` arrays in checkpoint orientation; ``quantized_matmul`` dequantizes the chosen
    expert one tile of input columns at a time, so the largest weight temporary is one tile, never
    an expert stack. Whatever kernel name is configured, quantized experts run this loop:
    ``ragged_dot`` would need the whole dequantized stack as one operand.
    """
    def matmul(x_bI, w, e):
        values, scales, stack = w
        return quantized_matmul(x_bI, take_expert(values, e), scales[e], stack)

    def ffn(x_bD, e):
        return matmul(jax.nn.silu(matmul(x_bD, gate, e)) * matmul(x_bD, up, e), down, e)

    return _blocked_loop(x_MD, idx_MK, weights_MK, first_expert, gate[0].shape[0], ffn)


def experts_padded_blocks(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    E = w_gate_EDF.shape[0]
    M, K = idx_MK.shape
    A = M * K
    b = min(PADDED_BLOCK_ROWS, pow2_at_least(A))
    n_blocks = -(-A // b) + E  # the most any routing can need: every expert's last block partial
    token_A, weight_A, counts_E = sort_assignments(idx_MK, weights_MK, first_expert, E)
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
    w_JB = jnp.where(valid_JB, weight_A[a_JB], 0.0)  # padding rows add 0

    x_JBD = x_MD[tok_JB]
    g_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_gate_EDF[e_J])
    u_JBF = jnp.einsum("jbd,jdf->jbf", x_JBD, w_up_EDF[e_J])
    y_JBD = jnp.einsum("jbf,jfd->jbd", jax.nn.silu(g_JBF) * u_JBF, w_down_EFD[e_J])
    y_JBD = y_JBD * w_JB[..., None].astype(y_JBD.dtype)
    return jnp.zeros_like(x_MD).at[tok_JB.reshape(-1)].add(y_JBD.reshape(-1, x_MD.shape[-1]))


# name -> kernel; ``moe_kernel=`` picks one. New kernels (e.g. for quantized experts) add an entry.
EXPERT_KERNELS: dict[str, ExpertKernel] = {
    "blocked": experts_blocked,
    "ragged": experts_ragged,
    "padded_blocks": experts_padded_blocks,
}


def default_kernel(backend: str | None = None) -> str:
    """``ragged`` (grouped matmul) on TPU and GPU; ``blocked`` on CPU, where ragged_dot is dense.

    On GPU ``blocked`` would be launch-bound: one loop trip per expert block, each a few small
    kernels plus a trip-count predicate read back by the host.
    """
    backend = backend or jax.default_backend()
    return "blocked" if backend == "cpu" else "ragged"


def get_kernel(name: str) -> ExpertKernel:
    if name not in EXPERT_KERNELS:
        raise ConfigError(f"unknown moe kernel '{name}'; choose one of {', '.join(EXPERT_KERNELS)}")
    return EXPERT_KERNELS[name]


class MoE(nnx.Module):
    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs | None, mesh=None, kernel: str | None = None,
                 record_routes: bool = False, quant: QuantLayout | None = None):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.mesh = mesh
        self.kernel = kernel or default_kernel()
        get_kernel(self.kernel)  # fail at construction, not at the first trace
        self.record_routes = record_routes
        # The router stays float32 whatever the model dtype, as in the reference checkpoints.
        self.gate = param(rngs, (D, E), ("embed", None), jnp.float32)
        self.e_score_correction_bias = param(None, (E,), (None,), jnp.float32, init="zeros")
        self.quantized = quant is not None and quant.experts is not None
        if self.quantized:
            # Checkpoint orientation [E, out, in]: gate/up are [E, F, D], down is [E, D, F].
            self.w_gate = expert_stack(E, F, D, ("expert", "moe_mlp", "embed"), quant, rngs)
            self.w_up = expert_stack(E, F, D, ("expert", "moe_mlp", "embed"), quant, rngs)
            self.w_down = expert_stack(E, D, F, ("expert", "embed", "moe_mlp"), quant, rngs)
        else:
            self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "moe_mlp"), dtype)
            self.w_up = param(rngs, (E, D, F), ("expert", "embed", "moe_mlp"), dtype)
            self.w_down = param(rngs, (E, F, D), ("expert", "moe_mlp", "embed"), dtype)
        self.shared_experts = (
            SwiGLU(D, F * cfg.n_shared_experts, dtype, rngs, quant=quant) if cfg.n_shared_experts > 0 else None
        )

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        idx_MK, weights_MK = route(x_MD, self.gate[...], self.e_score_correction_bias[...], self.cfg)
        if self.record_routes:
            self.sow(nnx.Intermediate, "expert_ids", idx_MK)
        if self.quantized:
            kernel, ws = self._quantized_kernel()
        else:
            kernel = get_kernel(self.kernel)
            ws = (self.w_gate[...], self.w_up[...], self.w_down[...])
        mesh = self.mesh
        if mesh is None or (mesh.shape[mesh_axis("expert")] == 1 and mesh.shape[mesh_axis("moe_mlp")] == 1):
            y_MD = kernel(x_MD, idx_MK, weights_MK, *ws, 0)
        else:
            y_MD = self._sharded(kernel, x_MD, idx_MK, weights_MK, ws)
        y_BTD = y_MD.reshape(B, T, D)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)
        return y_BTD

    def _quantized_kernel(self):
        """The dequantizing kernel and its weights: per stack (values, scales) arrays, with the
        containers (their static group / block sizes) bound by closure so shard_map sees only arrays."""
        stacks = (self.w_gate, self.w_up, self.w_down)
        ws = tuple(st.arrays() for st in stacks)

        def kernel(x_MD, idx_MK, weights_MK, wg, wu, wd, first):
            g, u, d = ((*w, st) for w, st in zip((wg, wu, wd), stacks))
            return experts_blocked_quantized(x_MD, idx_MK, weights_MK, g, u, d, first)

        return kernel, ws

    def _tensor_split(self, F: int, n_ten: int) -> bool:
        """Whether expert width F can be split over ``tensor``: quantized stacks also need every
        shard to hold whole INT4 groups / FP8 blocks, so a device dequantizes only its own slice."""
        if F % n_ten:
            return False
        if not self.quantized:
            return True
        st = self.w_down
        unit = st.group if isinstance(st, Int4Stack) else st.block[1]
        return (F // n_ten) % unit == 0 and (isinstance(st, Int4Stack) or (F // n_ten) % st.block[0] == 0)

    def _sharded(self, kernel, x_MD, idx_MK, weights_MK, ws):
        mesh = self.mesh
        exp_ax, ten_ax, row_ax = mesh_axis("expert"), mesh_axis("moe_mlp"), mesh_axis("batch")
        E = self.cfg.n_routed_experts
        n_exp, n_ten = mesh.shape[exp_ax], mesh.shape[ten_ax]
        if E % n_exp:
            raise ConfigError(f"{E} routed experts cannot be split over mesh axis '{exp_ax}' of size {n_exp} "
                              f"(mesh {dict(mesh.shape)}); pick an expert-axis size that divides {E}")
        F = self.cfg.moe_intermediate_size
        # Uneven splits replicate, as sharding.py does for parameters (small models on big meshes).
        ten = ten_ax if self._tensor_split(F, n_ten) else None
        rows = row_ax if x_MD.shape[0] % mesh.shape[row_ax] == 0 else None
        local_experts = E // n_exp

        def local(x_MD, idx_MK, w_MK, wg, wu, wd):
            first = jax.lax.axis_index(exp_ax) * local_experts
            y = kernel(x_MD, idx_MK, w_MK, wg, wu, wd, first)
            return jax.lax.psum(y, (exp_ax, ten_ax) if ten else exp_ax)

        if self.quantized:
            # Checkpoint orientation: F is the out axis of gate/up and the in axis of down.
            w_specs = ((P(exp_ax, ten, None),) * 2, (P(exp_ax, ten, None),) * 2, (P(exp_ax, None, ten),) * 2)
        else:
            w_specs = (P(exp_ax, None, ten), P(exp_ax, None, ten), P(exp_ax, ten, None))
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(rows, None), P(rows, None), P(rows, None), *w_specs),
            out_specs=P(rows, None),
            check_vma=False,
        )
        return fn(x_MD, idx_MK, weights_MK, *ws)


def set_route_recording(model: nnx.Module, on: bool = True) -> None:
    """Makes every MoE layer of ``model`` sow (or stop sowing) its chosen expert ids per call."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoE):
            module.record_routes = on


def capture_routes(fn: Callable) -> Callable:
    """Wraps ``fn(model, *args)`` to return ``(result, expert ids)`` of that call.

    The expert ids are one [M, K] int32 array per MoE call, by ascending layer index (the order of
    ``nnx.to_flat_state``). Recording is switched on only for the call, so a model used elsewhere
    (serving) never sows.
    """
    captured = nnx.capture(fn, nnx.Intermediate)

    def wrapped(model, *args, **kwargs):
        set_route_recording(model, True)
        try:
            result, sown = captured(model, *args, **kwargs)
        finally:
            set_route_recording(model, False)
        routes = [ids for path, var in nnx.to_flat_state(sown) if path[-1] == "expert_ids"
                  for ids in var.get_value()]
        return result, routes

    return wrapped
