"""The safetensors file format: dtype codes, byte sizes, shard names, and header validation.

A file is N (8 bytes, unsigned little-endian), an N-byte UTF-8 JSON header (maybe right-padded
with spaces) mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(relative to the data buffer) plus an optional ``"__metadata__": {str: str}``, then the data
buffer, little-endian and C-contiguous. As the specification requires, the tensors must cover the
buffer exactly: no holes, no overlaps, nothing after the last. :func:`read_header` enforces all
of that, so a file our readers accept is a file the official implementation accepts too.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Tuple, Union

import ml_dtypes
import numpy as np

from eagle3_jax.errors import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"

DTYPES: Dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
}

_CODES: Dict[np.dtype, str] = {dt: code for code, dt in DTYPES.items()}

# The official implementation refuses headers larger than this; so do we.
MAX_HEADER_BYTES = 100_000_000
FIX = "the file is truncated or corrupt; re-download or re-convert it"


def dtype_code(dtype: Any) -> str:
    """The safetensors dtype code (``"F32"``, ``"BF16"``, ...) of a numpy dtype, whatever its byte
    order (the writer converts to little-endian)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return _CODES[dt]
    except KeyError:
        raise CheckpointError(
            f"numpy dtype {dt} has no safetensors equivalent; supported dtypes are "
            f"{', '.join(f'{c} ({d})' for c, d in DTYPES.items())}; cast the array "
            "to one of them before saving"
        ) from None


