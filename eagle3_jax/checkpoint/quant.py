"""Dequantizing the quantized weights of published targets while they are read (never requantizing:
a converted checkpoint exported back to Hugging Face layout holds bf16 weights).

FP8 block scaling (DeepSeek-V3/R1, Kimi-K2; ``quant_method: fp8``)
    ``X.weight`` float8_e4m3fn ``[out, in]`` and ``X.weight_scale_inv`` float32
    ``[ceil(out/bo), ceil(in/bi)]``, ``(bo, bi) = weight_block_size``: each tile (the last of a
    row or column may be partial) times its one scale, in float32.

INT4 pack-quantized (Kimi-K2.5's routed experts; ``quant_method: compressed-tensors``,
``format: pack-quantized``, symmetric, ``strategy: group``)
    ``X.weight_packed`` int32 ``[out, ceil(in/8)]``, ``X.weight_scale`` ``[out, ceil(in/group)]``
    (bf16 in Kimi-K2.5; f16 / f32 accepted), ``X.weight_shape`` ``[out, in]`` (any int dtype).
    As compressed-tensors' ``pack_to_int32`` lays them out (checked against its source): values
    offset-binary (q in [-8, 7] stored as q + 8), eight per word along the input dimension, least
    significant nibble first, the last word of a row zero-padded; the word's sign means nothing
    (unpacking works on the uint32 bit pattern); ``w[r, c] = q[r, c] * scale[r, c // group]``.
    The word facts are stated once, for numpy and jax.numpy, in ``models/quant_format.py``.

``read_dequantized`` reads a logical weight in whichever form it is stored; ``classify`` looks at
headers only, so a whole checkpoint can be checked for unsupported dtypes before any data is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from eagle3_jax.errors import CheckpointError
from eagle3_jax.models.quant_format import DEFAULT_FP8_BLOCK, DEFAULT_INT4_GROUP, INT4_OFFSET, int4_nibbles

FLOAT_CODES = ("F32", "BF16", "F16")
SCALE_CODES = ("F32", "BF16", "F16")
INT_CODES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")

PLAIN, FP8, INT4 = "plain", "fp8", "int4"


@dataclass(frozen=True)
class QuantScheme:
    """What ``quantization_config`` in config.json promises about the quantized tensors."""

    method: str | None = None                    # None | "fp8" | "compressed-tensors"
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK   # (rows, cols) of one FP8 scale tile
    int4_group: int = DEFAULT_INT4_GROUP             # input columns per INT4 scale

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any] | None, where: str = "config.json") -> "QuantScheme":
        """Reads ``quantization_config``, refusing schemes we cannot dequantize exactly before any
        tensor is read."""
        q = quantization_config(d)
        if not q:
            return cls()
        method = q.get("quant_method")
        if method == "fp8":
            fmt = q.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise CheckpointError(
                    f"{where}: quantization_config.fmt is '{fmt}'; only block-scaled float8 e4m3 "
                    "(DeepSeek-V3 / Kimi-K2 style) is supported")
            block = q.get("weight_block_size") or list(DEFAULT_FP8_BLOCK)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise CheckpointError(
                    f"{where}: quantization_config.weight_block_size must be two positive ints "
                    f"[rows, cols], found {block!r}")
            return cls(method="fp8", fp8_block=(int(block[0]), int(block[1])))
        if method == "compressed-tensors":
            groups = q.get("config_groups") or {}
            formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, Mapping)}
            formats.discard(None)
            if formats - {"pack-quantized"}:
                raise CheckpointError(
                    f"{where}: compressed-tensors format {sorted(formats)} is not supported; "
                    "only 'pack-quantized' symmetric INT4 (Kimi-K2.5 style) is")
            sizes = set()
            for name, g in groups.items():
                w = (g or {}).get("weights") or {}
                problems = []
                if w.get("type", "int") != "int":
                    problems.append(f"type {w.get('type')!r} (need 'int')")
                if int(w.get("num_bits", 4)) != 4:
                    problems.append(f"num_bits {w.get('num_bits')} (need 4)")
                if not w.get("symmetric", True):
                    problems.append("symmetric false (zero points are not supported)")
                if w.get("strategy", "group") != "group":
                    problems.append(f"strategy {w.get('strategy')!r} (need 'group')")
                if problems:
                    raise CheckpointError(
                        f"{where}: quantization_config.config_groups.{name}: " + ", ".join(problems)
                        + "; only symmetric INT4 group quantization can be dequantized")
                if w.get("group_size") is not None:
                    sizes.add(int(w["group_size"]))
            if len(sizes) > 1:
                raise CheckpointError(
                    f"{where}: config_groups use several group sizes {sorted(sizes)}; expected one")
            return cls(method="compressed-tensors", int4_group=sizes.pop() if sizes else DEFAULT_INT4_GROUP)
        raise CheckpointError(
            f"{where}: quantization_config.quant_method '{method}' is not supported; expected 'fp8' "
            "(block-scaled, DeepSeek-V3 / Kimi-K2) or 'compressed-tensors' pack-quantized INT4 "
            "(Kimi-K2.5), or a checkpoint without quantization_config")


def quantization_config(hf_config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """config.json's ``quantization_config``: top level, or under Kimi-K2.5's ``text_config``."""
    d = hf_config or {}
    q = d.get("quantization_config")
    if q is None and isinstance(d.get("text_config"), Mapping):
        q = d["text_config"].get("quantization_config")
    return q

# ---------------------------------------------------------------------- the math
def dequant_fp8_block(w_fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = DEFAULT_FP8_BLOCK,
                      name: str = "weight") -> np.ndarray:
    """float8_e4m3fn [out, in] x float32 [ceil(out/bo), ceil(in/bi)] tile scales -> float32 [out, in]."""
    if w_fp8.ndim != 2:
        raise CheckpointError(f"{name}: an FP8 weight must be 2-D [out, in], found shape {w_fp8.shape}")
    rows, cols = w_fp8.shape
    bo, bi = block
    want = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not fit weight {tuple(w_fp8.shape)} "
            f"with {bo}x{bi} blocks (expected {want}); check weight_block_size in quantization_config")
    out = w_fp8.astype(np.float32)
    s = scale_inv.astype(np.float32)
    # Multiply whole tiles in place through a [R, bo, C, bi] view of the padded-free region,
    # then the partial edge tiles separately: no [out, in] scale array is ever built.
    full_r, full_c = rows // bo, cols // bi
    if full_r and full_c:
        core = out[: full_r * bo, : full_c * bi].reshape(full_r, bo, full_c, bi)
        core *= s[:full_r, None, :full_c, None]
    for r in range(want[0]):
        rs = slice(r * bo, min((r + 1) * bo, rows))
        start_c = full_c if r < full_r else 0
        for c in range(start_c, want[1]):
            out[rs, c * bi: min((c + 1) * bi, cols)] *= s[r, c]
    return out


def unpack_int4(packed: np.ndarray, cols: int, name: str = "weight") -> np.ndarray:
    """int32 [out, ceil(cols/8)] offset-binary nibbles (LSB first) -> int8 [out, cols] in [-8, 7]."""
    if packed.ndim != 2 or packed.dtype != np.int32:
        raise CheckpointError(
            f"{name}_packed: expected int32 [out, in/8], found {packed.dtype} shape {packed.shape}")
    if packed.shape[1] != math.ceil(cols / 8):
        raise CheckpointError(
            f"{name}_packed: {packed.shape[1]} words per row cannot hold {cols} columns "
            f"(expected {math.ceil(cols / 8)}); weight_shape and weight_packed disagree")
    nibbles = int4_nibbles(packed.view(np.uint32))      # [out, words, 8], column-minor
    return nibbles.reshape(packed.shape[0], -1)[:, :cols].astype(np.int8) - np.int8(INT4_OFFSET)


def dequant_int4(packed: np.ndarray, scale: np.ndarray, shape, group: int = DEFAULT_INT4_GROUP,
                 name: str = "weight") -> np.ndarray:
    """Symmetric group-quantized INT4 -> float32 [out, in]: ``q * scale[:, col // group]``."""
    rows, cols = (int(x) for x in shape)
    if packed.shape[0] != rows:
        raise CheckpointError(f"{name}_packed: {packed.shape[0]} rows, weight_shape says {rows}")
    want = (rows, math.ceil(cols / group))
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"{name}_scale: shape {tuple(scale.shape)} does not fit weight_shape {(rows, cols)} with "
            f"group_size {group} (expected {want}); check group_size in quantization_config")
    q = unpack_int4(packed, cols, name).astype(np.float32)
    s = np.repeat(scale.astype(np.float32), group, axis=1)[:, :cols]
    return q * s


