"""The device mesh and the one table that maps logical axes onto it.

Every parameter carries logical axis names (``axes=`` metadata on its ``nnx.Param``) and activations
are constrained with logical names at block boundaries. ``LOGICAL_AXIS_RULES`` below is the only
place that decides which mesh axis shards which logical axis: changing the parallelism means
editing this table, nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.config import MESH_AXES, MeshConfig
from eagle3_jax.errors import ConfigError

# logical axis -> mesh axis (None = replicated)
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "batch": "data",        # rows of a generation batch / training batch
    "seq": None,            # token positions
    "cache_seq": None,      # KV-cache slots
    "embed": None,          # model width (hidden size)
    "vocab": "tensor",      # embedding rows and lm_head columns
    "heads": "tensor",      # attention heads
    "head_dim": None,
    "q_lora": None,         # MLA query latent
    "kv_lora": None,        # MLA key/value latent (the cached one)
    "mlp": "tensor",        # dense MLP width (also shared experts)
    "expert": "expert",     # routed experts
    "moe_mlp": "tensor",    # routed expert width
    "aux": None,            # concatenated aux hidden states
    "draft_vocab": "tensor",
}


def make_mesh(spec: "str | MeshConfig | None" = None, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """Builds a (data, expert, tensor) mesh from ``data=1,expert=8,tensor=1``.

    With no spec, all devices go on the ``expert`` axis (the layout DeepSeek-class serving wants).
    """
    devices = list(jax.devices() if devices is None else devices)
    if spec is None:
        cfg = MeshConfig(expert=len(devices))
    else:
        cfg = MeshConfig.parse(spec)
    if cfg.size > len(devices):
        raise ConfigError(
            f"mesh {cfg.shape} (data, expert, tensor) needs {cfg.size} devices but {len(devices)} are visible; "
            "pick sizes whose product is at most the device count"
        )
    dev_array = np.asarray(devices[: cfg.size]).reshape(cfg.shape)
    return jax.sharding.Mesh(dev_array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None] | None) -> P:
    if axes is None:
        return P()
    mesh_axes = []
    used = set()
    for a in axes:
        if a is None:
            mesh_axes.append(None)
            continue
        if a not in LOGICAL_AXIS_RULES:
            raise ConfigError(f"logical axis '{a}' has no rule; add it to LOGICAL_AXIS_RULES in sharding.py")
        m = LOGICAL_AXIS_RULES[a]
        # A mesh axis may shard only one dimension of an array.
        if m is not None and m in used:
            m = None
        if m is not None:
            used.add(m)
        mesh_axes.append(m)
    return P(*mesh_axes)


def named_sharding(mesh: jax.sharding.Mesh, axes: Sequence[str | None] | None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes))


def _fits(mesh: jax.sharding.Mesh, spec: P, shape: Sequence[int]) -> P:
    """Drops mesh axes that do not divide a dimension (small test models on big meshes)."""
    out = []
    for dim, m in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        out.append(m if m is None or dim % mesh.shape[m] == 0 else None)
    return P(*out)


def sharding_for(mesh: jax.sharding.Mesh, axes: Sequence[str | None] | None, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, _fits(mesh, logical_to_spec(axes), shape))


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    """The NamedSharding of every Variable in an nnx.State, from its ``axes`` metadata."""

    def one(v):
        if isinstance(v, nnx.Variable):
            return v.replace(sharding_for(mesh, getattr(v, "axes", None), v.value.shape))
        return v

    return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    shardings = state_shardings(state, mesh)
    return jax.device_put(state, shardings)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(axes)
    spec = P(*[m if m is None or x.shape[i] % mesh.shape[m] == 0 else None for i, m in enumerate(spec)])
    return jax.lax.with_sharding_constraint(x, spec)


def resolve_mesh(mesh):
    """None, a Mesh, or a spec string such as "data=1,expert=8,tensor=1" -> None or a Mesh."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        return mesh
    return make_mesh(mesh)


def mesh_context(mesh):
    """``with mesh_context(mesh):`` activates the mesh for jitted calls; a no-op without one."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def data_parallel_size(mesh) -> int:
    """How many ways the batch is split (rows are padded to a multiple of it)."""
    axis = LOGICAL_AXIS_RULES["batch"]
    return mesh.shape[axis] if mesh is not None and axis is not None else 1
