"""Does the speculative sampler leave acceptance on the table? The demo pair's K = 1 acceptance in the
real decode loop against its expectation on the same contexts.

At T > 0 a K = 1 round accepts its draft token with probability sum_x min(p(x), q(x)) (p: the
target's filtered distribution, q: the draft's), so over many rounds the loop's acceptance count
must match the sum of those overlaps. ``eagle3_jax.speculative.acceptance_check`` holds the method:
each (prompt, seed) row runs through ``Generator(num_draft_tokens=1)`` for 3 new tokens, because
then the row's round count and acceptance length pin where its rounds started (one round at the
prompt's end + the first token, or a rejection there and a second round one position later). A
longer run reports no per-round counts, and its round starts would depend on acceptances nobody
recorded. Every row is then teacher-forced through the target and the draft to get p and q at
exactly those positions. The table gives the measured acceptance with its binomial standard
error, the expectation, their difference in standard errors (of the count, under the
expectation) and PASS when that is within --sigmas. Rounds from one prompt at different seeds share
a start but not the first token, so contexts vary with the seed too.

    .venv/bin/python benchmarks/studies/accept_expectation.py [--demo-dir demo] [--num-prompts N]
        [--copies 8] [--seeds 8] [--temperature 1.0] [--top-p 1.0,0.9] [--sigmas 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/_common.py
from _common import REPO, describe, load_average, machine, parse_list, quiet_watchdog, table  # noqa: E402

import eagle3_jax as e3
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative.acceptance_check import MAX_NEW_TOKENS, compare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--num-prompts", type=int, default=None, help="default: every held-out prompt")
    ap.add_argument("--copies", type=int, default=8, help="rows per prompt in each run (independent draws)")
    ap.add_argument("--seeds", type=int, default=8, help="runs per setting, seeds 0..N-1")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", default="1.0,0.9")
    ap.add_argument("--sigmas", type=float, default=3.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    pair = DemoPair.load(args.demo_dir, num_prompts=args.num_prompts)
    print(describe(pair), file=sys.stderr)
    prompts = [p for p in pair.prompt_ids for _ in range(args.copies)]
    gen = e3.Generator(pair.target, pair.draft, num_draft_tokens=1, max_len=pair.capacity(MAX_NEW_TOKENS, 1),
                       batch_size=len(prompts))
    rows = []
    with quiet_watchdog():
        for top_p in parse_list(args.top_p, float):
            t = time.perf_counter()
            c = compare(gen, prompts, range(args.seeds), args.temperature, top_p=top_p, eos=pair.eos)
            rows.append({"temperature": args.temperature, "top_p": top_p, "rounds": c.rounds, "accepted": c.accepted,
                         "measured": c.measured_rate, "stderr": c.stderr, "expected": c.expected_rate, "z": c.z,
                         "pass": abs(c.z) <= args.sigmas, "seconds": time.perf_counter() - t})
            print(f"  top_p={top_p:g}: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    headers = ["T", "top_p", "rounds", "measured ± s.e.", "expected", "measured − expected", "z",
               f"|z| ≤ {args.sigmas:g}"]
    body = [[f"{r['temperature']:g}", f"{r['top_p']:g}", r["rounds"], f"{r['measured']:.4f} ± {r['stderr']:.4f}",
             f"{r['expected']:.4f}", f"{r['measured'] - r['expected']:+.4f}", f"{r['z']:+.2f}",
             "PASS" if r["pass"] else "FAIL"] for r in rows]
    print(f"{machine()}, load average {load_average()}, K = 1, {len(pair.prompt_ids)} prompts x {args.copies} rows "
          f"x {args.seeds} seeds, {MAX_NEW_TOKENS} new tokens, {pair.settings.dtype}")
    print(table(headers, body))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                       "args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
