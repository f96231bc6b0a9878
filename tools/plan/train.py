"""The draft training step's memory plan: the Trainer's compiled step on abstract, sharded arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.config import resolve_dtype
from eagle3_jax import drafts
from eagle3_jax.config import TargetConfig
from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.sharding import DATA_AXIS, axis_size, sharding_for, state_shardings, train_param_sharding
from tools.plan.common import PlanSettings, ProgramMemory, compile_program, itemsize


@dataclass
class TrainMemory:
    """Bytes per device of one draft training step (planned dtypes), and the compiled step's memory."""

    frozen_target: int      # online: the target's parameters (the step runs it); offline: 0
    head: int               # offline: the target's embedding and lm_head, passed separately
    draft_params: int
    optimizer: int
    batch: int
    program: ProgramMemory

    def totals(self, temp_ratio: float) -> tuple[int, int]:
        if self.program.temp is None or self.program.platform == "tpu":
            # The TPU compiler's own peak: exact in the planned dtypes, tile padding counted; when it
            # refused the step for HBM, its figure of what the step needs is all there is.
            return self.program.peak, self.program.peak
        resident = self.frozen_target + self.head + self.draft_params + self.optimizer + self.batch
        extra = max(0, self.program.output - self.program.alias)
        return resident + extra + self.program.temp, resident + extra + int(self.program.temp * temp_ratio)


def _pure_abstract(state, mesh, rule=sharding_for):
    """An nnx.State of abstract values -> a plain dict of ShapeDtypeStructs with the table's shardings
    (``rule``: the trainable parameters take the Trainer's, ``train_param_sharding``)."""
    shardings = nnx.to_pure_dict(state_shardings(state, mesh, rule))
    return jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                        nnx.to_pure_dict(state), shardings)


def _device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * itemsize(x.dtype) for x in jax.tree.leaves(tree))


def plan_train(s: PlanSettings, cfg: TargetConfig, dcfg: DraftConfig, aux_ids, mesh, target_models, planned,
               compiled, log) -> TrainMemory:
    """Lowers and compiles the draft kind's training step (its trainer's ``jitted_step``) on abstract
    arguments laid out as the Trainer lays them out (rows on the data axis, the draft split for training, the head replicated offline)."""

    from eagle3_jax.train.config import TrainConfig
    from eagle3_jax.train.draft_kind import trainer_class
    from eagle3_jax.train.step import OptimizerSpec, map_moments

    kind = drafts.of_config(dcfg)
    trainer = trainer_class(kind)   # the kind's step, its arguments and its host draws, from settings alone
    if s.hidden_source not in ("online", "offline"):
        raise ConfigError(f"hidden_source must be online or offline, found {s.hidden_source!r}")
    data = axis_size(mesh, "batch")
    if s.train_batch % data:
        raise ConfigError(f"train batch {s.train_batch} does not split over data={data}; use a multiple of it")
    dtype = jnp.dtype(resolve_dtype(s.train_dtype))
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: kind.module(dcfg, len(aux_ids), dtype, None)),
                                       nnx.Param, ...)
    params, rest = _pure_abstract(params, mesh, train_param_sharding), _pure_abstract(rest, mesh)
    defaults = TrainConfig(target=s.model, draft_kind=kind.name, max_len=s.train_len, ttt_steps=s.ttt_steps)
    opt_spec = OptimizerSpec.from_config(defaults)
    opt = opt_spec.build()
    # shapes only: shardings naming compile-only (TPU topology) devices cannot be placed on, even abstractly
    shapes = jax.eval_shape(opt.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    replicated = NamedSharding(mesh, P())
    # The moments mirror the params and take their shardings; the rest (step counts) is replicated.
    # On abstract values: running opt.init under a TPU topology's mesh would place a scalar on
    # devices that can only be compiled for.
    opt_state = map_moments(
        shapes, params,
        lambda x: jax.tree.map(lambda m, p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=p.sharding), x, params),
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated))

    tgraph, tstate = target_models
    V, D, T, A, R = cfg.vocab_size, cfg.hidden_size, s.train_len, s.train_accum, s.train_batch
    rows = NamedSharding(mesh, P(None, DATA_AXIS))
    batch = {"ids": jax.ShapeDtypeStruct((A, R, T), jnp.int32, sharding=rows),
             "loss_mask": jax.ShapeDtypeStruct((A, R, T), jnp.bool_, sharding=rows),
             "length": jax.ShapeDtypeStruct((A, R), jnp.int32, sharding=rows)}
    tdtype = tstate["embed_tokens"].value.dtype
    if s.hidden_source == "online":
        embed = tstate["embed_tokens"].value
        if "lm_head" not in tstate:
            raise ConfigError("planning the training step of a target with a tied embedding is not supported")
        head = tstate["lm_head"].value
        frozen, head_bytes = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * planned.itemsize if x.dtype == compiled else
            _device_bytes(x) for x in jax.tree.leaves(tstate)), 0
    else:
        embed = jax.ShapeDtypeStruct((V, D), tdtype, sharding=replicated)
        head = jax.ShapeDtypeStruct((D, V), tdtype, sharding=replicated)
        X = len(aux_ids) * D
        batch["aux"] = jax.ShapeDtypeStruct((A, R, T, X), tdtype, sharding=rows)
        batch["hidden"] = jax.ShapeDtypeStruct((A, R, T, D), tdtype, sharding=rows)
        tgraph, tstate = None, None
        frozen, head_bytes = 0, 2 * V * D * planned.itemsize
    draws = trainer.draws(defaults, np.ones((A, R, T), bool))   # shapes and dtypes of what the host adds
    batch.update({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in draws.items()})
    batch_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * (planned.itemsize if x.dtype == compiled
                      else itemsize(x.dtype)) for x in batch.values())
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    # The Trainer's own jitted step: new params and moments pinned to the shardings they came in with.
    leaves, tree = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, (params, opt_state)))
    step = trainer.jitted_step(defaults, graphdef, tgraph, opt_spec, tuple(aux_ids), tuple(leaves), tree)
    heads = {"embed_VD": embed, "lm_head_DV": head}
    log(f"compiling train ({s.hidden_source} {kind.title} draft training step: {s.train_accum} x {s.train_batch} "
        f"rows x {s.train_len} tokens{f', TTT {s.ttt_steps} steps' if not draws else ''}) ...")
    mem = compile_program("train", step, (params, opt_state, rest, *(heads[k] for k in trainer.STEP_HEAD), tstate,
                                          batch, lr), {})
    log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
    return TrainMemory(frozen_target=frozen, head=head_bytes, draft_params=_device_bytes(params) + _device_bytes(rest),
                       optimizer=_device_bytes(opt_state), batch=batch_bytes, program=mem)
