"""The DeepSeek-V3-architecture target: embed -> decoder layers (dense first, then MoE) -> norm -> head.

Besides logits it returns the EAGLE-3 auxiliary hidden states: the residual stream after the
layers named by ``aux_layer_ids`` (id i = output of layer i, the SGLang/SpecForge convention),
concatenated low to high.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.config import TargetConfig
from eagle3_jax.models.attention import MLAttention
from eagle3_jax.models.cache import MLACache
from eagle3_jax.models.layers import RMSNorm, SwiGLU, param, rope_cos_sin, rope_inv_freq, yarn_softmax_scale
from eagle3_jax.models.moe import MoE
from eagle3_jax.models.quantized import QuantLayout
from eagle3_jax.sharding import constrain


# Activations at block boundaries: rows split as attention's (data-parallel attention, sharding.py).
ROWS = ("attn_batch", "seq", "embed")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs, mesh=None, moe_kernel=None,
                 quant: QuantLayout | None = None):
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype, rngs, quant)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype, rngs, mesh=mesh, kernel=moe_kernel, quant=quant)
        else:
            self.mlp = SwiGLU(D, cfg.intermediate_size, dtype, rngs, quant=quant)

    def __call__(self, x_BTD, positions_BT, cos_BTP, sin_BTP, cache: MLACache, layer: int, softmax_scale):
        # The residual stream's rows are split as attention's; the MoE gathers its own rows (moe.py).
        h_BTD, cache = self.self_attn(
            self.input_layernorm(x_BTD), positions_BT, cos_BTP, sin_BTP, cache, layer, softmax_scale)
        x_BTD = x_BTD + constrain(h_BTD, ROWS)
        x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
        return constrain(x_BTD, ROWS), cache


@dataclass
class TargetStep:
    """What one target call returns: final hidden (post-norm), aux states, the updated cache."""

    hidden_BTD: jax.Array
    aux_BTX: jax.Array | None
    cache: MLACache


class Target(nnx.Module):
    def __init__(self, cfg: TargetConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None, mesh=None,
                 moe_kernel: str | None = None, quant: QuantLayout | None = None):
        """``quant``: which weights are held quantized (None: all in ``dtype``)."""
        cfg.validate()
        self.cfg = cfg
        self.dtype = dtype
        self.quant = quant
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = param(rngs, (V, D), ("vocab", "embed"), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs, mesh, moe_kernel, quant)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (D, V), ("embed", "vocab"), dtype)
        inv_freq, attn_factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        self.rope_inv_freq = tuple(inv_freq.tolist())  # static (hashable) data, not a parameter
        self.rope_attn_factor = attn_factor
        self.softmax_scale = yarn_softmax_scale(cfg.rope, cfg.qk_head_dim)

    def init_cache(self, batch: int, capacity: int) -> MLACache:
        cfg = self.cfg
        return MLACache.zeros(cfg.num_hidden_layers, batch, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim, self.dtype)

    def embed(self, ids_BT: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], ids_BT, axis=0)

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        if self.lm_head is None:
            out = jnp.einsum("btd,vd->btv", hidden_BTD, self.embed_tokens[...])
        else:
            out = jnp.einsum("btd,dv->btv", hidden_BTD, self.lm_head[...])
        # Rows as attention's: with data=1 every chip would otherwise compute every row's logits.
        return constrain(out.astype(jnp.float32), ("attn_batch", "seq", "vocab"))

    def __call__(self, ids_BT: jax.Array, positions_BT: jax.Array, cache: MLACache,
                 aux_layer_ids: Sequence[int] | jax.Array | None = ()) -> TargetStep:
        """Runs T new tokens per row at the given absolute positions, writing them into the cache.
        ``aux_layer_ids``: a sequence of ints is compiled in; an array is traced, so that one
        compiled program serves every wiring of a draft (the decode programs pass one)."""
        x_BTD = constrain(self.embed(ids_BT), ROWS)
        cos_BTP, sin_BTP = rope_cos_sin(positions_BT, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attn_factor)
        traced = isinstance(aux_layer_ids, jax.Array)
        ids = aux_layer_ids if traced else tuple(aux_layer_ids or ())
        B, T, D = x_BTD.shape
        N = len(ids)
        # Traced ids: each layer's output is selected into the slots whose id names it, in a buffer
        # laid out as the concatenation returned. Constant ids: the outputs they name, concatenated.
        aux_BTND = jnp.zeros((B, T, N, D), x_BTD.dtype) if traced else None
        aux = [None] * N
        for i, layer in enumerate(self.layers):
            # Each layer writes its new slots straight into the (donated) stacked cache.
            x_BTD, cache = layer(x_BTD, positions_BT, cos_BTP, sin_BTP, cache, i, self.softmax_scale)
            if traced:
                aux_BTND = jnp.where((ids == i)[:, None], x_BTD[:, :, None], aux_BTND)
            else:
                aux = [x_BTD if want == i else a for want, a in zip(ids, aux)]
        if not N:
            return TargetStep(hidden_BTD=self.norm(x_BTD), aux_BTX=None, cache=cache)
        aux_BTX = aux_BTND.reshape(B, T, N * D) if traced else jnp.concatenate(aux, axis=-1)
        return TargetStep(hidden_BTD=self.norm(x_BTD), aux_BTX=aux_BTX, cache=cache)
