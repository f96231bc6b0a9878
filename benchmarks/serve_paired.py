"""``serve.py`` as a user runs it, mode against mode in paired passes: target-only, fixed Ks and the
default K (``auto``), on one prompt file, at each batch size.

Each pass is one whole ``serve.py`` job (``eagle3_jax.serve.cli.run``: a fresh engine and chooser,
its own output and ``--metrics`` file) on the models loaded once, with the persistent compile cache
on as serve.py turns it on (in a fresh directory unless --cache names one), so a pass costs what a
rerun of serve.py costs. One untimed pass per mode compiles (and under auto, if nothing is kept
from earlier jobs, probes and keeps what it measured: the "first job" line); then --repeats rounds
run every mode once, the order rotating. A mode's tok/s is serve's own
(tokens / generating seconds, compiles left out); its × target-only is the median over rounds of
its pass / target-only's pass in the same round (paired: load that drifts between rounds cancels),
with their range. Texts must equal target-only's (greedy is lossless).

    .venv/bin/python benchmarks/serve_paired.py [--prompts benchmarks/prompts/heldout_code.jsonl]
        [--num-prompts 16] [--max-new-tokens 96] [--batch 1,8] [--k 1,2,4] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import os
import statistics
import sys
import tempfile

from _common import REPO, load_average, machine, parse_list, quiet_watchdog, table

import jax

import eagle3_jax as e3
from eagle3_jax import compile_cache
from eagle3_jax.serve import cli
from eagle3_jax.serve.settings import ServeSettings

DEFAULT_PROMPTS = os.path.join(REPO, "benchmarks", "prompts", "heldout_code.jsonl")


def mode_name(k) -> str:
    return "target-only" if k == 0 else "auto (default)" if k == "auto" else f"K={k}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", default="1,2,4")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", default=None, help="the project cache directory (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ[compile_cache.CACHE_ENV] = args.cache or tempfile.mkdtemp(prefix="serve_paired_cache_")
    compile_cache.enable()
    target_dir, draft_dir = os.path.join(args.demo_dir, "target"), os.path.join(args.demo_dir, "draft")
    target = e3.load_target(target_dir, dtype="float32")
    draft = e3.load_draft(draft_dir, target)
    modes = [0] + parse_list(args.k) + ["auto"]
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp, quiet_watchdog():
        prompts = os.path.join(tmp, "prompts.jsonl")
        with open(args.prompts) as src, open(prompts, "w") as dst:
            dst.writelines(src.readlines()[:args.num_prompts])

        def serve_once(k, batch: int, tag: str) -> dict:
            out, metrics = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.metrics.json")
            s = ServeSettings(target=target_dir, draft=draft_dir if k != 0 else None, input=prompts, output=out,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              num_draft_tokens=k if k != 0 else "auto", batch_size=batch, dtype="float32",
                              metrics=metrics, overwrite=True)
            with contextlib.redirect_stdout(io.StringIO()):
                rc = cli.run(s, models=lambda *_: (target, draft if k != 0 else None))
            if rc != 0:
                raise SystemExit(f"serve failed ({rc}) for {mode_name(k)} at batch {batch}")
            m = json.load(open(metrics))
            m["texts"] = {r["id"]: r["text"] for r in map(json.loads, open(out))}
            return m

        first_jobs = {}
        for batch in parse_list(args.batch):
            for k in modes:
                first = serve_once(k, batch, f"warm-{k}-{batch}")
                first_jobs[batch, k] = first["tokens_per_second"]
                print(f"  B={batch} {mode_name(k)}: warm, {first['tokens_per_second']:.1f} tok/s, "
                      f"{first['compile_seconds']:.0f} s compiling", file=sys.stderr, flush=True)
            runs = {k: [] for k in modes}
            for r in range(args.repeats):
                for k in modes[r % len(modes):] + modes[:r % len(modes)]:
                    runs[k].append(serve_once(k, batch, f"{k}-{batch}-{r}"))
            base = runs[0]
            for k in modes:
                tps = [m["tokens_per_second"] for m in runs[k]]
                ratios = [m["tokens_per_second"] / b["tokens_per_second"] for m, b in zip(runs[k], base)]
                same = sum(m["texts"] == b["texts"] for m, b in zip(runs[k], base))
                row = {"batch": batch, "mode": mode_name(k), "tok_s": statistics.median(tps), "tok_s_runs": tps,
                       "speedup": statistics.median(ratios), "speedup_runs": ratios,
                       "texts_identical": f"{same}/{len(ratios)}",
                       "tau": statistics.median(m["mean_accept_length"] or 1.0 for m in runs[k]),
                       "compile_seconds": [m["compile_seconds"] for m in runs[k]]}
                if k == "auto":
                    row["auto_draft"] = [m.get("auto_draft") for m in runs[k]]
                    row["first_job_vs_target_only_first_job"] = first_jobs[batch, k] / first_jobs[batch, 0]
                rows_out.append(row)
            # XLA:CPU maps every compiled kernel separately, and a batch size's modes hold some thirty
            # programs (auto's Ks and admission sizes among them): one process keeping two batch sizes'
            # programs ran out of memory mappings (vm.max_map_count 65530) at the 27th job. The next
            # batch size compiles its own programs anyway, so this one's are dropped first.
            runs.clear()
            jax.clear_caches()
            gc.collect()
    print(f"{machine()}, load average {load_average()}, {args.num_prompts} prompts of {os.path.relpath(args.prompts, REPO)}"
          f" x {args.max_new_tokens} new tokens, T={args.temperature:g}, float32, median of {args.repeats} paired passes")
    body = []
    for r in rows_out:
        auto = ""
        if "auto_draft" in r:
            last = r["auto_draft"][-1] or {}
            auto = f"K={last.get('num_draft_tokens')} ({', '.join(f'{k}:{n}' for k, n in last.get('iterations_per_k', {}).items())})"
        body.append([r["batch"], r["mode"], r["tok_s"], f"{r['speedup']:.3f}",
                     f"{min(r['speedup_runs']):.2f}–{max(r['speedup_runs']):.2f}", f"{r['tau']:.2f}",
                     r["texts_identical"], auto])
    print(table(["B", "mode", "tok/s", "× target-only", "× range", "τ", "texts = target-only", "auto: last K (iterations)"],
                body))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                       "load_average": load_average(), "args": vars(args), "rows": rows_out}, f, indent=1,
                      default=str)
    return 0 if all(r["texts_identical"].split("/")[0] == r["texts_identical"].split("/")[1] for r in rows_out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
