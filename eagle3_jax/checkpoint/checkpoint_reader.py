"""A Hugging Face checkpoint directory: one ``model.safetensors``, or shards plus
``model.safetensors.index.json``, read one tensor at a time through a small pool of open files."""

from __future__ import annotations

import difflib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from eagle3_jax.checkpoint.safetensors_format import INDEX_FILE_NAME, SINGLE_FILE_NAME, PathLike
from eagle3_jax.checkpoint.safetensors_reader import SafetensorsFile
from eagle3_jax.errors import CheckpointError


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

