"""Fixed-capacity KV caches as pytrees.

Slot s of a row holds the token at absolute position s. A call writes its new tokens at their
positions, then attends to slots <= the query's position, so slots past a row's length (stale
drafts that were rejected) are masked until they are overwritten; nothing is ever erased.
Writes past the capacity are dropped (scatter mode "drop"), never wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle3_jax.sharding import constrain


@jax.tree_util.register_dataclass
@dataclass
class MLACache:
    """Target cache: MLA's compressed latent and the shared rope key, per layer (C + P numbers per
    token per layer instead of N · (H + Y) for expanded keys and values)."""

    latent_LBSC: jax.Array
    rope_LBSP: jax.Array

    # Rows split as attention's are (data-parallel attention: each chip holds its own rows' cache).
    AXES = {"latent_LBSC": (None, "attn_batch", "cache_seq", "kv_lora"),
            "rope_LBSP": (None, "attn_batch", "cache_seq", None)}

    def laid_out(self) -> "MLACache":
        return MLACache(*(constrain(getattr(self, f), a) for f, a in self.AXES.items()))

    @property
    def capacity(self) -> int:
        return self.latent_LBSC.shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, capacity: int, kv_lora_rank: int, rope_dim: int, dtype) -> "MLACache":
        return cls(
            latent_LBSC=jnp.zeros((num_layers, batch, capacity, kv_lora_rank), dtype),
            rope_LBSP=jnp.zeros((num_layers, batch, capacity, rope_dim), dtype),
        ).laid_out()

    def write(self, layer: int, latent_BTC: jax.Array, rope_BTP: jax.Array, positions_BT: jax.Array) -> "MLACache":
        """Scatters one layer's new tokens into their slots (positions outside [0, S) are dropped)."""
        b_BT = jnp.broadcast_to(jnp.arange(self.latent_LBSC.shape[1])[:, None], positions_BT.shape)

        def put(cache_LBS_, new_BT_):
            return cache_LBS_.at[layer, b_BT, positions_BT].set(new_BT_.astype(cache_LBS_.dtype), mode="drop")

        return MLACache(latent_LBSC=put(self.latent_LBSC, latent_BTC), rope_LBSP=put(self.rope_LBSP, rope_BTP)).laid_out()


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Draft cache: plain per-head keys and values of its one decoder layer, [B, S, G, H]: slots
    before heads, as the projections produce them, so a write scatters whole contiguous [G, H]
    windows (heads before slots made the TPU compiler copy the whole cache between layouts on every
    draft call; blockwise attention's heads-major copy is one block's)."""

    k_BSGH: jax.Array
    v_BSGH: jax.Array

    AXES = {"k_BSGH": ("attn_batch", "cache_seq", "heads", "head_dim"),
            "v_BSGH": ("attn_batch", "cache_seq", "heads", "head_dim")}

    def laid_out(self) -> "KVCache":
        return KVCache(*(constrain(getattr(self, f), a) for f, a in self.AXES.items()))

    @property
    def capacity(self) -> int:
        return self.k_BSGH.shape[1]

    @classmethod
    def zeros(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype,
              value_dim: int | None = None) -> "KVCache":
        """``value_dim``: the values' width where it is not the keys' (an MLA draft's latent)."""
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(k_BSGH=jnp.zeros(shape, dtype),
                   v_BSGH=jnp.zeros(shape[:-1] + (value_dim or head_dim,), dtype)).laid_out()

    def write(self, k_BTGH: jax.Array, v_BTGH: jax.Array, positions_BT: jax.Array) -> "KVCache":
        """Scatters only the new tokens into their slots (positions outside [0, S) are dropped)."""
        b_BT = jnp.broadcast_to(jnp.arange(self.k_BSGH.shape[0])[:, None], positions_BT.shape)

        def put(cache_BSGH, new_BTGH):
            return cache_BSGH.at[b_BT, positions_BT].set(new_BTGH.astype(cache_BSGH.dtype), mode="drop")

        return KVCache(k_BSGH=put(self.k_BSGH, k_BTGH), v_BSGH=put(self.v_BSGH, v_BTGH)).laid_out()

