"""Where the untimed warm-up of one demo batch size goes (caches warm): per-event JAX durations."""
import sys, time, collections
import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax
from jax import monitoring
ev = collections.defaultdict(lambda: [0, 0.0])
monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: ev[name].__setitem__(slice(None), [ev[name][0] + 1, ev[name][1] + secs]))
from eagle3_jax import compile_cache; compile_cache.enable()
from eagle3_jax.serve.demo import DemoPair, run_mode
import eagle3_jax.speculative.autodraft as ad
B = int(sys.argv[1]); N = int(sys.argv[2])
pair = DemoPair.load(os.path.join(REPO, "demo"), N)
orig = ad.calibrate
def cal(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); print(f"   calibrate {time.perf_counter() - t:.1f}s"); return r
ad.calibrate = cal
import eagle3_jax.speculative.session as ses; ses.calibrate = cal
for name, k in (("base", 0), ("spec", "auto")):
    g = pair.generator(k, 96, B)
    for T in (0.0, 1.0):
        ev.clear(); t = time.perf_counter()
        m = run_mode(pair, g, pair.prompt_ids[:N], T, 0)
        print(f"{name} T={T:g}: warm-up {m.compile_s if hasattr(m,'compile_s') else m.compile_seconds:.1f}s total {time.perf_counter() - t:.1f}s  tok/s {m.stats.tokens_per_second:.1f}")
        for n, (c, s) in sorted(ev.items(), key=lambda x: -x[1][1])[:6]:
            print(f"     {n}: {c} x, {s:.2f}s")
