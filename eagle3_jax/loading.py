"""Targets and drafts in memory: loading them from checkpoints, building them with random
weights, saving drafts. Below the public facade (``api`` re-exports all of it) so that training
and the tools load models without importing the facade; a draft's kind is found in the registry
(``eagle3_jax.drafts``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import drafts, preflight
from eagle3_jax.checkpoint.hf_loader import load_state
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.target_map import is_ignored_key
from eagle3_jax.config import TargetConfig, resolve_dtype
from eagle3_jax.drafts import LoadedDraft
from eagle3_jax.drafts.loaded import placed
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.cache import MLACache
from eagle3_jax.models.footprint import weight_bytes_by_kind
from eagle3_jax.models.quantized import QuantLayout
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import mesh_context, resolve_mesh


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

    @property
    def param_bytes(self) -> int:
        """Bytes the parameters occupy on the devices, summed over all of them (a replicated
        parameter counts once per device holding it)."""
        return sum(self.param_bytes_by_kind().values())

    def param_bytes_by_kind(self) -> dict[str, int]:
        """``param_bytes`` split by kind of weight and storage, e.g. ``"routed experts (int4)"``."""
        return weight_bytes_by_kind(self.model)

    def init_cache(self, batch: int, capacity: int) -> MLACache:
        with mesh_context(self.mesh):
            return self.model.init_cache(batch, capacity)

    def forward(self, ids, aux_layer_ids: Sequence[int] | None = None) -> ForwardOutput:
        """One causal pass over ids [B, T] from position 0 (a fresh cache of capacity T)."""
        ids_BT = jnp.asarray(ids, jnp.int32)
        if ids_BT.ndim != 2:
            raise ConfigError(f"forward expects token ids of shape [batch, tokens], found shape {ids_BT.shape}")
        B, T = ids_BT.shape
        logits, aux, _, _ = self.extend(ids_BT, jnp.zeros((B,), jnp.int32), self.init_cache(B, T), aux_layer_ids)
        return ForwardOutput(logits=logits, aux_hidden=aux)

    def extend_at(self, ids_BT, positions_BT, cache: MLACache, aux_layer_ids=None):
        """Runs tokens at explicit absolute positions; returns (logits, aux, cache). The cache is donated."""
        aux_ids = () if aux_layer_ids is None else self.config.check_aux_layer_ids(aux_layer_ids)
        with mesh_context(self.mesh):
            return self._call(self.graphdef, self.state, jnp.asarray(ids_BT, jnp.int32),
                              jnp.asarray(positions_BT, jnp.int32), cache, aux_ids)

    def prefill(self, ids_BT, lengths_B, cache: MLACache, aux_layer_ids=None):
        """Right-padded prompts ids [B, T] with true lengths [B], written from position 0.

        Returns (logits [B, T, V], aux, cache, lengths). Logits past a row's length are junk;
        the cache slots they wrote are masked until overwritten by later tokens.
        """
        ids_BT = jnp.asarray(ids_BT, jnp.int32)
        logits, aux, cache, _ = self.extend(ids_BT, jnp.zeros((ids_BT.shape[0],), jnp.int32), cache, aux_layer_ids)
        return logits, aux, cache, jnp.asarray(lengths_B, jnp.int32)

    def extend(self, ids_BT, lengths_B, cache: MLACache, aux_layer_ids=None):
        """Appends ids [B, T_new] after each row's current length; returns (logits, aux, cache, new lengths)."""
        ids_BT = jnp.asarray(ids_BT, jnp.int32)
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        positions_BT = lengths_B[:, None] + jnp.arange(ids_BT.shape[1], dtype=jnp.int32)[None, :]
        logits, aux, cache = self.extend_at(ids_BT, positions_BT, cache, aux_layer_ids)
        return logits, aux, cache, lengths_B + ids_BT.shape[1]


def build_target(cfg: TargetConfig, dtype="float32", mesh=None, seed: int | None = 0,
                 moe_kernel: str | None = None, quant: QuantLayout | None = None) -> LoadedTarget:
    """A target with random weights (tests, benchmarks, planning); ``quant`` holds the weights it
    names quantized (random INT4 words / FP8 values and scales)."""
    dtype = resolve_dtype(dtype)
    mesh = resolve_mesh(mesh)
    model = Target(cfg, dtype, nnx.Rngs(seed), mesh=mesh, moe_kernel=moe_kernel, quant=quant)
    return LoadedTarget(placed(model, mesh), mesh)


