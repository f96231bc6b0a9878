"""The device mesh and the one table that maps logical axes onto it.

Parameters carry logical axis names (``axes=`` metadata) and activations are constrained by logical
names; ``LOGICAL_AXIS_RULES`` alone decides which mesh axis shards which logical axis.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.config import MESH_AXES, MeshConfig
from eagle3_jax.errors import ConfigError

log = logging.getLogger("eagle3_jax")

# The mesh axes by role; other code names them through these or ``mesh_axis(logical)``.
DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS = MESH_AXES

# logical axis -> mesh axis, or a tuple of mesh axes that split it together (None = replicated)
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": DATA_AXIS,     # rows of a generation batch / training batch
    # Rows of attention and of the KV caches (data-parallel attention): split over the expert axis
    # too, so a chip holds its own rows' caches. The MoE's rows stay "batch" (moe.py).
    "attn_batch": (DATA_AXIS, EXPERT_AXIS),
    "seq": None,            # token positions
    "cache_seq": None,      # KV-cache slots
    "embed": None,          # model width (hidden size)
    "vocab": TENSOR_AXIS,   # embedding rows and lm_head columns
    "heads": TENSOR_AXIS,   # attention heads
    "head_dim": None,
    "q_lora": None,         # MLA query latent
    "kv_lora": None,        # MLA key/value latent (the cached one)
    "mlp": TENSOR_AXIS,     # dense MLP width (also shared experts)
    "expert": EXPERT_AXIS,  # routed experts
    "moe_mlp": TENSOR_AXIS, # routed expert width
    "aux": None,            # concatenated aux hidden states
    "draft_vocab": TENSOR_AXIS,
    # training only: the token positions of the draft's TTT activations and loss (sequence
    # parallelism: one long row split over the devices that hold different experts of the frozen target)
    "draft_seq": EXPERT_AXIS,
}

# Training only: each trainable draft parameter (with its gradient and AdamW moments) is split further
# over these mesh axes where the table leaves them unused for it (ZeRO-3 / FSDP), not held whole on
# every device.
TRAIN_SPLIT_AXES = (DATA_AXIS, EXPERT_AXIS)


def mesh_axis(logical: str) -> str | tuple[str, ...] | None:
    """The mesh axis (or axes) the table maps a logical axis onto (None: replicated)."""
    if logical not in LOGICAL_AXIS_RULES:
        raise ConfigError(f"logical axis '{logical}' has no rule; add it to LOGICAL_AXIS_RULES in sharding.py")
    return LOGICAL_AXIS_RULES[logical]


def axis_size(mesh: "jax.sharding.Mesh | None", logical: str) -> int:
    """How many ways the mesh splits a logical axis (1 without a mesh or when it is replicated)."""
    if mesh is None:
        return 1
    return _ways(dict(mesh.shape), mesh_axis(logical))


def _names(m: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if m is None else m if isinstance(m, tuple) else (m,)


def _ways(mesh_shape: dict, m: str | tuple[str, ...] | None) -> int:
    return int(np.prod([mesh_shape[a] for a in _names(m)], dtype=np.int64))


def make_mesh(spec: "str | MeshConfig | None" = None, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """Builds a (data, expert, tensor) mesh from ``data=1,expert=8,tensor=1``; with no spec, all
    devices go on the ``expert`` axis."""
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
    """PartitionSpec for logical axis names; a ConfigError when two axes of one array map onto the
    same mesh axis (replicating one quietly would hide the mistake behind a memory blow-up)."""
    if axes is None:
        return P()
    mesh_axes: list[str | None] = []
    owner: dict[str, str] = {}
    for a in axes:
        m = None if a is None else mesh_axis(a)
        for name in _names(m):
            if name in owner:
                raise ConfigError(
                    f"logical axes '{owner[name]}' and '{a}' of one array (axes {tuple(axes)}) both map to mesh "
                    f"axis '{name}'; a mesh axis can split only one dimension. Map one of them to another mesh "
                    "axis (or None) in LOGICAL_AXIS_RULES, or annotate the array differently")
            owner[name] = a
        mesh_axes.append(m)
    return P(*mesh_axes)


_fallbacks_logged: set = set()


def _fits(mesh_shape: dict, spec: P, shape: Sequence[int], axes: Sequence[str | None] | None) -> P:
    """Replicates dimensions that their mesh axis does not divide (small models on big meshes),
    logging each case once so a full-size run that pays for it is visible. A dimension mapped to
    several mesh axes keeps the longest leading run of them whose product divides it."""
    axes = tuple(axes or ())
    out = []
    for i, (dim, m) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        names = _names(m)
        keep = len(names)
        while keep and dim % _ways(mesh_shape, names[:keep]):
            keep -= 1
        if keep < len(names):
            logical = axes[i] if i < len(axes) else None
            key = (logical, dim, m, tuple(mesh_shape.items()))
            if key not in _fallbacks_logged:
                _fallbacks_logged.add(key)
                log.warning("logical axis '%s' of size %d is not divisible by %s of size %d (mesh %s); %s",
                            logical, dim, f"mesh axis '{m}'" if len(names) == 1 else f"mesh axes {names}",
                            _ways(mesh_shape, names), dict(mesh_shape),
                            f"splitting it over {names[:keep]} only" if keep else "replicating that dimension")
            m = None if keep == 0 else names[0] if keep == 1 else names[:keep]
        out.append(m)
    return P(*out)


def sharding_for(mesh: jax.sharding.Mesh, axes: Sequence[str | None] | None, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, _fits(dict(mesh.shape), logical_to_spec(axes), shape, axes))


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh, rule=sharding_for) -> nnx.State:
    """The NamedSharding of every Variable in an nnx.State, from its ``axes`` metadata by ``rule``
    (``sharding_for``, or ``train_param_sharding`` for the parameters a training step updates)."""

    def one(v):
        if isinstance(v, nnx.Variable):
            return v.replace(rule(mesh, getattr(v, "axes", None), v.value.shape))
        return v

    return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def train_param_sharding(mesh: jax.sharding.Mesh, axes: Sequence[str | None] | None,
                         shape: Sequence[int]) -> NamedSharding:
    """``sharding_for`` plus ``TRAIN_SPLIT_AXES``: the largest dimension the table leaves replicated
    is split over those of the axes the parameter does not use (all of them together where they
    divide it, else the largest single one that does); a parameter nothing divides stays as it was."""
    mesh_shape = dict(mesh.shape)
    spec = list(_fits(mesh_shape, logical_to_spec(axes), shape, axes))
    spec += [None] * (len(shape) - len(spec))
    used = {m for s in spec if s is not None for m in (s if isinstance(s, tuple) else (s,))}
    free = [m for m in TRAIN_SPLIT_AXES if m not in used and mesh_shape[m] > 1]
    for group in ([tuple(free)] if len(free) > 1 else []) + [(m,) for m in sorted(free, key=lambda m: -mesh_shape[m])]:
        n = int(np.prod([mesh_shape[m] for m in group]))
        dims = [i for i, d in enumerate(shape) if spec[i] is None and d % n == 0]
        if dims:
            i = max(dims, key=lambda i: shape[i])
            spec[i] = group if len(group) > 1 else group[0]
            break
    return NamedSharding(mesh, P(*spec))


def shard_state(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    return jax.device_put(state, state_shardings(state, mesh))


def _traced_mesh():
    """The mesh being traced under (``jax.set_mesh``), None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a mesh context."""
    mesh = _traced_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, _fits(dict(mesh.shape), logical_to_spec(axes), x.shape, axes))


def constrain_leading(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``constrain`` of the leading ``len(axes)`` dimensions; XLA chooses the others."""
    mesh = _traced_mesh()
    if mesh is None:
        return x
    lead = tuple(_fits(dict(mesh.shape), logical_to_spec(axes), x.shape[:len(axes)], axes))
    return jax.lax.with_sharding_constraint(x, P(*lead, *(P.UNCONSTRAINED,) * (x.ndim - len(axes))))


def current_axis_size(logical: str) -> int:
    """``axis_size`` on the mesh being traced under; 1 outside one."""
    return axis_size(_traced_mesh(), logical)


def resolve_mesh(mesh):
    """None, a Mesh, or a spec string such as "data=1,expert=8,tensor=1" -> None or a Mesh."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        return mesh
    return make_mesh(mesh)


def mesh_context(mesh):
    """``with mesh_context(mesh):`` activates the mesh for jitted calls; a no-op without one."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

