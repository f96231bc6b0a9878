"""Where the wall time of one demo case goes: admissions, runs (by K), host work between."""
import sys, time, collections
import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax, numpy as np
from eagle3_jax.serve.demo import DemoPair, run_mode
import eagle3_jax.speculative.engine as eng

B = int(sys.argv[1]); T = float(sys.argv[2]); N = int(sys.argv[3]); passes = int(sys.argv[4]) if len(sys.argv) > 4 else 3
pair = DemoPair.load(os.path.join(REPO, "demo"), N)
log = []
orig_admit, orig_run = eng.admit_rows, eng.run_rounds
def timed(name, f):
    def w(*a, **kw):
        t = time.perf_counter(); out = f(*a, **kw); jax.block_until_ready(out)
        log.append((name, kw["program"].num_draft_tokens, time.perf_counter() - t, out.rounds_B.max() if name == "run" else None))
        return out
    w._cache_size = f._cache_size
    return w
eng.admit_rows = timed("admit", orig_admit)
eng.run_rounds = timed("run", orig_run)
kw = dict(eos_token_ids=pair.eos, temperature=T, prompt_len=pair.prompt_len)
base = pair.generator(0, 96, B); spec = pair.generator("auto", 96, B)
ids = pair.prompt_ids[:N]
base.generate(ids, 96, **kw); spec.generate(ids, 96, **kw)
for p in range(passes):
    for name, g in (("base", base), ("spec", spec)):
        log.clear(); t = time.perf_counter()
        r = g.generate(ids, 96, seed=p, **kw)
        wall = time.perf_counter() - t
        by = collections.defaultdict(lambda: [0, 0.0])
        for n, k, s, _ in log:
            by[(n, k)][0] += 1; by[(n, k)][1] += s
        parts = " ".join(f"{n}K{k}:{c}x{s:.2f}s" for (n, k), (c, s) in sorted(by.items()))
        other = wall - sum(s for _, _, s, _ in log)
        print(f"pass {p} {name}: wall {wall:.2f}s tok/s {r.stats.tokens_per_second:.1f} tau {r.stats.mean_accept_length:.2f} | {parts} | host {other:.2f}s", flush=True)
        if name == "spec":
            print("   K sequence:", "".join(str(k) for n, k, _, _ in log if n == "run"), g.draft_choice.rounds_per_k if g.draft_choice else "")
