"""Each auto decision of one demo case: K, predicted rate per K, wall rates, vetoes."""
import sys, time
import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax, numpy as np
from eagle3_jax.serve.demo import DemoPair
import eagle3_jax.speculative.autodraft as ad

B = int(sys.argv[1]); T = float(sys.argv[2]); N = int(sys.argv[3]); passes = int(sys.argv[4]) if len(sys.argv) > 4 else 3
pair = DemoPair.load(os.path.join(REPO, "demo"), N)
orig = ad.AutoDraft.next_k
def next_k(self, drafted_rows=True, remaining=None):
    k = orig(self, drafted_rows, remaining)
    rates = [self.rate(j, remaining) for j in range(self.max_draft_tokens + 1)]
    wall = {j: self.wall.rate(j) for j in range(self.max_draft_tokens + 1) if self.wall.rate(j) is not None}
    print(f"  run {self.runs:3d} K={k} expl={int(self.last_was_exploration)} wave={remaining is not None} "
          f"rate/rate0 " + " ".join(f"{r / rates[0]:.2f}" for r in rates[1:]) +
          " | tau " + " ".join(f"{self.acceptance.tau(j):.2f}" for j in range(1, 4)) +
          " | cost/c0 " + " ".join(f"{self.costs.cost(j) / self.costs.cost(0):.2f}" for j in range(1, 4)) +
          " | wall " + " ".join(f"{j}:{v:.0f}" for j, v in wall.items()) +
          " | optimistic/rate0 " + " ".join(f"{self.acceptance.tau_upper(j) / self.costs.cost(j) / rates[0]:.2f}"
                                            for j in range(1, self.max_draft_tokens + 1)) +
          " | veto " + "".join(str(j) for j in range(1, self.max_draft_tokens + 1) if self.vetoed(j)), flush=True)
    return k
ad.AutoDraft.next_k = next_k
kw = dict(eos_token_ids=pair.eos, temperature=T, prompt_len=pair.prompt_len)
base = pair.generator(0, 96, B); spec = pair.generator("auto", 96, B)
ids = pair.prompt_ids[:N]
base.generate(ids, 96, **kw)
print("== warm-up pass"); spec.generate(ids, 96, **kw)
for p in range(passes):
    r0 = base.generate(ids, 96, seed=p, **kw)
    print(f"== pass {p}")
    r1 = spec.generate(ids, 96, seed=p, **kw)
    print(f"pass {p}: base {r0.stats.tokens_per_second:.1f} spec {r1.stats.tokens_per_second:.1f} ratio {r1.stats.tokens_per_second / r0.stats.tokens_per_second:.3f}", flush=True)
