"""ms per round at K in KS for greedy and sampled, on the demo pair (like autodraft.calibrate)."""
import sys, time, statistics
repo = sys.argv[1]; B = int(sys.argv[2]); KS = [int(x) for x in sys.argv[3].split(",")]   # repo: a checkout to time (compare two side by side)
sys.path.insert(0, repo)
import jax, jax.numpy as jnp, numpy as np
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative.generate import admit_rows, blank_state, run_rounds
from eagle3_jax.speculative.session import SamplingSettings
import eagle3_jax.speculative.generate as g
pair = DemoPair.load(repo + "/demo", 4)
gen = pair.generator("auto", 96, B)
session = gen.session
models = session.models(); tm = models[:2] + (None, None)
rng = np.random.default_rng(0)
ids, lengths, _ = session.pack_prompts({b: rng.integers(0, 8192, 16).tolist() for b in range(B)}, B)
rows = np.arange(B, dtype=np.int32)
out = {}
for T in (0.0, 1.0):
    ss = SamplingSettings(T); sp = ss.traced(); prog = session.program(B, 96, ss)
    def timed(k, R=12):
        with session.activate():
            st = blank_state(*models, jax.random.key(0), sp, program=prog)
            st = admit_rows(*models, st, rows, ids, lengths, sp, program=prog)
            jax.block_until_ready(st)
            t = time.perf_counter()
            st = run_rounds(*(models if k else tm), st, np.int32(R), np.int32(B + 1), sp, program=prog.with_draft_tokens(k))
            jax.block_until_ready(st)
            return (time.perf_counter() - t) / R
    for k in KS: timed(k)
    samples = {k: [] for k in KS}
    for _ in range(5):
        for k in KS: samples[k].append(timed(k))
    for k in KS: out[(T, k)] = statistics.median(samples[k]) * 1e3
print(repo, f"B={B}", " ".join(f"T{T:g}K{k}:{v:.2f}" for (T, k), v in out.items()), flush=True)
