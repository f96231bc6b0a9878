"""Reading safetensors a tensor at a time: one file (:class:`SafetensorsFile`) or a Hugging Face
checkpoint directory of them (:class:`CheckpointReader`).

Targets reach about 1T parameters (2 TB in hundreds of shards), so nothing reads a whole file: only
the headers are read up front (and validated, see :mod:`safetensors_format`); each tensor is read
with ``seek`` + ``readinto`` into a fresh array that owns its memory (no memory map behind it).
The ``safetensors`` package is not used: its numpy loader cannot return the F8 dtypes FP8
checkpoints store.
"""

from __future__ import annotations

import difflib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from eagle3_jax.checkpoint.safetensors_format import (FIX, INDEX_FILE_NAME, SINGLE_FILE_NAME, PathLike, TensorInfo,
                                                      read_header, readinto_exact)
from eagle3_jax.errors import CheckpointError


class _Tensors:
    """The header queries one file and a checkpoint directory share: ``_names`` holds every tensor
    name, ``_where`` is named in errors, ``_info(name)`` gives a tensor's TensorInfo."""

    @property
    def metadata(self) -> Dict[str, Any]:
        return dict(self._metadata)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _check(self, name: str) -> None:
        if name not in self._names:
            close = difflib.get_close_matches(str(name), list(self._names), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{self._where}: no tensor named {name!r}{hint}")

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:   # ml_dtypes types for BF16 and F8
        return self._info(name).dtype

    def dtype_code(self, name: str) -> str:   # e.g. "BF16"
        return self._info(name).code

    def nbytes(self, name: str) -> int:
        return self._info(name).nbytes

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsFile(_Tensors):
    """One ``.safetensors`` file: the header is validated in the constructor; the first :meth:`read`
    opens the file and keeps the handle until :meth:`close`. Reading is thread-safe."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh = None  # raw (unbuffered), opened by the first read
        try:
            with open(self.path, "rb", buffering=0) as fh:
                st = os.fstat(fh.fileno())
                self._file_size = st.st_size
                self._mtime_ns = st.st_mtime_ns
                self._data_start, self._metadata, self._names = read_header(fh, self._file_size, self.path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.path}: no such safetensors file; check the path"
            ) from None
        except IsADirectoryError:
            raise CheckpointError(
                f"{self.path}: is a directory, expected a .safetensors file; "
                "use CheckpointReader for checkpoint directories"
            ) from None
        self._where = self.path

    def _err(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def keys(self) -> List[str]:
        """Tensor names in file order (by data offset)."""
        return list(self._names)

    def _info(self, name: str) -> TensorInfo:
        self._check(name)
        return self._names[name]

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

    def __del__(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None:
            try:
                fh.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


class CheckpointReader(_Tensors):
    """A Hugging Face checkpoint directory of safetensors files.

    Accepted layouts, in order of preference: ``model.safetensors.index.json`` (or exactly one
    other ``*.safetensors.index.json``) plus the shards it names; a single ``model.safetensors``;
    exactly one ``*.safetensors`` of any name. Several ``.safetensors`` without an index are
    rejected: nothing says they belong together.

    All headers are validated up front, and every weight_map entry against its shard. At most
    ``max_open_files`` files hold an open handle at a time (least recently used closed first).
    ``metadata`` is the index's ``"metadata"``, or a single file's ``__metadata__``.
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
        self._where = self.directory
        self._files: Dict[str, SafetensorsFile] = {}
        self.index_path: Optional[Path] = self._find_index()
        if self.index_path is not None:
            self._load_index(self.index_path)
        else:
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
        self._names = {k: path.name for k in f.keys()}
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
        absent = [f"{key!r} (in {fname})" for key, fname in wm.items() if key not in self._files[fname]]
        if absent:
            raise CheckpointError(
                f"{index}: {len(absent)} tensor(s) in the weight_map are not in the file it "
                f"names: {', '.join(absent[:10])}" + (" ..." if len(absent) > 10 else "")
                + "; the index and shards do not belong together: re-download or re-convert"
            )
        self._names = dict(wm)

    @property
    def files(self) -> List[Path]:
        """Paths of the safetensors files in this checkpoint (sorted by name)."""
        return [f.path for _, f in sorted(self._files.items())]

    def keys(self) -> List[str]:
        """All tensor names, sorted."""
        return sorted(self._names)

    def _file(self, name: str) -> SafetensorsFile:
        self._check(name)
        return self._files[self._names[name]]

    def _info(self, name: str) -> TensorInfo:
        return self._file(name)._info(name)

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._names)

    def read(self, name: str) -> np.ndarray:
        f = self._file(name)
        with self._lock:
            self._open_lru[f.path.name] = f
            self._open_lru.move_to_end(f.path.name)
            while len(self._open_lru) > self._max_open:
                _, old = self._open_lru.popitem(last=False)
                old.close()
        return f.read(name)

    def iter_tensors(self, names: Optional[Iterable[str]] = None) -> Iterator[Tuple[str, np.ndarray]]:
        """Yield ``(name, array)`` one at a time in disk order (file, then offset): sequential
        reads, one tensor held at a time."""
        wanted = self.keys() if names is None else list(names)
        for n in wanted:
            self._check(n)  # KeyError early for unknown names
        order = {fname: i for i, fname in enumerate(sorted(self._files))}
        for n in sorted(wanted, key=lambda n: (order[self._names[n]], self._info(n).begin)):
            yield n, self.read(n)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._open_lru.clear()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.directory)!r}, {len(self)} tensors in {len(self._files)} files)"