# ---------------------------------------------------------------------- reading
def classify(reader, key: str) -> str:
    """How the logical tensor ``key`` is stored: PLAIN, FP8 or INT4 (headers only); a CheckpointError
    naming the tensor when its dtype cannot be read as a float weight."""
    if key + "_packed" in reader:
        codes = {s: reader.dtype_code(key + s) for s in ("_packed", "_scale", "_shape") if key + s in reader}
        missing = [key + s for s in ("_scale", "_shape") if key + s not in reader]
        if missing:
            raise CheckpointError(f"{key}: INT4 packed weight without {missing}; the checkpoint is incomplete")
        if codes["_packed"] != "I32" or codes["_scale"] not in SCALE_CODES or codes["_shape"] not in INT_CODES:
            raise CheckpointError(
                f"{key}: INT4 tensors have dtypes packed={codes['_packed']}, scale={codes['_scale']}, "
                f"shape={codes['_shape']}; expected I32, one of {SCALE_CODES}, an integer type")
        return INT4
    if key not in reader:
        raise CheckpointError(f"{key}: not in the checkpoint (nor as {key}_packed)")
    code = reader.dtype_code(key)
    if code in FLOAT_CODES:
        return PLAIN
    if code == "F8_E4M3":
        scale = key + "_scale_inv"
        if scale not in reader:
            raise CheckpointError(
                f"{key}: float8_e4m3fn without {scale}; an FP8 weight needs its block scales to be read")
        if reader.dtype_code(scale) not in SCALE_CODES:
            raise CheckpointError(f"{scale}: dtype {reader.dtype_code(scale)}, expected one of {SCALE_CODES}")
        return FP8
    raise CheckpointError(
        f"{key}: dtype {code} is not supported for a weight; expected one of {', '.join(FLOAT_CODES)}, "
        "float8_e4m3fn with weight_scale_inv, or INT4 weight_packed; re-export the checkpoint")


