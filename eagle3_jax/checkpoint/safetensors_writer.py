"""Streams tensors into a Hugging Face safetensors checkpoint directory (:class:`CheckpointWriter`).

Not the ``safetensors`` package's writer: ``save_file`` takes a whole shard's tensors in one dict
(all in host memory at once) and reorders them. This one appends each tensor to disk as it arrives
and rolls over to a new shard at a size limit; its files are byte-identical to the package's for
the same tensors added in the package's order (tests/test_safetensors_io.py checks this).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from eagle3_jax.checkpoint.safetensors_format import (DTYPES, INDEX_FILE_NAME, SINGLE_FILE_NAME, PathLike,
                                                      dtype_code, parse_size, shard_file_name)
from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.errors import CheckpointError

_COPY_CHUNK = 64 * 2**20


class CheckpointWriter:
    """A shard is finished (header, then its temporary data file copied after it) when the next
    tensor would push it past ``max_shard_bytes``; a larger tensor gets a shard of its own.
    ``close()`` names the shards (``model.safetensors`` when only one) and writes the index last,
    so an index on disk means the shards are complete; leaving a ``with`` block by an exception
    deletes the temporary files and writes nothing. The official writer sorts tensors by dtype
    size, then name: add them in that order to reproduce its files.

    ``metadata``: ``None`` writes ``{"format": "pt"}`` (what transformers expects); ``{}`` writes
    no ``__metadata__``; any other dict of str -> str is written to every shard's header.
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
        return [p for p in sorted(self.directory.iterdir())
                if p.name in (SINGLE_FILE_NAME, INDEX_FILE_NAME) or pat.fullmatch(p.name)]

    def add(self, name: str, array: Any) -> None:
        """``array``: anything ``np.asarray`` accepts."""
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
        shape = tuple(int(d) for d in arr.shape)
        arr = np.ascontiguousarray(arr, dtype=DTYPES[code])  # little-endian, C order
        nbytes = arr.nbytes
        if self._cur and self._cur_bytes + nbytes > self.max_shard_bytes:
            self._finish_shard()
        if nbytes:
            self._data().write(memoryview(arr.reshape(-1).view(np.uint8)))
        begin = self._cur_bytes
        self._cur_bytes += nbytes
        self._cur.append((name, code, shape, begin, self._cur_bytes))
        self._names.add(name)

    def _data(self):
        """The current shard's temporary data file, opened on first use."""
        if self._data_fh is None:
            self._data_path = self.directory / f"{self._tag}-{len(self._done) + 1:05d}.data"
            self._data_fh = open(self._data_path, "wb")
        return self._data_fh

    def _header_bytes(self) -> bytes:
        header: Dict[str, Any] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        for name, code, shape, begin, end in self._cur:
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return raw + b" " * (-len(raw) % 8)

    def _finish_shard(self) -> None:
        self._data().close()
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
                final = self.directory / INDEX_FILE_NAME
                write_json_atomic(final, index)
                self._written.append(final)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return list(self._written)

    @property
    def files(self) -> List[Path]:   # written by close(), empty before
        return list(self._written)

    def abort(self) -> None:
        """Delete temporary files and write nothing further."""
        self._closed = True
        if self._data_fh is not None:
            self._data_fh.close()
            self._data_fh = None
        for p in list(self.directory.glob(f"{self._tag}*")):
            p.unlink(missing_ok=True)
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
        return f"CheckpointWriter({str(self.directory)!r}, {len(self._names)} tensors)"