def parse_size(size: Union[str, int]) -> int:
    """A byte size such as ``"5GB"``, ``"512 MiB"``, ``"1.5GiB"`` or ``1000`` (units case-insensitive;
    the result a whole, non-negative number of bytes)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"expected a byte size like '5GB' or an int, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a byte size must be >= 0, got {size}")
        return size
    units = {
        "": 1, "b": 1,
        "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    }
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", size)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in units:
        raise ValueError(
            f"cannot parse byte size {size!r}: expected a number followed by one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
            "e.g. '5GB' or '512MiB'"
        )
    value = Fraction(m.group(1)) * units[unit]
    if value.denominator != 1:
        raise ValueError(f"byte size {size!r} is not a whole number of bytes ({float(value)})")
    return int(value)


def shard_file_name(index: int, total: int) -> str:
    """Hugging Face shard name: ``model-00001-of-00003.safetensors`` (1-based index)."""
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TensorInfo(NamedTuple):
    """Where one tensor lives in a file's data buffer (``[begin, end)``), and what it is."""

    name: str
    code: str
    dtype: np.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(fh, file_size: int, where: Path) -> Tuple[int, Dict[str, str], Dict[str, TensorInfo]]:
    """Reads and validates the length prefix and JSON header at the start of ``fh`` (a raw binary
    file of ``file_size`` bytes; ``where`` names it in errors). Returns the data buffer's file
    offset, ``__metadata__`` ({} when absent) and the tensors in data-offset order."""

    def _err(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    def unique(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _err(f"the header lists the key {k!r} more than once; {FIX}")
            seen.add(k)
        return dict(pairs)

    size = file_size
    if size < 8:
        raise _err(
            f"expected at least 8 bytes (the header length), found a {size}-byte file; {FIX}"
        )
    prefix = read_exact(fh, 8)
    (n,) = struct.unpack("<Q", prefix)
    if n > size - 8:
        raise _err(
            f"the header claims to be {n} bytes but only {size - 8} bytes follow the "
            f"8-byte length prefix; {FIX}"
        )
    if n > MAX_HEADER_BYTES:
        raise _err(
            f"the header claims to be {n} bytes, more than the {MAX_HEADER_BYTES}-byte "
            f"limit of the safetensors format; {FIX}"
        )
    raw = read_exact(fh, n)
    if len(raw) != n:
        raise _err(f"expected a {n}-byte header, could read only {len(raw)} bytes; {FIX}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _err(f"the {n}-byte header is not valid UTF-8 ({e}); {FIX}") from None
    if not text.startswith("{"):
        raise _err(
            f"expected the header to be a JSON object starting with '{{', found "
            f"{text[:40]!r}; this is not a safetensors file or {FIX}"
        )
    try:
        header = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise _err(f"the {n}-byte header is not valid JSON ({e}); {FIX}") from None
    if not isinstance(header, dict):
        raise _err(f"expected the header to be a JSON object, found {type(header).__name__}; {FIX}")

    buffer_len = size - 8 - n

    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _err(
            f"expected '__metadata__' to be an object of string values, found {meta!r}; {FIX}"
        )

    infos = [_parse_entry(name, entry, _err) for name, entry in header.items()]

    # sorted by position, each tensor starts where the previous one ended, the last at EOF
    infos.sort(key=lambda t: (t.begin, t.end))
    for t in infos:
        if t.end > buffer_len:
            raise _err(
                f"tensor {t.name!r} ({t.code}, shape {list(t.shape)}) needs bytes "
                f"[{t.begin}, {t.end}) of the data buffer, but the file has only "
                f"{buffer_len} data bytes after its {n}-byte header "
                f"({size} bytes in all); {FIX}"
            )
    pos = 0
    prev: TensorInfo | None = None
    for t in infos:
        if t.begin < pos:
            raise _err(
                f"tensor {t.name!r} occupies bytes [{t.begin}, {t.end}) of the data buffer, "
                f"overlapping tensor {prev.name!r} at [{prev.begin}, {prev.end}); the header "
                f"lies about its offsets; {FIX}"
            )
        if t.begin > pos:
            after = f"after tensor {prev.name!r} " if prev is not None else ""
            raise _err(
                f"expected tensor {t.name!r} to start at data offset {pos} {after}but it starts "
                f"at {t.begin}, leaving a {t.begin - pos}-byte hole the format does not allow; {FIX}"
            )
        pos = t.end
        prev = t
    if pos != buffer_len:
        raise _err(
            f"the tensors cover {pos} bytes of data but the file holds {buffer_len} bytes "
            f"after its header ({buffer_len - pos} unexplained trailing bytes); {FIX}"
        )
    return 8 + n, meta, {t.name: t for t in infos}


def _parse_entry(name: str, entry: Any, _err) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _err(
            f"tensor {name!r}: expected an object with dtype, shape and data_offsets, "
            f"found {entry!r}; {FIX}"
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise _err(f"tensor {name!r}: the header entry lacks {', '.join(missing)}; {FIX}")
    code = entry["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        raise _err(
            f"tensor {name!r} has dtype {code!r}, which this reader does not support "
            f"(supported: {', '.join(DTYPES)}); convert the checkpoint to a supported "
            "dtype or extend eagle3_jax.checkpoint.safetensors_format.DTYPES"
        )
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _err(
            f"tensor {name!r}: expected shape to be a list of non-negative integers, "
            f"found {shape!r}; {FIX}"
        )
    offs = entry["data_offsets"]
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(_is_int(o) and o >= 0 for o in offs)
        or offs[0] > offs[1]
    ):
        raise _err(
            f"tensor {name!r}: expected data_offsets to be [begin, end] with "
            f"0 <= begin <= end, found {offs!r}; {FIX}"
        )
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    begin, end = offs
    if end - begin != expected:
        raise _err(
            f"tensor {name!r} is {code} with shape {shape}, so it needs {expected} bytes, "
            f"but its data_offsets [{begin}, {end}) span {end - begin} bytes; the header "
            f"lies about its offsets; {FIX}"
        )
    return TensorInfo(name, code, dtype, tuple(shape), begin, end)


def read_exact(fh, n: int) -> bytes:
    buf = bytearray(n)
    got = readinto_exact(fh, memoryview(buf))
    return bytes(buf[:got])


def readinto_exact(fh, view: memoryview) -> int:
    """readinto until the view is full or EOF (raw reads may come back short)."""
    total = 0
    n = len(view)
    while total < n:
        k = fh.readinto(view[total:])
        if not k:
            break
        total += k
    return total

