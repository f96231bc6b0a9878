"""Refill batching (the serve engine) vs a static batch, on mixed output lengths, in one run.

Workload: P prompts whose greedy answers end at very different lengths. The demo pair's target
greedily continues its held-out prompts, and the stop ids are a few tokens of those continuations
chosen so that ~3/4 of the answers stop early and ~1/4 run to max_new_tokens: the mix that leaves a
static batch's rows idle behind one long answer.

  static  = ``Generator.generate`` on fixed batches of B prompts in input order (a batch ends when its
            longest answer does);
  refill  = ``Engine`` (eagle3_jax/speculative/engine.py) with B rows: every ``rounds_per_sync`` rounds the
            host hands out finished rows and prefills waiting prompts into them.
Both run target-only and with the demo's EAGLE-3 draft, same prompts, greedy; outputs must be identical (checked). Every configuration runs once to compile and
warm up, then ``--repeats`` times round-robin; the fastest run counts (other jobs on a shared machine
only ever add time). tok/s = all generated tokens / wall seconds, prefill included.

    .venv/bin/python benchmarks/refill.py [--demo-dir demo] [--prompts 32] [--batch 8] [--max-new-tokens 128]
        [--rounds-per-sync 4,16,64] [--num-draft-tokens 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

from _common import REPO, describe, machine, table

import jax

import eagle3_jax as e3
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative.engine import Engine, Request


def pick_stop_ids(conts: list[list[int]], max_new: int) -> tuple[tuple[int, ...], list[int]]:
    """Stop ids chosen greedily so that ~3/4 of the answers stop in their first quarter and at
    least 1/4 never stop (they run to max_new_tokens). Returns the ids and each answer's length."""
    early_cut, P = max_new // 4, len(conts)
    first = [max_new] * P
    chosen: list[int] = []
    counts: dict[int, int] = {}
    for c in conts:
        for t in set(c[:early_cut]):
            counts[t] = counts.get(t, 0) + 1
    for t in sorted(counts, key=lambda t: (-counts[t], t)):
        new = [min(f, c.index(t)) if t in c else f for f, c in zip(first, conts)]
        if sum(f >= max_new for f in new) < P / 4:
            continue
        if sum(f < early_cut for f in new) > sum(f < early_cut for f in first):
            chosen.append(int(t))
            first = new
        if sum(f < early_cut for f in first) >= 0.75 * P:
            break
    return tuple(chosen), [min(f + 1, max_new) for f in first]


def run_static(gen: e3.Generator, prompts, B, N, eos):
    out, tau_num, tau_den = [], 0, 0
    for i in range(0, len(prompts), B):
        res = gen.generate(prompts[i:i + B], N, eos_token_ids=eos)
        out += res.tokens
        tau_num += res.stats.round_tokens
        tau_den += res.stats.rounds
    return out, (tau_num / tau_den if tau_den else float("nan"))


def run_refill(target, draft, K, cap, prompts, B, N, eos, rps):
    eng = Engine(target, draft=draft, num_draft_tokens=K, max_len=cap, batch_size=B, max_new_tokens=N,
                 eos_token_ids=eos, rounds_per_sync=rps)
    got = {f.key: f.tokens for f in eng.run([Request(key=str(i), prompt=p) for i, p in enumerate(prompts)])}
    return [got[str(i)] for i in range(len(prompts))], eng.stats.mean_accept_length


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default=str(REPO / "demo"))
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts of the demo (at most all of them)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds-per-sync", default="4,16,64")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    B, N, K = args.batch, args.max_new_tokens, args.num_draft_tokens
    rps_list = [int(x) for x in args.rounds_per_sync.split(",") if x.strip()]

    # ------------------------------------------------------------ models and workload
    pair = DemoPair.load(args.demo_dir, num_prompts=args.prompts)
    target, draft, prompts = pair.target, pair.draft, pair.prompt_ids
    cap = pair.capacity(N, K)
    conts = e3.Generator(target, None, max_len=cap).generate(prompts, N).tokens
    eos, _ = pick_stop_ids(conts, N)

    configs = {}
    for name, d in (("target only", None), (f"EAGLE-3 K={K}", draft)):
        gen = e3.Generator(target, d, num_draft_tokens=K, max_len=cap)
        configs[(name, "static")] = (lambda gen=gen: run_static(gen, prompts, B, N, eos))
        for rps in rps_list:
            configs[(name, f"refill rps={rps}")] = (
                lambda d=d, rps=rps: run_refill(target, d, K, cap, prompts, B, N, eos, rps))

    # ------------------------------------------------------------ timing (round-robin, fastest run counts)
    log = logging.getLogger("eagle3_jax")
    log.setLevel(logging.ERROR)   # the acceptance watchdog is not what is measured here
    warnings.simplefilter("ignore", e3.AcceptanceCollapseWarning)
    secs = {k: [] for k in configs}
    results = {}
    for rep in range(args.repeats + 1):
        for k, fn in configs.items():
            t0 = time.perf_counter()
            results[k] = fn()
            if rep:   # the first pass compiles
                secs[k].append(time.perf_counter() - t0)

    reference = results[("target only", "static")][0]
    out_lens = [len(t) for t in reference]
    rows = []
    for (name, method), (tokens, tau) in results.items():
        same = sum(a == b for a, b in zip(tokens, reference))
        n_tok = sum(len(t) for t in tokens)
        best = min(secs[(name, method)])
        static_best = min(secs[(name, "static")])
        rows.append((name, method, n_tok, best, n_tok / best, static_best / best,
                     "-" if name == "target only" else tau, f"{same}/{len(prompts)}"))

    print(f"# refill  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    print(f"# {describe(pair)}")
    lens = sorted(len(p) for p in prompts)
    print(f"# workload: {len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens, batch {B}, max_new_tokens {N}, greedy, "
          f"stop ids {list(eos)}; answer lengths min {min(out_lens)} / median {statistics.median(out_lens):.0f} / "
          f"max {max(out_lens)}, {sum(n >= N for n in out_lens)} of {len(out_lens)} run to max_new_tokens")
    print(f"# static occupancy (useful row-steps / row-steps of its batches, target only): "
          f"{sum(out_lens) / sum(B * max(out_lens[i:i + B]) for i in range(0, len(out_lens), B)):.2f}")
    print()
    print(table(["decoder", "batching", "tokens", "best s", "tok/s", "speedup vs static", "tau",
                 "outputs = target-only static"], rows))
    load1 = os.getloadavg()
    print(f"\n# total wall time {time.perf_counter() - t_start:.0f} s; load average at end "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (other processes share these cores)")


if __name__ == "__main__":
    main()
