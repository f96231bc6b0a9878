"""Streaming reader and writer for the safetensors format, in pure numpy.

Why this exists
---------------
The target models this project drafts for go up to about 1T parameters, that is
2 TB of bf16 weights split across hundreds of shards.  Loading such a checkpoint
with a "read the whole file into a dict" API needs as much host memory as the
shard (or the model), and writing one with ``save_file(dict)`` needs every
tensor in memory at once.  This module keeps peak memory at about one tensor:

* :class:`SafetensorsFile` parses and validates only the JSON header, then reads
  one tensor at a time with ``seek`` + ``readinto`` into a freshly allocated
  array (no memory map stays alive behind the returned array).
* :class:`CheckpointReader` does the same over a Hugging Face checkpoint
  directory (one ``model.safetensors`` or shards plus
  ``model.safetensors.index.json``), with a small bounded pool of open files.
* :class:`CheckpointWriter` streams tensors to disk as they are added and
  rolls over to a new shard at a size limit.

It does not import torch, and it does not depend on the ``safetensors`` package
(the tests use that package only to check interoperability).

The format
----------
::

    [8 bytes: N, unsigned little-endian]
    [N bytes: UTF-8 JSON header, may be right-padded with spaces]
    [data buffer]

The header maps each tensor name to ``{"dtype": "F32", "shape": [..],
"data_offsets": [begin, end]}`` with offsets relative to the start of the data
buffer, plus an optional ``"__metadata__": {str: str}`` entry.  Tensor data is
little-endian and C-contiguous.  As the format specification requires, the
buffer must be entirely covered by the tensors: no holes, no overlaps, nothing
after the last tensor.  This reader enforces all of that, so a file it accepts
is a file the official implementation accepts too.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shutil
import struct
import threading
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import ml_dtypes
import numpy as np

from eagle3_jax.errors import CheckpointError

__all__ = [
    "DTYPES",
    "SINGLE_FILE_NAME",
    "INDEX_FILE_NAME",
    "SafetensorsFile",
    "CheckpointReader",
    "CheckpointWriter",
    "dtype_code",
    "parse_size",
    "shard_file_name",
]

PathLike = Union[str, "os.PathLike[str]"]

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"

#: safetensors dtype code -> numpy dtype (always little-endian).
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
_MAX_HEADER_BYTES = 100_000_000
_COPY_CHUNK = 64 * 2**20
_FIX = "the file is truncated or corrupt; re-download or re-convert it"


def dtype_code(dtype: Any) -> str:
    """Return the safetensors dtype code (``"F32"``, ``"BF16"``, ...) for a numpy dtype.

    Byte order is ignored (the writer converts to little-endian).  Raises
    :class:`CheckpointError` for dtypes the format cannot hold.
    """
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
    """Parse a byte size such as ``"5GB"``, ``"512 MiB"``, ``"1.5GiB"`` or ``1000``.

    Decimal units (KB, MB, GB, TB = 1000**k) and binary units (KiB, MiB, GiB,
    TiB = 1024**k) are accepted, case-insensitively, as is ``B`` or a bare
    number of bytes.  The result must be a whole, non-negative number of bytes.
    """
    if isinstance(size, bool):
        raise ValueError(f"expected a byte size like '5GB' or an int, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a byte size must be >= 0, got {size}")
        return size
    if not isinstance(size, str):
        raise ValueError(f"expected a byte size like '5GB' or an int, got {size!r}")
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


def _reject_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    pass


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _TensorInfo:
    __slots__ = ("name", "code", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, code: str, dtype: np.dtype, shape: Tuple[int, ...], begin: int, end: int):
        self.name = name
        self.code = code
        self.dtype = dtype
        self.shape = shape
        self.begin = begin
        self.end = end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One ``.safetensors`` file: validated header, tensors read on demand.

    The header is parsed and validated in the constructor (which opens the file
    only for that).  The data is read lazily: the first :meth:`read` opens the
    file and keeps the handle until :meth:`close` (or the end of a ``with``
    block).  Reading is thread-safe.

    :meth:`keys` lists tensor names in file (data offset) order, which is also
    the order the official writer stores them in.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh = None  # raw (unbuffered) file object, opened lazily
        try:
            with open(self.path, "rb", buffering=0) as fh:
                st = os.fstat(fh.fileno())
                self._file_size = st.st_size
                self._mtime_ns = st.st_mtime_ns
                self._parse_header(fh)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.path}: no such safetensors file; check the path"
            ) from None
        except IsADirectoryError:
            raise CheckpointError(
                f"{self.path}: is a directory, expected a .safetensors file; "
                "use CheckpointReader for checkpoint directories"
            ) from None

    # ------------------------------------------------------------------ parsing
    def _err(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def _parse_header(self, fh) -> None:
        size = self._file_size
        if size < 8:
            raise self._err(
                f"expected at least 8 bytes (the header length), found a {size}-byte file; {_FIX}"
            )
        prefix = _read_exact(fh, 8)
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise self._err(
                f"the header claims to be {n} bytes but only {size - 8} bytes follow the "
                f"8-byte length prefix; {_FIX}"
            )
        if n > _MAX_HEADER_BYTES:
            raise self._err(
                f"the header claims to be {n} bytes, more than the {_MAX_HEADER_BYTES}-byte "
                f"limit of the safetensors format; {_FIX}"
            )
        raw = _read_exact(fh, n)
        if len(raw) != n:
            raise self._err(f"expected a {n}-byte header, could read only {len(raw)} bytes; {_FIX}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._err(f"the {n}-byte header is not valid UTF-8 ({e}); {_FIX}") from None
        if not text.startswith("{"):
            raise self._err(
                f"expected the header to be a JSON object starting with '{{', found "
                f"{text[:40]!r}; this is not a safetensors file or {_FIX}"
            )
        try:
            header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except _DuplicateKey as e:
            raise self._err(f"the header lists the key {e.args[0]!r} more than once; {_FIX}") from None
        except json.JSONDecodeError as e:
            raise self._err(f"the {n}-byte header is not valid JSON ({e}); {_FIX}") from None
        if not isinstance(header, dict):
            raise self._err(f"expected the header to be a JSON object, found {type(header).__name__}; {_FIX}")

        self._header_len = n
        self._data_start = 8 + n
        buffer_len = size - self._data_start

        meta = header.pop("__metadata__", None)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._err(
                f"expected '__metadata__' to be an object of string values, found {meta!r}; {_FIX}"
            )
        self._metadata: Dict[str, str] = meta

        infos: List[_TensorInfo] = []
        for name, entry in header.items():
            infos.append(self._parse_entry(name, entry))

        # Offsets must tile the buffer exactly: sorted by position, each tensor
        # starts where the previous one ended, and the last ends at EOF.
        infos.sort(key=lambda t: (t.begin, t.end))
        for t in infos:
            if t.end > buffer_len:
                raise self._err(
                    f"tensor {t.name!r} ({t.code}, shape {list(t.shape)}) needs bytes "
                    f"[{t.begin}, {t.end}) of the data buffer, but the file has only "
                    f"{buffer_len} data bytes after its {n}-byte header "
                    f"({size} bytes in all); {_FIX}"
                )
        pos = 0
        prev: Optional[_TensorInfo] = None
        for t in infos:
            if t.begin < pos:
                raise self._err(
                    f"tensor {t.name!r} occupies bytes [{t.begin}, {t.end}) of the data buffer, "
                    f"overlapping tensor {prev.name!r} at [{prev.begin}, {prev.end}); the header "
                    f"lies about its offsets; {_FIX}"
                )
            if t.begin > pos:
                after = f"after tensor {prev.name!r} " if prev is not None else ""
                raise self._err(
                    f"expected tensor {t.name!r} to start at data offset {pos} {after}but it starts "
                    f"at {t.begin}, leaving a {t.begin - pos}-byte hole the format does not allow; {_FIX}"
                )
            pos = t.end
            prev = t
        if pos != buffer_len:
            raise self._err(
                f"the tensors cover {pos} bytes of data but the file holds {buffer_len} bytes "
                f"after its header ({buffer_len - pos} unexplained trailing bytes); {_FIX}"
            )
        self._infos: Dict[str, _TensorInfo] = {t.name: t for t in infos}

    def _parse_entry(self, name: str, entry: Any) -> _TensorInfo:
        if not isinstance(entry, dict):
            raise self._err(
                f"tensor {name!r}: expected an object with dtype, shape and data_offsets, "
                f"found {entry!r}; {_FIX}"
            )
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise self._err(f"tensor {name!r}: the header entry lacks {', '.join(missing)}; {_FIX}")
        code = entry["dtype"]
        if not isinstance(code, str) or code not in DTYPES:
            raise self._err(
                f"tensor {name!r} has dtype {code!r}, which this reader does not support "
                f"(supported: {', '.join(DTYPES)}); convert the checkpoint to a supported "
                "dtype or extend eagle3_jax.checkpoint.safetensors.DTYPES"
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self._err(
                f"tensor {name!r}: expected shape to be a list of non-negative integers, "
                f"found {shape!r}; {_FIX}"
            )
        offs = entry["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(_is_int(o) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise self._err(
                f"tensor {name!r}: expected data_offsets to be [begin, end] with "
                f"0 <= begin <= end, found {offs!r}; {_FIX}"
            )
        dtype = DTYPES[code]
        expected = math.prod(shape) * dtype.itemsize
        begin, end = offs
        if end - begin != expected:
            raise self._err(
                f"tensor {name!r} is {code} with shape {shape}, so it needs {expected} bytes, "
                f"but its data_offsets [{begin}, {end}) span {end - begin} bytes; the header "
                f"lies about its offsets; {_FIX}"
            )
        return _TensorInfo(name, code, dtype, tuple(shape), begin, end)

    # ------------------------------------------------------------------ queries
    @property
    def metadata(self) -> Dict[str, str]:
        """The header's ``__metadata__`` (``{}`` when absent)."""
        return dict(self._metadata)

    def keys(self) -> List[str]:
        """Tensor names in file order (by data offset)."""
        return list(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._infos), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{self.path}: no tensor named {name!r}{hint}") from None

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        """numpy dtype of a tensor (ml_dtypes types for BF16 and F8)."""
        return self._info(name).dtype

    def dtype_code(self, name: str) -> str:
        """safetensors dtype code of a tensor, e.g. ``"BF16"``."""
        return self._info(name).code

    def nbytes(self, name: str) -> int:
        return self._info(name).nbytes

    def data_offsets(self, name: str) -> Tuple[int, int]:
        """Absolute ``[begin, end)`` byte range of a tensor's data in the file."""
        t = self._info(name)
        return self._data_start + t.begin, self._data_start + t.end

    @property
    def is_open(self) -> bool:
        """Whether a file handle is currently held."""
        return self._fh is not None

    # ------------------------------------------------------------------ reading
    def read(self, name: str) -> np.ndarray:
        """Read one tensor from disk into a new array that owns its memory."""
        t = self._info(name)
        buf = np.empty(t.nbytes, dtype=np.uint8)
        with self._lock:
            fh = self._open()
            fh.seek(self._data_start + t.begin)
            got = _readinto_exact(fh, memoryview(buf))
        if got != t.nbytes:
            raise self._err(
                f"tensor {t.name!r}: expected {t.nbytes} bytes at offset "
                f"{self._data_start + t.begin}, could read only {got}; the file shrank "
                f"after it was opened or {_FIX}"
            )
        return buf.view(t.dtype).reshape(t.shape)

    def _open(self):
        if self._fh is None:
            fh = open(self.path, "rb", buffering=0)
            st = os.fstat(fh.fileno())
            if st.st_size != self._file_size or st.st_mtime_ns != self._mtime_ns:
                fh.close()
                raise self._err(
                    f"the file changed on disk since its header was read (size "
                    f"{self._file_size} -> {st.st_size}); open it again"
                )
            self._fh = fh
        return self._fh

    def close(self) -> None:
        """Release the file handle (the header stays available; read() reopens)."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None:
            try:
                fh.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


def _read_exact(fh, n: int) -> bytes:
    buf = bytearray(n)
    got = _readinto_exact(fh, memoryview(buf))
    return bytes(buf[:got])


def _readinto_exact(fh, view: memoryview) -> int:
    """readinto until the view is full or EOF (raw reads may come back short)."""
    total = 0
    n = len(view)
    while total < n:
        k = fh.readinto(view[total:])
        if not k:
            break
        total += k
    return total


class CheckpointReader:
    """A Hugging Face checkpoint directory of safetensors files.

    Accepted layouts, in order of preference:

    1. ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
       {name: file}}``) plus the shard files it names; or exactly one other
       ``*.safetensors.index.json``;
    2. a single ``model.safetensors``;
    3. exactly one ``*.safetensors`` file of any name.

    Several ``.safetensors`` files without an index are rejected, since there
    is no way to know they belong together.

    All headers are parsed and validated up front (headers are small), and
    every weight_map entry is checked against its shard.  Tensor data is read
    on demand; at most ``max_open_files`` files hold an open handle at a time
    (least recently used are closed first).

    ``metadata`` is the index's ``"metadata"`` for sharded checkpoints and the
    file's ``__metadata__`` for single-file ones.
    """

    def __init__(self, directory: PathLike, max_open_files: int = 4):
        self.directory = Path(directory)
        if max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1, got {max_open_files}")
        self._max_open = max_open_files
        self._lock = threading.Lock()
        self._open_lru: "OrderedDict[str, SafetensorsFile]" = OrderedDict()
        if not self.directory.is_dir():
            raise CheckpointError(
                f"{self.directory}: expected a checkpoint directory, "
                + ("found a file" if self.directory.exists() else "it does not exist")
                + "; pass the directory holding model.safetensors or model.safetensors.index.json"
            )
        index = self._find_index()
        self._files: Dict[str, SafetensorsFile] = {}
        self._weight_map: Dict[str, str] = {}
        if index is not None:
            self.index_path: Optional[Path] = index
            self._load_index(index)
        else:
            self.index_path = None
            self._load_single()

    def _find_index(self) -> Optional[Path]:
        p = self.directory / INDEX_FILE_NAME
        if p.is_file():
            return p
        others = sorted(self.directory.glob("*.safetensors.index.json"))
        if len(others) == 1:
            return others[0]
        if len(others) > 1:
            raise CheckpointError(
                f"{self.directory}: expected one safetensors index, found {len(others)} "
                f"({', '.join(o.name for o in others)}) and no {INDEX_FILE_NAME}; "
                "remove the stale ones or rename the right one to " + INDEX_FILE_NAME
            )
        return None

    def _load_single(self) -> None:
        single = self.directory / SINGLE_FILE_NAME
        if single.is_file():
            path = single
        else:
            found = sorted(p for p in self.directory.glob("*.safetensors") if p.is_file())
            if not found:
                raise CheckpointError(
                    f"{self.directory}: expected {SINGLE_FILE_NAME} or {INDEX_FILE_NAME}, found "
                    "no .safetensors files; download or convert the checkpoint into this directory"
                )
            if len(found) > 1:
                shown = ", ".join(p.name for p in found[:5]) + (" ..." if len(found) > 5 else "")
                raise CheckpointError(
                    f"{self.directory}: found {len(found)} .safetensors files ({shown}) but no "
                    f"{INDEX_FILE_NAME} saying which tensor is in which; download the index "
                    "file too, or keep exactly one .safetensors file in the directory"
                )
            path = found[0]
        f = SafetensorsFile(path)
        self._files[path.name] = f
        self._weight_map = {k: path.name for k in f.keys()}
        self._metadata = f.metadata

    def _load_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"{index}: not valid JSON ({e}); re-download or re-create the index"
            ) from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            raise CheckpointError(
                f"{index}: expected an object with a 'weight_map' of tensor name -> file name, "
                f"found {type(wm).__name__ if isinstance(data, dict) else type(data).__name__}; "
                "re-download or re-create the index"
            )
        meta = data.get("metadata") or {}
        self._metadata = dict(meta) if isinstance(meta, dict) else {}

        names = sorted(set(wm.values()))
        bad = [n for n in names if n != Path(n).name or n in ("", ".", "..")]
        if bad:
            raise CheckpointError(
                f"{index}: weight_map names files outside the checkpoint directory "
                f"({', '.join(map(repr, bad[:5]))}); expected bare file names"
            )
        missing = [n for n in names if not (self.directory / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index}: the weight_map names {len(missing)} file(s) that do not exist in "
                f"{self.directory}: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")
                + "; the download is incomplete: fetch the missing shards"
            )
        for n in names:
            self._files[n] = SafetensorsFile(self.directory / n)
        absent: List[str] = []
        for key, fname in wm.items():
            if key not in self._files[fname]:
                absent.append(f"{key!r} (in {fname})")
        if absent:
            raise CheckpointError(
                f"{index}: {len(absent)} tensor(s) in the weight_map are not in the file it "
                f"names: {', '.join(absent[:10])}" + (" ..." if len(absent) > 10 else "")
                + "; the index and shards do not belong together: re-download or re-convert"
            )
        self._weight_map = dict(wm)

    # ------------------------------------------------------------------ queries
    @property
    def files(self) -> List[Path]:
        """Paths of the safetensors files in this checkpoint (sorted by name)."""
        return [f.path for _, f in sorted(self._files.items())]

    @property
    def metadata(self) -> Dict[str, Any]:
        return dict(self._metadata)

    def keys(self) -> List[str]:
        """All tensor names, sorted."""
        return sorted(self._weight_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._files[self._weight_map[name]]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._weight_map), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{self.directory}: no tensor named {name!r}{hint}") from None

    def file_of(self, name: str) -> Path:
        """Path of the file holding a tensor."""
        return self._file(name).path

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).dtype(name)

    def dtype_code(self, name: str) -> str:
        return self._file(name).dtype_code(name)

    def nbytes(self, name: str) -> int:
        return self._file(name).nbytes(name)

    def total_bytes(self) -> int:
        """Total tensor data bytes in the checkpoint."""
        return sum(self.nbytes(k) for k in self._weight_map)

    # ------------------------------------------------------------------ reading
    def read(self, name: str) -> np.ndarray:
        """Read one tensor into a new, owned array."""
        f = self._file(name)
        with self._lock:
            self._open_lru[f.path.name] = f
            self._open_lru.move_to_end(f.path.name)
            while len(self._open_lru) > self._max_open:
                _, old = self._open_lru.popitem(last=False)
                old.close()
        return f.read(name)

    def iter_tensors(self, names: Optional[Iterable[str]] = None) -> Iterator[Tuple[str, np.ndarray]]:
        """Yield ``(name, array)`` one at a time, in disk order (file, then offset).

        Reading in disk order keeps access sequential; only one tensor is held
        by this generator at a time.
        """
        wanted = self.keys() if names is None else list(names)
        for n in wanted:
            self._file(n)  # KeyError early for unknown names
        order = {fname: i for i, fname in enumerate(sorted(self._files))}

        def pos(n: str) -> Tuple[int, int]:
            f = self._file(n)
            return order[f.path.name], f.data_offsets(n)[0]

        for n in sorted(wanted, key=pos):
            yield n, self.read(n)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._open_lru.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.directory)!r}, {len(self)} tensors in {len(self._files)} files)"


class CheckpointWriter:
    """Stream tensors into a Hugging Face safetensors checkpoint directory.

    ``add(name, array)`` appends the tensor's bytes to a temporary data file for
    the current shard right away, so peak memory is about one tensor (plus one
    contiguous little-endian copy if the input is not already one).  When the
    next tensor would push the shard's data past ``max_shard_bytes``, the shard
    is finished: its header is written to a temporary shard file followed by the
    data, copied in 64 MiB chunks, and the data file is deleted.  A tensor
    larger than the limit gets a shard of its own.  Disk overhead is therefore
    one shard's worth of temporary space.

    ``close()`` renames the shards to ``model-00001-of-0000N.safetensors`` (or
    ``model.safetensors`` when there is only one) and, when sharded, writes
    ``model.safetensors.index.json`` with ``{"metadata": {"total_size": ...},
    "weight_map": {...}}`` last, so an index on disk means the shards are
    complete.  Leaving a ``with`` block by an exception deletes the temporary
    files and writes nothing.

    Layout of each file, matching the official ``safetensors`` writer:

    * header JSON is compact (``","`` and ``":"`` separators, non-ASCII kept as
      UTF-8), ``"__metadata__"`` first, then tensors in data order, each as
      ``{"dtype", "shape", "data_offsets"}``;
    * the header is right-padded with spaces to a multiple of 8 bytes, so the
      data buffer starts 8-byte aligned;
    * tensors are stored back to back (no padding, as the format requires) in
      the order they were added.  The official writer instead sorts tensors by
      dtype size (largest first), then by name, which keeps every tensor
      naturally aligned; this writer cannot reorder a stream, so add large-dtype
      tensors first if alignment matters.  Adding tensors in the official order
      with the same metadata reproduces an officially written file byte for byte.

    ``metadata``: ``None`` (default) writes ``{"format": "pt"}`` (what
    transformers expects); ``{}`` writes no ``__metadata__``; any other dict of
    str -> str is written as given to every shard's header.
    """

    def __init__(
        self,
        directory: PathLike,
        max_shard_bytes: Union[int, str] = 5 * 2**30,
        metadata: Optional[Mapping[str, str]] = None,
        overwrite: bool = False,
    ):
        self.directory = Path(directory)
        self.max_shard_bytes = parse_size(max_shard_bytes)
        if self.max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes!r}")
        if metadata is None:
            metadata = {"format": "pt"}
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise CheckpointError(
                f"metadata must map str to str (the safetensors format stores only strings), "
                f"got {metadata!r}; convert the values with str() or json.dumps()"
            )
        self.metadata: Dict[str, str] = dict(metadata)
        self.overwrite = overwrite
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = self._existing_checkpoint_files()
        if existing and not overwrite:
            raise CheckpointError(
                f"{self.directory}: already holds a checkpoint ({', '.join(p.name for p in existing[:5])}); "
                "write to an empty directory or pass overwrite=True"
            )
        self._names: set = set()
        # finished shards: (temp path, [(name, nbytes)])
        self._done: List[Tuple[Path, List[Tuple[str, int]]]] = []
        self._cur: List[Tuple[str, str, Tuple[int, ...], int, int]] = []  # name, code, shape, begin, end
        self._cur_bytes = 0
        self._data_fh = None
        self._data_path: Optional[Path] = None
        self._closed = False
        self._written: List[Path] = []
        self._tag = f".eagle3-tmp-{os.getpid()}-{id(self):x}"

    def _existing_checkpoint_files(self) -> List[Path]:
        pat = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
        out = []
        for p in sorted(self.directory.iterdir()):
            if p.name in (SINGLE_FILE_NAME, INDEX_FILE_NAME) or pat.fullmatch(p.name):
                out.append(p)
        return out

    # ------------------------------------------------------------------ adding
    def add(self, name: str, array: Any) -> None:
        """Write one tensor now.  ``array`` is anything ``np.asarray`` accepts."""
        if self._closed:
            raise CheckpointError(f"{self.directory}: add({name!r}) after close(); open a new writer")
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        if name == "__metadata__":
            raise CheckpointError("'__metadata__' is reserved by the safetensors format; rename the tensor")
        if name in self._names:
            raise CheckpointError(
                f"{self.directory}: tensor {name!r} was already added; each name may be written "
                "once, so check the caller for a duplicated or mis-renamed parameter"
            )
        arr = np.asarray(array)
        try:
            code = dtype_code(arr.dtype)
        except CheckpointError as e:
            raise CheckpointError(f"tensor {name!r}: {e}") from None
        dt = DTYPES[code]
        shape = tuple(int(d) for d in arr.shape)
        if arr.dtype != dt:  # big-endian input
            arr = arr.astype(dt)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        nbytes = arr.nbytes
        if self._cur and self._cur_bytes + nbytes > self.max_shard_bytes:
            self._finish_shard()
        if self._data_fh is None:
            self._data_path = self.directory / f"{self._tag}-{len(self._done) + 1:05d}.data"
            self._data_fh = open(self._data_path, "wb")
        if nbytes:
            self._data_fh.write(memoryview(arr.reshape(-1).view(np.uint8)))
        begin = self._cur_bytes
        self._cur_bytes += nbytes
        self._cur.append((name, code, shape, begin, self._cur_bytes))
        self._names.add(name)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    # ------------------------------------------------------------------ shards
    def _header_bytes(self) -> bytes:
        header: Dict[str, Any] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        for name, code, shape, begin, end in self._cur:
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return raw + b" " * (-len(raw) % 8)

    def _finish_shard(self) -> None:
        if self._data_fh is None:
            self._data_path = self.directory / f"{self._tag}-{len(self._done) + 1:05d}.data"
            open(self._data_path, "wb").close()
        else:
            self._data_fh.close()
            self._data_fh = None
        header = self._header_bytes()
        shard_path = self.directory / f"{self._tag}-{len(self._done) + 1:05d}.safetensors"
        with open(shard_path, "wb") as out, open(self._data_path, "rb") as src:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(src, out, _COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self._data_path)
        self._data_path = None
        self._done.append((shard_path, [(c[0], c[4] - c[3]) for c in self._cur]))
        self._cur = []
        self._cur_bytes = 0

    def close(self) -> List[Path]:
        """Finish the last shard, name the files, write the index; return the paths written."""
        if self._closed:
            return list(self._written)
        try:
            if self._cur or not self._done:
                self._finish_shard()
            total = len(self._done)
            if self.overwrite:
                for p in self._existing_checkpoint_files():
                    p.unlink()
            weight_map: Dict[str, str] = {}
            total_size = 0
            for i, (tmp, entries) in enumerate(self._done, start=1):
                final = self.directory / (SINGLE_FILE_NAME if total == 1 else shard_file_name(i, total))
                os.replace(tmp, final)
                self._written.append(final)
                for name, nb in entries:
                    weight_map[name] = final.name
                    total_size += nb
            if total > 1:
                index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
                tmp = self.directory / f"{self._tag}.index.json"
                tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
                final = self.directory / INDEX_FILE_NAME
                os.replace(tmp, final)
                self._written.append(final)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return list(self._written)

    @property
    def files(self) -> List[Path]:
        """Paths written by close() (empty before)."""
        return list(self._written)

    def abort(self) -> None:
        """Delete temporary files and write nothing further."""
        self._closed = True
        if self._data_fh is not None:
            self._data_fh.close()
            self._data_fh = None
        for p in list(self.directory.glob(f"{self._tag}*")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self._done = []
        self._cur = []

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"CheckpointWriter({str(self.directory)!r}, {len(self)} tensors)"
