"""What the serving plan and the training-step plan share: the settings, the per-array byte
accounting, abstract (sharded) arguments, and compiling a program for its numbers.

``serve.py`` plans the serving programs, ``train.py`` the draft training step; both build on this
module and neither imports the other's internals.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.errors import ConfigError
from eagle3_jax.sharding import sharding_for, state_shardings
from eagle3_jax.speculative import generate as gen
from tools.tpu import CompiledStats, compile_stats

# One compiled program's bytes per device, cost and times (the same record for CPU and TPU compiles).
ProgramMemory = CompiledStats

@dataclass(frozen=True)
class PlanSettings:
    model: str
    mesh: str
    batch: int = 32
    max_len: int = 8192
    num_draft_tokens: int = 4
    prompt_len: int = 1024
    dtype: str = "bfloat16"
    compile_dtype: str = "float32"
    expert_bits: tuple[int, ...] = (16,)
    draft: str | None = None            # a draft config.json; default: a matching preset, else derived
    programs: tuple[str, ...] = ("decode", "prefill")
    moe_kernel: str | None = None      # None: the product's default for the platform compiled for
    train: bool = False
    # the draft training step (eagle3_jax.train.step.train_step), with TrainConfig's defaults
    train_batch: int = 8
    train_len: int = 2048
    train_accum: int = 1
    ttt_steps: int = 7
    train_dtype: str = "float32"        # the draft's weights and AdamW moments while training
    hidden_source: str = "online"       # online: the frozen target runs in the step; offline: states read from disk
    weights: str = "native"             # native: quantized weights as the checkpoint stores them (load_target's default)
    prefill_chunk: int | None = None    # prompt positions per target call in prefill; None: the whole block,
                                        # or with ``hbm`` the largest power-of-two split that fits
    hbm: int | None = None
    admit_rows: int | None = None       # rows one prefill call admits (the Engine's max_admit_rows); None: batch
    platform: str = "cpu"               # cpu: fake host devices; tpu: the TPU compiler for ``topology``
    topology: str | None = None         # a TPU slice, e.g. v5p:2x2x4 (platform tpu)
    layers: int | None = None           # plan the target cut to its first N layers (full width); None: all
    tau: float | None = None            # acceptance length for the predicted speedup (TPU estimates)
    cost_k0: bool = True                # TPU: also compile decode at K = 0, the step a speedup is priced against


@dataclass(frozen=True)
class Leaf:
    """One array: its global shape and the shard each device holds."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    spec: tuple
    shard_shape: tuple[int, ...]
    routed_expert: bool = False

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def device_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def shards(self) -> int:
        return math.prod(self.shape) // max(1, math.prod(self.shard_shape))

    @property
    def numel_device(self) -> int:
        return math.prod(self.shard_shape)



def parse_bytes(text: str) -> int:
    """'141GB' (10^9), '141GiB' (2^30), '80G', '1.5TB', or a plain number of bytes."""
    try:
        return int(float(text))
    except ValueError:
        pass
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"--hbm '{text}': expected a size such as 141GB, 96GiB or 80e9")
    value, unit, binary, _ = m.groups()
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(float(value) * (1024 if binary else 1000) ** power)



def itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key is two uint32 words
    return jnp.dtype(dtype).itemsize


def _abstract_model(make, mesh):
    """(graphdef, state of ShapeDtypeStructs carrying their shardings, logical axes by path)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(state, mesh)
    abstract = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), state, shardings)
    axes = {".".join(map(str, path)): getattr(var, "axes", None) for path, var in nnx.to_flat_state(state)}
    return graphdef, abstract, axes


def _leaves(abstract_state, axes_by_path, prefix="") -> list[Leaf]:
    return [_leaf(prefix + ".".join(map(str, path)), var.value,
                  routed_expert="expert" in (axes_by_path.get(".".join(map(str, path))) or ()))
            for path, var in nnx.to_flat_state(abstract_state)]


def _leaf(path, sds, routed_expert=False) -> Leaf:
    is_key = jax.dtypes.issubdtype(sds.dtype, jax.dtypes.prng_key)
    return Leaf(path=path, shape=tuple(sds.shape), dtype="key" if is_key else str(jnp.dtype(sds.dtype)),
                itemsize=itemsize(sds.dtype), spec=tuple(sds.sharding.spec),
                shard_shape=tuple(sds.sharding.shard_shape(sds.shape)), routed_expert=routed_expert)


def _sds(mesh, shape, dtype, axes=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(mesh, axes, shape))


def abstract_state(mesh, shapes: Any) -> Any:
    """The loop state's ShapeDtypeStructs with the shardings ``generate.state_axes`` gives them."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: _sds(mesh, s.shape, s.dtype, gen.state_axes(path, s)), shapes)


def sampling_args(mesh) -> gen.Sampling:
    return gen.Sampling(_sds(mesh, (), jnp.float32), _sds(mesh, (), jnp.int32), _sds(mesh, (), jnp.float32),
                        _sds(mesh, (1,), jnp.int32, (None,)), _sds(mesh, (), jnp.bool_), _sds(mesh, (), jnp.int32))



def compile_program(name, fn, args, kwargs, hbm: int | None = None) -> ProgramMemory:
    """Lowers and compiles ``fn`` for the devices its arguments' shardings name (fake CPU devices or a
    TPU topology's chips) and returns that compiler's memory and cost per device."""
    return compile_stats(fn, args, kwargs, name=name, hbm=hbm)
