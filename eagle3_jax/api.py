"""The public Python surface: load_target (and, as they land, load_draft and Generator)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint.hf_loader import load_state
from eagle3_jax.checkpoint.safetensors import CheckpointReader
from eagle3_jax.checkpoint.target_map import is_ignored_key, target_rules
from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.cache import MLACache
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import make_mesh, shard_state

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype '{dtype}' is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve_mesh(mesh):
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        return mesh
    return make_mesh(mesh)


def mesh_context(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


@dataclass
class ForwardOutput:
    logits: jax.Array        # [B, T, V] float32
    aux_hidden: jax.Array | None  # [B, T, n_aux * D]


def _target_call(graphdef, state, ids_BT, positions_BT, cache, aux_ids):
    model = nnx.merge(graphdef, state)
    out = model(ids_BT, positions_BT, cache, aux_ids)
    return model.logits(out.hidden_BTD), out.aux_BTX, out.cache


class LoadedTarget:
    """A target model with its parameters on a mesh and jitted forward / prefill / extend."""

    def __init__(self, model: Target, mesh=None):
        self.model = model
        self.config: TargetConfig = model.cfg
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        self._call = jax.jit(_target_call, static_argnums=(0, 5), donate_argnums=(4,))

    @property
    def dtype(self):
        return self.model.dtype

    def _aux_ids(self, aux_layer_ids) -> tuple[int, ...]:
        if aux_layer_ids is None:
            return ()
        return self.model.check_aux_ids(aux_layer_ids)

    def init_cache(self, batch: int, capacity: int) -> MLACache:
        with mesh_context(self.mesh):
            return self.model.init_cache(batch, capacity)

    def forward(self, ids, aux_layer_ids: Sequence[int] | None = None) -> ForwardOutput:
        """One causal pass over ids [B, T] from position 0 (a fresh cache of capacity T)."""
        ids_BT = jnp.asarray(ids, jnp.int32)
        if ids_BT.ndim != 2:
            raise ConfigError(f"forward expects token ids of shape [batch, tokens], found shape {ids_BT.shape}")
        B, T = ids_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits, aux, _ = self.extend_at(ids_BT, positions_BT, self.init_cache(B, T), aux_layer_ids)
        return ForwardOutput(logits=logits, aux_hidden=aux)

    def extend_at(self, ids_BT, positions_BT, cache: MLACache, aux_layer_ids=None):
        """Runs tokens at explicit absolute positions; returns (logits, aux, cache). The cache is donated."""
        aux_ids = self._aux_ids(aux_layer_ids)
        with mesh_context(self.mesh):
            return self._call(self.graphdef, self.state, jnp.asarray(ids_BT, jnp.int32),
                              jnp.asarray(positions_BT, jnp.int32), cache, aux_ids)

    def prefill(self, ids_BT, lengths_B, cache: MLACache, aux_layer_ids=None):
        """Right-padded prompts ids [B, T] with true lengths [B], written from position 0.

        Returns (logits [B, T, V], aux, cache, lengths). Logits past a row's length are junk;
        the cache slots they wrote are masked until overwritten by later tokens.
        """
        ids_BT = jnp.asarray(ids_BT, jnp.int32)
        B, T = ids_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits, aux, cache = self.extend_at(ids_BT, positions_BT, cache, aux_layer_ids)
        return logits, aux, cache, jnp.asarray(lengths_B, jnp.int32)

    def extend(self, ids_BT, lengths_B, cache: MLACache, aux_layer_ids=None):
        """Appends ids [B, T_new] after each row's current length; returns (logits, aux, cache, new lengths)."""
        ids_BT = jnp.asarray(ids_BT, jnp.int32)
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        positions_BT = lengths_B[:, None] + jnp.arange(ids_BT.shape[1], dtype=jnp.int32)[None, :]
        logits, aux, cache = self.extend_at(ids_BT, positions_BT, cache, aux_layer_ids)
        return logits, aux, cache, lengths_B + ids_BT.shape[1]


def build_target(cfg: TargetConfig, dtype="float32", mesh=None, seed: int | None = 0,
                 moe_kernel: str | None = None) -> LoadedTarget:
    """A target with random weights (tests, benchmarks, planning)."""
    dtype = resolve_dtype(dtype)
    mesh = resolve_mesh(mesh)
    model = Target(cfg, dtype, nnx.Rngs(seed), mesh=mesh, moe_kernel=moe_kernel)
    if mesh is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, shard_state(state, mesh))
    return LoadedTarget(model, mesh)


def load_target(path: str | os.PathLike, dtype="float32", mesh=None, moe_kernel: str | None = None) -> LoadedTarget:
    """Loads a Hugging Face DeepseekV3 / Kimi-K2 / Kimi-K2.5 checkpoint directory."""
    path = os.fspath(path)
    cfg = TargetConfig.from_path(path)
    dtype = resolve_dtype(dtype)
    mesh = resolve_mesh(mesh)
    abstract = nnx.eval_shape(lambda: Target(cfg, dtype, None, mesh=mesh, moe_kernel=moe_kernel))
    graphdef, abstract_state = nnx.split(abstract)
    reader = CheckpointReader(path)
    state = load_state(reader, target_rules(cfg), abstract_state, prefix=cfg.weight_prefix,
                       ignore=lambda k: is_ignored_key(cfg, k), mesh=mesh, where=path)
    return LoadedTarget(nnx.merge(graphdef, state), mesh)
