"""One ``.safetensors`` file, read a tensor at a time.

The target models this project drafts for go up to about 1T parameters (2 TB of bf16 weights in
hundreds of shards), so nothing here reads a whole file: :class:`SafetensorsFile` validates only
the JSON header up front (see :mod:`safetensors_format`), then reads one tensor at a time with
``seek`` + ``readinto`` into a freshly allocated array, with no memory map left alive behind the
returned array. Peak memory is about one tensor.

It does not import torch, and it does not use the ``safetensors`` package, whose numpy loader
cannot return the F8 dtypes FP8 checkpoints store (the tests use that package only to check
interoperability).
"""

from __future__ import annotations

import difflib
import os
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

from eagle3_jax.checkpoint.safetensors_format import FIX, PathLike, TensorInfo, read_header, readinto_exact
from eagle3_jax.errors import CheckpointError


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
                header = read_header(fh, self._file_size, self.path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.path}: no such safetensors file; check the path"
            ) from None
        except IsADirectoryError:
            raise CheckpointError(
                f"{self.path}: is a directory, expected a .safetensors file; "
                "use CheckpointReader for checkpoint directories"
            ) from None
        self._header_len = header.header_len
        self._data_start = header.data_start
        self._metadata: Dict[str, str] = header.metadata
        self._infos: Dict[str, TensorInfo] = header.tensors

    def _err(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

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

    def _info(self, name: str) -> TensorInfo:
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
            got = readinto_exact(fh, memoryview(buf))
        if got != t.nbytes:
            raise self._err(
                f"tensor {t.name!r}: expected {t.nbytes} bytes at offset "
                f"{self._data_start + t.begin}, could read only {got}; the file shrank "
                f"after it was opened or {FIX}"
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

