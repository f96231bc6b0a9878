"""Stage 1: the corpus is the Python standard library of the running interpreter.

Real code that is on every machine, so the demo needs no downloads. What is kept:

* library modules: every ``*.py`` file outside test directories, up to ``MAX_FILE_BYTES``;
* test modules (``test/``, ``tests/``, ``idle_test/`` and ``test_*.py``) up to ``MAX_TEST_FILE_BYTES``:
  small test modules are ordinary code that uses the library, while the large ones are mostly
  long tables of cases and would crowd out the library in a short training run;
* only files that parse as Python (``ast.parse``): intentionally broken fixtures
  (``badsyntax_*.py``, Python 2 sources kept as test data) are not real source;
* no generated codec tables (written by gencodec.py: data, not code) and no empty files.

Duplicates are removed before the split, keeping the first file in path order: exact copies (same
sha256 of the text) and near copies (same sha256 after every run of whitespace is collapsed to one
space, e.g. a file re-indented or with trailing spaces).

The held-out split is by *module*: each file belongs to a group named after its top-level package
or module (``email/mime/text.py`` -> ``email``), and a test module to the module it tests
(``test/test_json/...`` and ``test/test_json.py`` -> ``json``), so a held-out package is unseen
together with its tests. Groups are visited in the order of sha256(name) and taken while the
held-out library bytes stay under ``HELDOUT_MAX`` of all library bytes, until they reach
``HELDOUT_TARGET``. The held-out set is the library files of those groups; their test files are
left out of both sides (the eval measures library code, as the prompts do). Nothing depends on
the directory walk order or the machine, only on which files the interpreter ships.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import sysconfig
import warnings
from dataclasses import dataclass

TEST_DIRS = {"test", "tests", "idle_test"}
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# pydoc_data/topics.py (~750 KB of one string literal) is the kind of file this keeps out.
MAX_FILE_BYTES = 200_000
MAX_TEST_FILE_BYTES = 20_000
HELDOUT_TARGET = 0.025
HELDOUT_MAX = 0.03
# encodings/cp*.py & co. are 256-entry tables written by gencodec.py: data, not code.
GENERATED_MARKER = "gencodec.py"

PROMPT_MAX_CHARS = 360
PROMPT_MAX_LINES = 8
DEF_LINE = re.compile(r"^(\s*)(async\s+def|def|class)\s+\w+")


@dataclass(frozen=True)
class SourceFile:
    rel: str
    text: str
    is_test: bool = False

    @property
    def module(self) -> str:
        return module_of(self.rel)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_test_path(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def module_of(rel: str) -> str:
    """The split group: the top-level package or module, and for the stdlib's own ``test`` package
    the module a test is about (``test/test_json/__init__.py`` -> ``json``)."""
    parts = rel.split("/")
    top = parts[0].removesuffix(".py")
    if top == "test" and len(parts) > 1:
        name = parts[1].removesuffix(".py")
        if name.startswith("test_"):
            return name[len("test_"):]
    return top


def _parses(text: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old test data
            ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


def collect(root: str | None = None) -> tuple[list[SourceFile], dict]:
    """Every kept *.py file under the stdlib root, sorted by relative path, and the count of files
    left out for each reason."""
    root = root or stdlib_root()
    out, dropped = [], {"too_large": 0, "not_utf8": 0, "generated": 0, "empty": 0, "unparsable": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            test = is_test_path(rel)
            if os.path.getsize(path) > (MAX_TEST_FILE_BYTES if test else MAX_FILE_BYTES):
                dropped["too_large"] += 1
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                dropped["not_utf8"] += 1
                continue
            reason = ("empty" if not text.strip() else "generated" if GENERATED_MARKER in text[:600]
                      else None if _parses(text) else "unparsable")
            if reason:
                dropped[reason] += 1
                continue
            out.append(SourceFile(rel, text, test))
    out.sort(key=lambda s: s.rel)
    return out, dropped


def dedupe(files: list[SourceFile]) -> tuple[list[SourceFile], dict]:
    """Drops exact and whitespace-only copies of an earlier file (in path order)."""
    exact, near, kept = set(), set(), []
    counts = {"exact_duplicates": 0, "near_duplicates": 0}
    for f in files:
        h = hashlib.sha256(f.text.encode()).digest()
        n = hashlib.sha256(" ".join(f.text.split()).encode()).digest()
        if h in exact:
            counts["exact_duplicates"] += 1
        elif n in near:
            counts["near_duplicates"] += 1
        else:
            kept.append(f)
        exact.add(h)
        near.add(n)
    return kept, counts


def heldout_modules(files: list[SourceFile]) -> list[str]:
    """The held-out groups: visited in sha256(name) order, taken while they fit (see the docstring)."""
    lib_bytes: dict[str, int] = {}
    for f in files:
        if not f.is_test:
            lib_bytes[f.module] = lib_bytes.get(f.module, 0) + len(f.text.encode())
    total = sum(lib_bytes.values())
    picked, held = [], 0
    for name in sorted(lib_bytes, key=lambda m: hashlib.sha256(m.encode()).hexdigest()):
        if held >= HELDOUT_TARGET * total:
            break
        if held + lib_bytes[name] <= HELDOUT_MAX * total:
            picked.append(name)
            held += lib_bytes[name]
    return sorted(picked)


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile], list[SourceFile]]:
    """(train, held-out, left out): the held-out groups' library files are held out and their test
    files left out; everything else trains."""
    held = set(heldout_modules(files))
    train = [f for f in files if f.module not in held]
    heldout = [f for f in files if f.module in held and not f.is_test]
    left_out = [f for f in files if f.module in held and f.is_test]
    return train, heldout, left_out


def build(root: str | None = None) -> tuple[list[SourceFile], list[SourceFile], dict]:
    """collect -> dedupe -> split: (train, held-out, counts for the manifest)."""
    files, dropped = collect(root)
    files, dups = dedupe(files)
    train, heldout, left_out = split(files)
    counts = {"kept": len(files), **dropped, **dups, "heldout_module_tests_left_out": len(left_out)}
    return train, heldout, counts


def digest(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()


def manifest(root: str, train: list[SourceFile], heldout: list[SourceFile], counts: dict) -> dict:
    def side(files):
        tests = [f for f in files if f.is_test]
        return {"files": len(files), "bytes": sum(len(f.text.encode()) for f in files), "sha256": digest(files),
                "test_files": len(tests), "test_bytes": sum(len(f.text.encode()) for f in tests)}

    return {
        "source": f"Python {platform.python_version()} standard library",
        "stdlib": root,
        "rules": {"skip_dirs": sorted(SKIP_DIRS),
                  "test_files": f"in {sorted(TEST_DIRS)} or named test_*.py; kept up to {MAX_TEST_FILE_BYTES} bytes",
                  "skip_files": f"library files > {MAX_FILE_BYTES} bytes, gencodec tables, empty, not parsable",
                  "dedupe": "exact (sha256 of the text) and near (sha256 of the whitespace-collapsed text) copies "
                            "of an earlier file in path order",
                  "heldout": f"whole modules (top-level package; test_X -> X) in sha256(name) order until "
                             f"{HELDOUT_TARGET:.1%} of library bytes (at most {HELDOUT_MAX:.0%}); their test files "
                             "are in neither side"},
        "counts": counts,
        "train": side(train),
        "heldout": side(heldout),
        "heldout_modules": sorted({f.module for f in heldout}),
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