def logical_shape(reader, key: str) -> tuple[int, ...]:
    """Shape of the dequantized tensor (reads only INT4's tiny weight_shape)."""
    kind = classify(reader, key)
    if kind == INT4:
        return tuple(int(x) for x in reader.read(key + "_shape").reshape(-1))
    return tuple(reader.shape(key))


def read_dequantized(reader, key: str, dtype=None, scheme: QuantScheme | None = None) -> np.ndarray:
    """The logical tensor ``key`` as a float array (``dtype``; default: as stored, float32 if quantized)."""
    scheme = scheme or QuantScheme()
    kind = classify(reader, key)
    if kind == PLAIN:
        arr = reader.read(key)
    elif kind == FP8:
        arr = dequant_fp8_block(reader.read(key), reader.read(key + "_scale_inv"), scheme.fp8_block, key)
    else:
        shape = reader.read(key + "_shape").reshape(-1)
        arr = dequant_int4(reader.read(key + "_packed"), reader.read(key + "_scale"), shape,
                           scheme.int4_group, key)
    if dtype is not None and arr.dtype != np.dtype(dtype):
        arr = arr.astype(dtype)
    return arr


def dequantizing_reader(hf_config: Mapping[str, Any] | None, dtype=None,
                        where: str = "config.json") -> Callable[[Any, str], np.ndarray]:
    """A ``read=`` hook for ``hf_loader.load_state`` that follows config.json's quantization_config:
    plain tensors come back as stored, so the loader casts each to its own parameter's dtype
    (routers stay float32 in a bf16 model); dequantized weights come back in ``dtype`` (the
    model's), which keeps a stack of hundreds of dequantized experts from passing through float32."""
    scheme = QuantScheme.from_hf_config(hf_config, where)
    np_dtype = None if dtype is None else np.dtype(dtype)

    def read(reader, key):
        if classify(reader, key) == PLAIN:
            return reader.read(key)
        return read_dequantized(reader, key, np_dtype, scheme)

    return read


def source_dtype(reader, key: str) -> np.dtype:
    """The float dtype a tensor becomes when read without a requested dtype (bf16 for quantized)."""
    kind = classify(reader, key)
    if kind == PLAIN:
        return np.dtype(reader.dtype(key))
    return np.dtype(ml_dtypes.bfloat16)
