"""Acceptance length tau vs the number of draft tokens K for the demo pair (demo/target + demo/draft).

For every K (a chain of K draft tokens per round) and every temperature, generates completions of
the held-out prompts (``demo/prompts.jsonl``) in batches and reports:
  * tau = tokens emitted per target verify round (accepted draft tokens + the bonus token);
  * the acceptance rate at draft position i = the fraction of rounds whose first i draft tokens
    were all accepted (a chain stops at the first rejection, so the rates fall with i, and tau is
    1 + their sum except for the last round of each row, cut short by max_new_tokens or EOS).
T = 0 is greedy; T = 1 is plain sampling from the target's distribution (top_p 1, top_k 0) with
speculative (rejection-sampling) verification. Seeds are fixed: batch i samples with seed --seed + i.
Every batch pins the same padded prompt length, so each (K, greedy-or-not) compiles once.

The PNG (needs matplotlib, ``pip install -e '.[plot]'``; without it the plot is skipped) has one
panel per temperature with the per-position acceptance curve of every K, and a panel of tau vs K.

    .venv/bin/python benchmarks/studies/demo_accept.py [--demo-dir demo] [--ks 1,2,3,4,5,6,7,8]
        [--temperatures 0,1] [--num-prompts N (default: all)] [--max-new-tokens 96] [--batch-size B]
        [--png benchmarks/studies/demo_accept.png] [--json OUT.json] [--seed 0]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/_common.py
from _common import REPO, describe, load_average, machine, parse_list, quiet_watchdog, shown_path, table  # noqa: E402

import jax

from eagle3_jax.metrics import GenerationStats
from eagle3_jax.serve.demo import DemoPair, batches_of


# ---------------------------------------------------------------- measurement
@dataclass
class Acceptance:
    """Acceptance of one (K, temperature) over all prompts."""

    k: int
    temperature: float
    stats: GenerationStats

    @property
    def tau(self) -> float:
        return self.stats.mean_accept_length

    @property
    def rates(self) -> list[float]:
        return self.stats.accept_rate_per_position

    def as_dict(self) -> dict:
        return {"k": self.k, "temperature": self.temperature, "tau": self.tau, "rounds": self.stats.rounds,
                "new_tokens": self.stats.tokens, "accept_rate_per_position": self.rates}


def measure_acceptance(pair: DemoPair, k: int, temperature: float, batch_size: int, max_new_tokens: int,
                       seed: int) -> Acceptance:
    with quiet_watchdog():
        _, stats = pair.generate(pair.generator(k, max_new_tokens), batches_of(pair.prompt_ids, batch_size),
                                 max_new_tokens, temperature=temperature, seed=seed)
    return Acceptance(k, temperature, stats)


# ---------------------------------------------------------------- report
def acceptance_table(results: list[Acceptance]) -> str:
    max_k = max(r.k for r in results)
    rows = [[r.k, f"{r.temperature:g}", r.tau, r.stats.rounds] + [r.rates[i] if i < r.k else "-" for i in range(max_k)]
            for r in results]
    return table(["K", "T", "tau", "rounds"] + [f"pos {i + 1}" for i in range(max_k)], rows)


def write_png(results: list[Acceptance], path: str, title: str) -> bool:
    """Per-position acceptance curves (one panel per temperature, one line per K) and tau vs K."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): skipping the PNG")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r.temperature for r in results})
    ks = sorted({r.k for r in results})
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(5 * (len(temps) + 1), 4.2))
    colors = plt.get_cmap("viridis")
    for ax, t in zip(axes, temps):
        for r in (r for r in results if r.temperature == t):
            shade = colors(ks.index(r.k) / max(1, len(ks) - 1))
            ax.plot(range(1, r.k + 1), r.rates, marker="o", color=shade, label=f"K={r.k} (tau {r.tau:.2f})")
        ax.set(title=f"T = {t:g}", xlabel="draft position i", ylim=(0, 1.02),
               ylabel="fraction of rounds accepting tokens 1..i")
        ax.set_xticks(range(1, max(ks) + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    tau_ax = axes[-1]
    for t in temps:
        by_k = sorted((r for r in results if r.temperature == t), key=lambda r: r.k)
        tau_ax.plot([r.k for r in by_k], [r.tau for r in by_k], marker="o", label=f"T = {t:g}")
    tau_ax.plot(ks, [k + 1 for k in ks], ls=":", color="gray", label="upper bound K+1")
    tau_ax.set(title="tau (tokens per verify round)", xlabel="K (draft tokens per round)", ylabel="tau",
               ylim=(1, None))
    tau_ax.set_xticks(ks)
    tau_ax.grid(alpha=0.3)
    tau_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="comma-separated numbers of draft tokens")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: every prompt in prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the largest of demo.yaml batch_sizes")
    ap.add_argument("--png", default=os.path.join(REPO, "benchmarks", "studies", "demo_accept.png"), help="'' to skip")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the numbers as JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()

    print(f"# demo_accept  {datetime.date.today()}  machine: {machine()}, jax {jax.__version__} "
          f"({jax.default_backend()}), load average at start {load_average()}")
    print("command: " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]), flush=True)
    pair = DemoPair.load(args.demo_dir, args.num_prompts)
    batch_size = args.batch_size or max(pair.settings.batch_sizes)
    print(describe(pair))
    print(f"{args.max_new_tokens} new tokens per prompt, batch {batch_size}, seed {args.seed}", flush=True)

    results = []
    for t in parse_list(args.temperatures, float):
        for k in parse_list(args.ks):
            t0 = time.perf_counter()
            results.append(measure_acceptance(pair, k, t, batch_size, args.max_new_tokens, args.seed))
            print(f"  K={k} T={t:g}: tau {results[-1].tau:.2f}  [{time.perf_counter() - t0:.0f}s]", flush=True)

    print()
    print(f"## tau and acceptance rate per draft position (chain drafts), {len(pair.prompt_ids)} held-out prompts, "
          f"{args.max_new_tokens} new tokens; pos i = fraction of rounds accepting draft tokens 1..i")
    print(acceptance_table(results))
    if args.png and write_png(results, args.png, describe(pair)):
        print(f"wrote {shown_path(args.png)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "machine": machine(), "backend": jax.default_backend(),
                       "demo": describe(pair), "max_new_tokens": args.max_new_tokens, "batch_size": batch_size,
                       "seed": args.seed, "results": [r.as_dict() for r in results]}, f, indent=2)
        print(f"wrote {args.json}")
    print(f"load average at end {load_average()}; total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
