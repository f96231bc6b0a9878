"""Writes that never leave a half-written result under the final name: a directory
(:func:`staged_dir`) or one file (:func:`atomic_file`, :func:`write_json_atomic`), built beside it
and renamed into place, so readers see the old result or the new one, never a prefix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Union

from eagle3_jax.errors import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]


def current_umask() -> int:
    # os.umask can only be read by setting it; put it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_dir(dst: PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yields a fresh, empty ``DST.tmp-XXXX`` beside DST; renamed to DST when the block succeeds.
    DST must not exist unless ``overwrite``; then the old DST is swapped out only once the new one
    is complete. On any exception the staging directory is deleted and DST is left as it was."""
    dst = Path(dst)
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise CheckpointError(f"{dst} already exists; remove it, choose another output directory, "
                              "or ask for overwrite (--overwrite on the command line)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        # an ordinary mkdir's permissions, not mkdtemp's private 0700: the checkpoint is meant to be shared
        os.chmod(tmp, 0o777 & ~current_umask())
        yield tmp
        if dst.exists() or dst.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=dst.name + ".old-", dir=dst.parent))
            os.rmdir(old)  # only the unique name is wanted
            os.rename(dst, old)
            os.rename(tmp, dst)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: PathLike, mode: str = "w", fsync: bool = True) -> Iterator[IO]:
    """Yields a file opened (``mode`` "w" or "wb") on ``PATH.tmp-PID``; replaces PATH when the block
    succeeds, removes the temporary file when it fails. ``fsync`` also flushes the data and the
    directory entry to disk, so the new contents survive a power cut once the block has returned."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes whole files: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:  # the directory entry too
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_atomic(path: PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = False,
                      fsync: bool = True) -> None:
    """``obj`` as JSON (ending in a newline) at ``path``, atomically (see :func:`atomic_file`)."""
    with atomic_file(path, "w", fsync=fsync) as f:
        json.dump(obj, f, indent=indent, sort_keys=sort_keys)
        f.write("\n")
