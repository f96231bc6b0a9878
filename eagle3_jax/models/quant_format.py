"""The quantized formats' facts, stated once for the checkpoint readers (numpy) and the native weights
(jnp): how INT4 words hold their values, the default group and block sizes, and which weights a
target holds quantized (``QuantLayout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT4_PER_WORD = 8                  # nibbles per 32-bit word, least significant first
INT4_OFFSET = 8                    # stored nibble = q + 8 (offset binary), q in [-8, 7]
DEFAULT_INT4_GROUP = 32            # input columns per scale (Kimi-K2.5)
DEFAULT_FP8_BLOCK = (128, 128)     # (rows, cols) of one FP8 scale tile (DeepSeek-V3)
# The one INT4 group size with a native kernel (Kimi-K2.5's); others are dequantized on load.
NATIVE_INT4_GROUP = DEFAULT_INT4_GROUP


def int4_nibbles(words, xp=np):
    """uint32 words ``[..., W]`` -> unsigned nibbles ``[..., W, 8]``: column 8j + k at ``[..., j, k]``.
    ``xp`` is numpy or jax.numpy (the same bit arithmetic serves both)."""
    return int4_plane(words[..., None], xp.arange(INT4_PER_WORD, dtype=xp.uint32), xp)


def int4_plane(words, k, xp=np):
    """Nibble ``k`` (0 = least significant) of every uint32 word: input columns 8j + k, unsigned."""
    return (words >> (xp.asarray(k, dtype=xp.uint32) * xp.uint32(4))) & xp.uint32(0xF)


@dataclass(frozen=True)
class QuantLayout:
    """Which weights a target holds quantized, and how: ``experts`` None | "int4" | "fp8" (routed
    expert stacks), ``linears`` None | "fp8" (the other projections); dtypes as the checkpoint's."""

    experts: str | None = None
    linears: str | None = None
    int4_group: int = NATIVE_INT4_GROUP
    int4_scale_dtype: str = "bfloat16"
    int4_shape_dtype: str = "int32"
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK
    fp8_scale_dtype: str = "float32"

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["fp8_block"] = list(self.fp8_block)
        return d

    @classmethod
    def from_json(cls, d: dict | None) -> "QuantLayout | None":
        if not d:
            return None
        d = dict(d)
        d["fp8_block"] = tuple(d.get("fp8_block", DEFAULT_FP8_BLOCK))
        return cls(**d)

    @property
    def name(self) -> str:
        parts = [f"{self.experts}-experts"] if self.experts else []
        if self.linears:
            parts.append(f"{self.linears}-linears")
        return "+".join(parts) or "float"
