"""The crash-safe output file: JSONL, one complete line per finished prompt.

- Each record is appended with one ``write`` of the whole line (O_APPEND), then fsync'd, so a crash
  leaves at most one partial trailing line, which the next open cuts away.
- The generation settings live in ``OUT.settings.json`` (written atomically); reopening an output
  written with other settings is an error unless ``overwrite``: no single command could reproduce
  a file that mixes two.
- Only finished prompts count as done. Rows whose ``finish_reason`` starts with ``error``, and rows
  cut at the cache capacity (``max_len``) when ``max_len`` has changed, are removed (the kept lines
  copied into a file that replaces the old one atomically) and retried. ``max_len`` is recorded in
  the sidecar but is not part of the settings check.
- An exclusive ``flock`` keeps two jobs from appending to the same file.
- Multi-process runs: process 0 alone opens, locks and writes the output and broadcasts the finished
  ids (or its error) to the others, which write nothing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os

from eagle3_jax import distributed
from eagle3_jax.checkpoint.staging import atomic_file, write_json_atomic
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.serve.inputs import id_key
from eagle3_jax.serve.settings import describe_difference

log = logging.getLogger("eagle3_jax")

SIDECAR_SUFFIX = ".settings.json"
SIDECAR_VERSION = 1
# The finish reason of a row cut because prompt + answer filled max_len (see speculative/generate.py).
CUT_AT_CAPACITY = "max_len"


class OutputError(Eagle3Error, ValueError):
    """The output file cannot be resumed safely."""


def sidecar_path(output: str) -> str:
    return output + SIDECAR_SUFFIX


class ResumableOutput:
    """Open with ``ResumableOutput(path, fingerprint, overwrite, max_len)``; ``done`` holds the finished
    id keys, ``retried`` the keys of the failed or capacity-cut rows removed so this run retries them."""

    def __init__(self, path: str, fingerprint: dict, overwrite: bool = False, max_len: int | None = None):
        self.path = path
        self.fingerprint = fingerprint
        self.max_len = max_len
        self.done: set[str] = set()
        self.retried: set[str] = set()
        self._fd = -1
        if not distributed.is_multi_process():
            self._open(overwrite)
            return
        # Every process must skip the same prompts (they run one generation together), so the
        # others take process 0's view of the file, or its error, instead of reading it themselves.
        if distributed.is_writer():
            try:
                self._open(overwrite)
            except Exception as e:
                distributed.broadcast_json({"error": str(e)})
                raise
            distributed.broadcast_json({"done": sorted(self.done)})
        else:
            msg = distributed.broadcast_json()
            if "error" in msg:
                raise OutputError(f"{msg['error']}\n(reported by process 0, which writes the output)")
            self.done = set(msg["done"])

    @property
    def writes(self) -> bool:
        """False on the processes of a multi-process run that only follow process 0."""
        return self._fd >= 0

    def _open(self, overwrite: bool) -> None:
        path = self.path
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)   # as train.py makes its out_dir
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise OutputError(f"cannot open --output {path}: {e.strerror}") from e
        try:
            self._lock(self._fd)
            self._prepare(overwrite)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(f"{self.path} is being written by another serve.py process; wait for it or "
                              "choose another --output") from None

    # ------------------------------------------------------------------ opening
    def _prepare(self, overwrite: bool) -> None:
        if overwrite:
            # Empty the results before the new settings land: a crash in between leaves an empty
            # output, which any later run may claim.
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
        self._cut_partial_tail()
        rows = self._scan()
        finished = [r for r in rows if not r[1].startswith("error")]
        meta_path = sidecar_path(self.path)
        stored_max_len = None
        if finished:
            meta = self._read_sidecar(meta_path)
            stored = dict(meta["generation"])
            # Outputs written before max_len left the settings check hold it among the settings.
            stored_max_len = meta.get("max_len", stored.pop("max_len", None))
            diff = describe_difference(stored, self.fingerprint)
            if diff:
                raise OutputError(
                    f"{self.path} already holds {len(finished)} results generated with other settings:\n  "
                    + "\n  ".join(diff)
                    + "\nrerun with the original settings to resume, pass --overwrite to start over, or choose "
                    "another --output")
        capacity_changed = stored_max_len != self.max_len
        kept, dropped = [], []
        for key, reason, raw in rows:
            retry = reason.startswith("error") or (reason == CUT_AT_CAPACITY and capacity_changed)
            (dropped if retry else kept).append((key, reason, raw))
        if dropped:
            self._rewrite([raw for _, _, raw in kept])
            cut = sum(reason == CUT_AT_CAPACITY for _, reason, _ in dropped)
            log.info("%s: removed %d failed row(s)%s so that this run retries them", self.path, len(dropped) - cut,
                     f" and {cut} row(s) cut at the old max_len {stored_max_len}" if cut else "")
        self.done = {key for key, _, _ in kept}
        self.retried = {key for key, _, _ in dropped} - self.done
        if not kept or capacity_changed:
            write_json_atomic(meta_path, {"version": SIDECAR_VERSION, "generation": self.fingerprint,
                                          "max_len": self.max_len}, sort_keys=True)

    def _read_sidecar(self, meta_path: str) -> dict:
        """The sidecar's whole content (``generation``: the fingerprint; ``max_len``)."""
        if not os.path.isfile(meta_path):
            raise OutputError(
                f"{self.path} holds {len(self.done)} results but its settings file {meta_path} is missing, so it "
                "cannot be resumed safely; pass --overwrite to start over or choose another --output")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            if not isinstance(meta["generation"], dict):
                raise TypeError("'generation' is not an object")
            return meta
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OutputError(f"{meta_path}: unreadable settings file ({e}); pass --overwrite to start over") from e

    def _cut_partial_tail(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        # Walk back from the end to the last newline; anything after it is a line cut by a crash.
        pos, chunk = size, 1 << 16
        end_of_complete = 0
        while pos > 0:
            start = max(0, pos - chunk)
            data = os.pread(self._fd, pos - start, start)
            i = data.rfind(b"\n")
            if i >= 0:
                end_of_complete = start + i + 1
                break
            pos = start
        if end_of_complete < size:
            log.warning("%s: removing a partial last line (%d bytes) left by an interrupted run",
                        self.path, size - end_of_complete)
            os.ftruncate(self._fd, end_of_complete)
            os.fsync(self._fd)

    def _scan(self) -> list[tuple[str, str, bytes]]:
        """(id key, finish reason, the line's bytes) of every row, in file order."""
        rows = []
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                    key = id_key(rec["id"])
                except (ValueError, KeyError, TypeError) as e:
                    raise OutputError(
                        f"{self.path} line {line_no} is not a serve.py result ({e}); the file was edited or belongs "
                        "to something else: pass --overwrite to start over or choose another --output") from None
                reason = rec.get("finish_reason")
                rows.append((key, reason if isinstance(reason, str) else "", raw))
        return rows

    def _rewrite(self, lines: list[bytes]) -> None:
        """Replaces the file with ``lines`` (crash-safe: the old file stays until the new one is
        complete), then moves the lock to the new file."""
        mode = os.fstat(self._fd).st_mode & 0o777   # the output keeps its permissions
        with atomic_file(self.path, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(b"".join(lines))
        new_fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            self._lock(new_fd)
        except OutputError:
            os.close(new_fd)
            raise
        os.close(self._fd)
        self._fd = new_fd

    # ------------------------------------------------------------------ writing
    def append(self, record: dict) -> None:
        if self.writes:   # else a process that only follows process 0
            view = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        self.done.add(id_key(record["id"]))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
