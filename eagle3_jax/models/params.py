"""The one way a float parameter is made: a ``nnx.Param`` with logical axis names (a leaf module:
``layers.py`` and ``quantized.py`` both build parameters, neither imports the other for it)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype, init: str = "normal",
          std: float = 0.02) -> nnx.Param:
    """A parameter with logical axes. ``rngs=None`` gives zeros (weights to be loaded)."""
    shape = tuple(int(s) for s in shape)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes))