def load_target(path: str | os.PathLike, dtype="float32", mesh=None, moe_kernel: str | None = None,
                weights: str = "native", config: TargetConfig | None = None) -> LoadedTarget:
    """Loads a Hugging Face DeepseekV3 / Kimi-K2 / Kimi-K2.5 checkpoint directory (bf16/fp32, FP8
    block-scaled or INT4 pack-quantized) or one converted by ``tools.convert``.

    ``weights="native"`` (default) keeps quantized weights as stored: INT4 expert words and FP8
    values stay on the devices with their scales and are dequantized inside the matmuls.
    ``weights="bfloat16"`` dequantizes every weight into ``dtype`` while loading. ``config``: the
    config the caller already read from ``path`` (not read again).
    """
    from eagle3_jax.checkpoint import quant_native, store

    if weights not in quant_native.WEIGHTS_CHOICES:
        raise ConfigError(f"weights='{weights}' is not supported; use one of {quant_native.WEIGHTS_CHOICES}")
    path = os.fspath(path)
    cfg = config if config is not None else TargetConfig.from_path(path)
    dtype = resolve_dtype(dtype)
    mesh = resolve_mesh(mesh)
    jax_ckpt = store.is_jax_checkpoint(path)
    reader = None
    if jax_ckpt:
        layout = QuantLayout.from_json(store.read_meta(path).get("quant"))
        if layout is not None and weights != "native":
            raise ConfigError(
                f"{path} holds quantized weights ({layout.name}); load it with weights='native', or convert "
                "the original checkpoint with `python -m tools.convert to-jax --weights bfloat16`")
    else:
        reader = CheckpointReader(path)
        layout = quant_native.detect_layout(reader, cfg, where=path) if weights == "native" else None
    abstract = nnx.eval_shape(lambda: Target(cfg, dtype, None, mesh=mesh, moe_kernel=moe_kernel, quant=layout))
    graphdef, abstract_state = nnx.split(abstract)
    if jax_ckpt:
        state = store.restore_state(path, abstract_state, mesh, kind="target")
    else:
        rules = quant_native.native_rules(cfg, layout)  # target_rules when nothing is held quantized
        read = quant_native.native_reader(cfg, rules, dtype, where=path)
        state = load_state(reader, rules, abstract_state, prefix=cfg.weight_prefix,
                           ignore=lambda k: is_ignored_key(cfg, k), mesh=mesh, where=path, read=read)
    return LoadedTarget(nnx.merge(graphdef, state), mesh)


# ====================================================================== draft
def build_draft(cfg, target: LoadedTarget, dtype=None, seed: int = 0) -> LoadedDraft:
    """A randomly initialized draft of ``cfg``'s kind for ``target`` (tests, training from scratch)."""
    return drafts.of_config(cfg).build(cfg, target, dtype, seed)


def load_draft(path: str | os.PathLike, target: LoadedTarget, dtype=None,
               checked: preflight.PairFacts | None = None) -> LoadedDraft:
    """Loads a draft directory of any registered kind (config.json + safetensors in the SpecForge /
    SGLang layout, or one converted by ``tools.convert``) for ``target``, every wiring contract
    (``contracts.check_pairing``) checked before a weight is placed. ``checked``: what
    ``preflight.check_pair`` found for this target and draft, when the caller ran it already."""
    facts = checked if checked is not None else preflight.check_pair(target.config, path)
    return drafts.of_config(facts.draft).load(path, facts.draft, target, dtype)


def save_draft(draft: LoadedDraft, path: str | os.PathLike, config_overrides: dict | None = None,
               dtype: str | None = None) -> None:
    """Writes the draft in its kind's SpecForge / SGLang layout (config.json, with the aux layer ids
    used, + model.safetensors), staged beside ``path`` and renamed when complete. ``dtype``
    ("bfloat16", "float16", "float32") casts the float weights and is recorded as ``torch_dtype``;
    None keeps the draft's own dtype."""
    drafts.of_module(draft.model).save(draft, path, resolve_dtype(dtype) if dtype is not None else None, dtype,
                                       config_overrides)
