"""Mixture of experts: the DeepSeek-V3 router and routed-expert compute whose cost follows top-k.

Routing (DeepSeek-V3 "noaux_tc"): float32 scores (sigmoid or softmax); the correction bias is added
for *choosing* experts only; experts are chosen within the ``topk_group`` best groups (a group is
scored by the sum of its two best biased scores); the weights are the unbiased scores of the chosen
experts, normalized when ``norm_topk_prob``, times ``routed_scaling_factor``.

Expert compute: the kernel ``kernels/experts.pick`` chooses. With a mesh, each device runs only its
local experts (and its slice of their width) inside ``jax.shard_map``; a psum combines the outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.kernels import experts
from eagle3_jax.models.layers import SwiGLU, param
from eagle3_jax.models.quantized import Int4Stack, QuantLayout, expert_stack
from eagle3_jax.sharding import mesh_axis


def route(x_MD: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array, cfg: TargetConfig):
    """Returns (expert ids [M, K] int32, weights [M, K] float32)."""
    # HIGHEST: float32 logits as the reference computes them (the default lets the TPU compiler
    # round the router weight to bf16).
    logits_ME = jnp.einsum("md,de->me", x_MD.astype(jnp.float32), w_router_DE.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
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


class MoE(nnx.Module):
    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs | None, mesh=None, kernel: str | None = None,
                 record_routes: bool = False, quant: QuantLayout | None = None, platform: str | None = None):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.mesh = mesh
        self.quantized = quant is not None and quant.experts is not None
        # Where this layer's programs will run: a TPU program planned on a CPU host names "tpu".
        self.platform = platform or (mesh.devices.flat[0].platform if mesh is not None else jax.default_backend())
        self.record_routes = record_routes   # sow the chosen expert ids (tools/demo/routes.py)
        # The router stays float32 whatever the model dtype, as in the reference checkpoints.
        self.gate = param(rngs, (D, E), ("embed", None), jnp.float32)
        self.e_score_correction_bias = param(None, (E,), (None,), jnp.float32, init="zeros")
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
        # Chosen here (an unknown name fails now, not at the first trace), for the shards each
        # device holds: with the width split over ``tensor``, F / n of it.
        shards = ()
        if self.quantized:
            n_ten = 1 if mesh is None else mesh.shape[mesh_axis("moe_mlp")]
            F = F // n_ten if self._tensor_split(F, n_ten) else F
            shards = ((self.w_gate, F, D), (self.w_down, D, F))
        self.kernel = experts.pick(kernel, self.platform, self.quantized, shards)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        idx_MK, weights_MK = route(x_MD, self.gate[...], self.e_score_correction_bias[...], self.cfg)
        if self.record_routes:
            self.sow(nnx.Intermediate, "expert_ids", idx_MK)
        kernel = experts.kernel(self.kernel, self.platform, self.quantized)
        if self.quantized:
            kernel, ws = self._with_containers(kernel)
        else:
            ws = (self.w_gate[...], self.w_up[...], self.w_down[...])
        mesh = self.mesh
        if mesh is None or (mesh.shape[mesh_axis("expert")] == 1 and mesh.shape[mesh_axis("moe_mlp")] == 1):
            y_MD = kernel(x_MD, idx_MK, weights_MK, *ws, 0)
        else:
            y_MD = self._sharded(kernel, x_MD, idx_MK, weights_MK, ws, B)
        y_BTD = y_MD.reshape(B, T, D)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)
        return y_BTD

    def _with_containers(self, quant_kernel):
        """The quantized kernel over per-stack (values, scales) arrays, the containers (their static
        group / block sizes) bound by closure so shard_map sees only arrays."""
        stacks = (self.w_gate, self.w_up, self.w_down)

        def kernel(x_MD, idx_MK, weights_MK, wg, wu, wd, first):
            g, u, d = ((*w, st) for w, st in zip((wg, wu, wd), stacks))
            return quant_kernel(x_MD, idx_MK, weights_MK, g, u, d, first)

        return kernel, tuple(st.arrays() for st in stacks)

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

    def _sharded(self, kernel, x_MD, idx_MK, weights_MK, ws, B: int):
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
        # Every expert shard needs every token of its data shard, so the rows come in split over data
        # only. Where attention splits them over data x expert, the partial sums go back
        # reduce-scattered over the rows: half the bytes of an all-reduce that attention would slice.
        scatter = (rows is not None and mesh_axis("attn_batch") == (row_ax, exp_ax)
                   and B % (mesh.shape[row_ax] * n_exp) == 0)
        local_experts = E // n_exp

        def local(x_MD, idx_MK, w_MK, wg, wu, wd):
            first = jax.lax.axis_index(exp_ax) * local_experts
            y = kernel(x_MD, idx_MK, w_MK, wg, wu, wd, first)
            if not scatter:
                return jax.lax.psum(y, (exp_ax, ten_ax) if ten else exp_ax)
            y = jax.lax.psum_scatter(y, exp_ax, scatter_dimension=0, tiled=True)
            return jax.lax.psum(y, ten_ax) if ten else y

        if self.quantized:
            # Checkpoint orientation: F is the out axis of gate/up and the in axis of down.
            w_specs = ((P(exp_ax, ten, None),) * 2, (P(exp_ax, ten, None),) * 2, (P(exp_ax, None, ten),) * 2)
        else:
            w_specs = (P(exp_ax, None, ten), P(exp_ax, None, ten), P(exp_ax, ten, None))
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(rows, None), P(rows, None), P(rows, None), *w_specs),
            out_specs=P((row_ax, exp_ax) if scatter else rows, None),
            check_vma=False,
        )
        return fn(x_MD, idx_MK, weights_MK, *ws)
