"""Positions in chunks: one way to cut [B, T, ...] arrays along T and to scan a step over the cuts.

T is zero-padded at the end to whole chunks; whatever a caller computes there is dropped when the
chunks are joined back (padded positions lie past every real one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split(x_BT_: jax.Array, size: int, count: int | None = None) -> jax.Array:
    """[B, T, ...] zero-padded to ``count * size`` positions -> [B, count, size, ...]; ``count``
    defaults to the fewest chunks that cover T."""
    B, T = x_BT_.shape[:2]
    count = -(-T // size) if count is None else count
    x = jnp.pad(x_BT_, ((0, 0), (0, count * size - T)) + ((0, 0),) * (x_BT_.ndim - 2))
    return x.reshape((B, count, size) + x_BT_.shape[2:])


def join(x_BNC_: jax.Array, T: int) -> jax.Array:
    """``split`` undone: [B, n, C, ...] -> [B, T, ...]."""
    B, n, C = x_BNC_.shape[:3]
    return x_BNC_.reshape((B, n * C) + x_BNC_.shape[3:])[:, :T]


def scan_chunks(step, carry, xs_BT_, size: int):
    """``lax.scan`` of ``step(carry, start, chunk) -> (carry, ys)`` over chunks of ``size``
    positions of ``xs_BT_`` (a pytree of [B, T, ...] arrays), ``start`` the chunk's first position;
    returns (carry, ys joined back to [B, T, ...])."""
    T = jax.tree.leaves(xs_BT_)[0].shape[1]
    xs_NBC_ = jax.tree.map(lambda x: jnp.moveaxis(split(x, size), 1, 0), xs_BT_)
    n = jax.tree.leaves(xs_NBC_)[0].shape[0]
    carry, ys_NBC_ = jax.lax.scan(lambda c, i_x: step(c, i_x[0] * size, i_x[1]), carry, (jnp.arange(n), xs_NBC_))
    return carry, jax.tree.map(lambda y: join(jnp.moveaxis(y, 0, 1), T), ys_NBC_)


def positions(start, batch: int, size: int) -> jax.Array:
    """[batch, size] positions start .. start + size - 1 of one chunk (of every row)."""
    return jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (batch, size))
