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


@jax.tree_util.register_dataclass
@dataclass
class MLACache:
    """Target cache: MLA's compressed latent and the shared rope key, per layer.

    This is what makes a 61-layer, 128-head model fit: C + P = 576 numbers per token per layer
    instead of N · (H + O) = 32768 for expanded keys and values.
    """

    latent_LBSC: jax.Array
    rope_LBSP: jax.Array

    @property
    def capacity(self) -> int:
        return self.latent_LBSC.shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, capacity: int, kv_lora_rank: int, rope_dim: int, dtype) -> "MLACache":
        return cls(
            latent_LBSC=jnp.zeros((num_layers, batch, capacity, kv_lora_rank), dtype),
            rope_LBSP=jnp.zeros((num_layers, batch, capacity, rope_dim), dtype),
        )


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Draft cache: plain per-head keys and values of its one decoder layer."""

    k_BSGH: jax.Array
    v_BSGH: jax.Array

    @property
    def capacity(self) -> int:
        return self.k_BSGH.shape[1]

    @classmethod
    def zeros(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(k_BSGH=jnp.zeros(shape, dtype), v_BSGH=jnp.zeros(shape, dtype))


def write_slots(cache_BS_: jax.Array, new_BT_: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """cache[b, positions[b, t]] = new[b, t]; positions outside [0, S) are dropped."""
    b_BT = jnp.broadcast_to(jnp.arange(cache_BS_.shape[0])[:, None], positions_BT.shape)
    return cache_BS_.at[b_BT, positions_BT].set(new_BT_.astype(cache_BS_.dtype), mode="drop")


def causal_slot_mask(positions_BT: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S]: query at position p sees slots 0..p."""
    slots_S = jnp.arange(capacity)
    return slots_S[None, None, :] <= positions_BT[:, :, None]
