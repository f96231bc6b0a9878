"""The held-out code prompts: a prompt set the K chooser is judged on and never tuned on.

Drawn unlike both the demo's prompts (standard-library definition headers) and ``speedup.py``'s
third-party set (numpy, scipy, jinja2, cut the same way): each prompt is the first half of one
function or method, lines cut at a line boundary, preceded by the lines of its file just above it
(its decorators, the end of the previous definition, a class header), 200 to 1500 characters in
all. The packages are installed beside the interpreter and used by neither of those sets (nor by
the demo's training corpus, which is the standard library). One prompt per file; files in
sha256-of-path order, packages taken in turn, so the set does not lean on one package.

The set was written once to ``benchmarks/prompts/heldout_code.jsonl`` (committed, so it does not
depend on which versions are installed) before any change to the chooser was measured on it;
rerunning this script rewrites it from the installed packages:

    .venv/bin/python benchmarks/heldout_prompts.py [--num 48] [--out benchmarks/prompts/heldout_code.jsonl]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import os
import sysconfig
import warnings

from _common import REPO

PACKAGES = ("click", "networkx", "packaging", "pygments", "requests", "rich", "sortedcontainers", "tomlkit", "yaml")
MIN_CHARS, MAX_CHARS = 200, 1500
CONTEXT_LINES = 12       # at most this many lines of the file above the function
MIN_FUNCTION_LINES = 8   # a shorter function has no half worth continuing
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "prompts", "heldout_code.jsonl")


def package_files(package: str, root: str) -> list[str]:
    """The package's .py files (tests left out), relative to ``root``, in sha256-of-path order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if d not in ("tests", "test", "testing", "__pycache__"))
        files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames
                  if f.endswith(".py") and not f.startswith("test_")]
    return sorted(files, key=lambda r: hashlib.sha256(r.encode()).hexdigest())


def function_half(text: str, rel: str) -> str | None:
    """The file's first function (in sha256 of its name and line) whose context plus first half of
    its lines is MIN_CHARS..MAX_CHARS long; None when no function fits."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.end_lineno - n.lineno + 1 >= MIN_FUNCTION_LINES]
    funcs.sort(key=lambda n: hashlib.sha256(f"{rel}:{n.name}:{n.lineno}".encode()).hexdigest())
    for n in funcs:
        first = min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1   # 0-based, decorators included
        end = n.end_lineno
        half = n.lineno + (end - n.lineno) // 2                               # the header and half the body
        for context in range(CONTEXT_LINES, -1, -1):
            chunk = "".join(lines[max(0, first - context):half])
            if MIN_CHARS <= len(chunk) <= MAX_CHARS:
                return chunk
    return None


def build(num: int, packages=PACKAGES) -> list[dict]:
    root = sysconfig.get_paths()["purelib"]
    missing = [p for p in packages if not os.path.isdir(os.path.join(root, p))]
    if missing:
        raise SystemExit(f"not installed under {root}: {', '.join(missing)}")
    queues = {p: iter(package_files(p, root)) for p in packages}
    out = []
    for package in itertools.cycle(packages):
        if len(out) >= num or not queues:
            break
        if package not in queues:
            continue
        for rel in queues[package]:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                prompt = function_half(f.read(), rel)
            if prompt is not None:
                out.append({"id": f"heldout-code-{len(out):03d}", "prompt": prompt, "source": rel})
                break
        else:
            del queues[package]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=48)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    rows = build(args.num)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    sizes = sorted(len(r["prompt"]) for r in rows)
    print(f"{len(rows)} prompts -> {args.out}; {sizes[0]}..{sizes[-1]} characters, median {sizes[len(sizes) // 2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
