"""Stage 1: the corpus is the Python standard library of the running interpreter.

Real code that is on every machine, so the demo needs no downloads. Files are split into train and
held-out by a hash of their path relative to the stdlib root, so the split does not depend on the
directory walk order, on the machine, or on which other files exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sysconfig
from dataclasses import dataclass

# Directories of tests (their data files and fixtures would dominate a small corpus with noise).
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
# pydoc_data/topics.py (~750 KB of one string literal) is the kind of file this keeps out.
MAX_FILE_BYTES = 200_000
HELDOUT_PER_MILLE = 20
# encodings/cp*.py & co. are 256-entry tables written by gencodec.py: data, not code.
GENERATED_MARKER = "gencodec.py"

PROMPT_MAX_CHARS = 360
PROMPT_MAX_LINES = 8
DEF_LINE = re.compile(r"^(\s*)(async\s+def|def|class)\s+\w+")


@dataclass(frozen=True)
class SourceFile:
    rel: str
    text: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(rel: str) -> bool:
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
    return h % 1000 < HELDOUT_PER_MILLE


def collect(root: str | None = None) -> list[SourceFile]:
    """Every kept *.py file under the stdlib root, sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(dirpath, name)
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if GENERATED_MARKER in text[:600] or not text.strip():
                continue
            out.append(SourceFile(os.path.relpath(path, root).replace(os.sep, "/"), text))
    out.sort(key=lambda s: s.rel)
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.rel)]
    heldout = [f for f in files if is_heldout(f.rel)]
    return train, heldout


def digest(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()


def manifest(root: str, train: list[SourceFile], heldout: list[SourceFile]) -> dict:
    def side(files):
        return {"files": len(files), "bytes": sum(len(f.text.encode()) for f in files), "sha256": digest(files)}

    return {
        "source": f"Python {platform.python_version()} standard library",
        "stdlib": root,
        "rules": {"skip_dirs": sorted(SKIP_DIRS),
                  "skip_files": f"test_*.py, > {MAX_FILE_BYTES} bytes, gencodec tables",
                  "heldout": f"sha256(relative path)[:8] as int % 1000 < {HELDOUT_PER_MILLE}"},
        "train": side(train),
        "heldout": side(heldout),
        "heldout_files": [f.rel for f in heldout],
        "train_files": [f.rel for f in train],
    }


def prompts_from(files: list[SourceFile], limit: int, prefix: str) -> list[dict]:
    """Code prompts that end right after a def/class line and its first lines of body or docstring.

    Each prompt is the few lines before the definition plus the definition header, so the
    model sees some context and is asked to continue real code.
    """
    out = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if not DEF_LINE.match(line):
                continue
            start = max(0, i - 4)
            chunk = "".join(lines[start:min(len(lines), i + 2, start + PROMPT_MAX_LINES)])
            if len(chunk) > PROMPT_MAX_CHARS or len(chunk.strip()) < 20:
                continue
            out.append({"id": f"{prefix}-{len(out):05d}", "prompt": chunk, "source": f.rel})
            if len(out) >= limit:
                return out
    return out


def spread_prompts(files: list[SourceFile], limit: int, prefix: str, per_file: int) -> list[dict]:
    """At most ``per_file`` prompts from each file (many files rather than the first few)."""
    out = []
    for f in files:
        for p in prompts_from([f], per_file, prefix):
            p["id"] = f"{prefix}-{len(out):05d}"
            out.append(p)
            if len(out) >= limit:
                return out
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
