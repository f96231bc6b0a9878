"""The speedup matrix of this checkout beside an earlier commit's, side by side in one run.

Every cell (prompt set, temperature, batch size) runs ``speedup.py`` once per commit, each in a
process of its own, the two commits one after the other in an order that alternates from cell to
cell. A process holds one cell's programs only: XLA:CPU maps every compiled kernel separately, and a
whole matrix in one process ran out of memory mappings (vm.max_map_count) mid-run.

Both commits are checked out into temporary worktrees (edits made meanwhile reach neither) and
measured with this checkout's harness (``speedup.py``, ``_common.py``, the held-out prompt file) over its own library and its own
``demo/`` folder, so the two differ in the library only. What is compared is each process's own
ratio against target-only, paired pass by pass inside that process; two processes' tok/s are not
paired (load moves between them), their ratios are.

    .venv/bin/python benchmarks/versus.py --against 163ab83 [--prompts demo,thirdparty,heldout]
        [--batch 1,8] [--temperature 0,1] [--k 2,4] [--num-prompts 8] [--max-new-tokens 64]
        [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

from _common import REPO, load_average, machine, parse_list, table

HARNESS = ("benchmarks/speedup.py", "benchmarks/_common.py", "benchmarks/prompts/heldout_code.jsonl")


def short(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def checkout(rev: str, where: str) -> str:
    """A detached worktree of ``rev`` at ``where``, carrying this checkout's harness."""
    subprocess.run(["git", "worktree", "add", "--detach", "--force", where, rev], cwd=REPO, check=True,
                   capture_output=True, text=True)
    for rel in HARNESS:
        os.makedirs(os.path.dirname(os.path.join(where, rel)), exist_ok=True)
        shutil.copyfile(REPO / rel, os.path.join(where, rel))
    return where


def run_cell(root: str, prompts: str, batch: int, temperature: float, args, out_json: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(root, "benchmarks", "speedup.py"), "--demo-dir", os.path.join(root, "demo"),
           "--prompts", prompts, "--batch", str(batch), "--temperature", f"{temperature:g}", "--k", args.k,
           "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--repeats", str(args.repeats), "--parallel-draft", "none", "--dflash-draft", "none", "--json", out_json]
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if not os.path.exists(out_json):
        raise SystemExit(f"speedup.py failed in {root} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out_json) as f:
        return json.load(f)["rows"]


def side_by_side(before: list[dict], after: list[dict]) -> list[list]:
    def key(r):
        return r["prompts"], r["batch"], r["temperature"], r["mode"]

    old = {key(r): r for r in before}
    body = []
    for r in after:
        b = old.get(key(r))
        if b is None:
            continue

        def auto(x):
            return f"{x['chosen_k']} ({', '.join(f'{k}:{n}' for k, n in sorted(x['iterations_per_k'].items()))})" \
                if "chosen_k" in x else ""

        def same(x):
            return f"{x['identical']}/{x['num_prompts']}" if "identical" in x else "-"

        body.append([r["prompts"], r["batch"], f"{r['temperature']:g}", r["mode"],
                     f"{b['speedup']:.3f}", f"{r['speedup']:.3f}", f"{r['speedup'] / b['speedup']:.2f}",
                     f"{min(b['speedup_runs']):.2f}–{max(b['speedup_runs']):.2f}",
                     f"{min(r['speedup_runs']):.2f}–{max(r['speedup_runs']):.2f}",
                     f"{b['tau']:.2f} / {r['tau']:.2f}", f"{same(b)} / {same(r)}", auto(b), auto(r)])
    return body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="163ab83", help="the earlier commit")
    ap.add_argument("--after", default="HEAD", help="the later commit (checked out too, so edits made while "
                                                     "this runs do not reach it)")
    ap.add_argument("--prompts", default="demo,thirdparty,heldout")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--temperature", default="0,1")
    ap.add_argument("--k", default="2,4", help="fixed Ks run beside target-only and auto")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    after_rev = short(args.after)
    before, after = [], []
    with tempfile.TemporaryDirectory(prefix="versus_") as tmp:
        old_root = checkout(args.against, os.path.join(tmp, "before"))
        new_root = checkout(after_rev, os.path.join(tmp, "after"))
        try:
            cells = [(p, t, b) for p in args.prompts.split(",") for t in parse_list(args.temperature, float)
                     for b in parse_list(args.batch)]
            for i, (p, t, b) in enumerate(cells):
                order = [("before", old_root), ("after", new_root)]
                for label, root in (order if i % 2 == 0 else order[::-1]):
                    rows = run_cell(root, p, b, t, args, os.path.join(tmp, f"{label}_{i}.json"))
                    (before if label == "before" else after).extend(rows)
                    print(f"  {p} B={b} T={t:g} {label}: done, load {load_average()}", file=sys.stderr, flush=True)
        finally:
            for root in (old_root, new_root):
                subprocess.run(["git", "worktree", "remove", "--force", root], cwd=REPO, capture_output=True)
    headers = ["prompts", "B", "T", "mode", f"× target-only, {args.against}", f"× target-only, {after_rev}",
               "after / before", f"× range, {args.against}", f"× range, {after_rev}", "τ before / after",
               "identical before / after", f"auto K (iterations), {args.against}", f"auto K (iterations), {after_rev}"]
    print(f"{machine()}, load average {load_average()}; before {args.against}, after {after_rev}; "
          f"{args.num_prompts} prompts a set, {args.max_new_tokens} new tokens, median of {args.repeats} "
          f"interleaved passes; one process per commit and cell")
    print(table(headers, side_by_side(before, after)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                       "args": vars(args), "before": before, "after": after, "after_commit": after_rev}, f,
                      indent=1, default=str)
    bad = [r for r in before + after if r.get("identical", r["num_prompts"]) != r["num_prompts"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
