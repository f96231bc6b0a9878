"""What auto costs where target-only wins: target-only, auto, and auto pinned at K = 0, interleaved.

    python benchmarks/probes/k0_overhead.py B T N PASSES

Auto pinned at K = 0 runs the Engine exactly as auto does (syncs, fetches, its bookkeeping) but never
explores; its gap to target-only is auto's overhead, auto's gap to it what exploring costs.
"""
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import eagle3_jax.speculative.autodraft as ad  # noqa: E402
from eagle3_jax.serve.demo import DemoPair  # noqa: E402

B, T, N = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
passes = int(sys.argv[4]) if len(sys.argv) > 4 else 5
pair = DemoPair.load(os.path.join(REPO, "demo"), N)
orig = ad.AutoDraft.next_k


def next_k(self, drafted_rows=True, remaining=None):
    if getattr(self, "pin0", False):
        self.runs += 1
        self.last_was_exploration = False
        return 0
    return orig(self, drafted_rows, remaining)


ad.AutoDraft.next_k = next_k
kw = dict(eos_token_ids=pair.eos, temperature=T, prompt_len=pair.prompt_len)
modes = {"target-only": pair.generator(0, 96, B), "auto": pair.generator("auto", 96, B),
         "auto@0": pair.generator("auto", 96, B)}
ids = pair.prompt_ids[:N]
for name, g in modes.items():
    g.generate(ids, 96, **kw)
    if name == "auto@0":
        for a in g.session._auto.values():
            a.pin0 = True
    g.generate(ids, 96, **kw)
rates = {name: [] for name in modes}
names = list(modes)
for p in range(passes):
    for name in names[p % 3:] + names[:p % 3]:   # rotated: no mode always runs first
        g = modes[name]
        r = g.generate(ids, 96, seed=p, **kw)
        rates[name].append(r.stats.tokens_per_second)
    print(f"pass {p}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
base = rates["target-only"]
for name in ("auto", "auto@0"):
    ratios = [a / b for a, b in zip(rates[name], base)]
    print(f"{name} / target-only: median {statistics.median(ratios):.3f} (passes "
          + " ".join(f"{x:.3f}" for x in ratios) + ")")
print("auto's K iterations:", modes["auto"].draft_choice.rounds_per_k)
