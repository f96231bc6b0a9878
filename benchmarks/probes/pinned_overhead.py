"""What auto's bookkeeping costs at a K it has settled on: fixed K, auto pinned at K, and auto
pinned at K without the sync that times each run alone, interleaved (the order rotates).

    python benchmarks/probes/pinned_overhead.py B T N PASSES K
"""
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax  # noqa: E402
import eagle3_jax.speculative.autodraft as ad  # noqa: E402
import eagle3_jax.speculative.engine as eng  # noqa: E402
from eagle3_jax.serve.demo import DemoPair  # noqa: E402

B, T, N, passes, K = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
pair = DemoPair.load(os.path.join(REPO, "demo"), N)


def next_k(self, drafted_rows=True, remaining=None):
    self.runs += 1
    self.last_was_exploration = False
    return K


ad.AutoDraft.next_k = next_k


class NoSync:   # the engine module's `jax`, without block_until_ready
    def __getattr__(self, name):
        return (lambda x: x) if name == "block_until_ready" else getattr(jax, name)


kw = dict(eos_token_ids=pair.eos, temperature=T, prompt_len=pair.prompt_len)
modes = {f"K={K}": pair.generator(K, 96, B), f"auto@{K}": pair.generator("auto", 96, B),
         f"auto@{K} no sync": pair.generator("auto", 96, B)}
ids = pair.prompt_ids[:N]


def generate(name, **extra):
    eng.jax = NoSync() if name.endswith("no sync") else jax
    return modes[name].generate(ids, 96, **kw, **extra)


for name in modes:
    generate(name)
    generate(name)
rates = {name: [] for name in modes}
names = list(modes)
for p in range(passes):
    for name in names[p % 3:] + names[:p % 3]:
        rates[name].append(generate(name, seed=p).stats.tokens_per_second)
    print(f"pass {p}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
base = rates[names[0]]
for name in names[1:]:
    ratios = [a / b for a, b in zip(rates[name], base)]
    print(f"{name} / {names[0]}: median {statistics.median(ratios):.3f} (passes "
          + " ".join(f"{x:.3f}" for x in ratios) + ")")
