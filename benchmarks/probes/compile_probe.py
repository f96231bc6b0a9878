"""How long one round program takes to trace, lower and compile (no persistent cache)."""
import os, sys, time
import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax
jax.config.update("jax_enable_compilation_cache", False)
import jax.numpy as jnp, numpy as np
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative.generate import run_rounds, blank_state
from eagle3_jax.speculative.session import SamplingSettings

pair = DemoPair.load(os.path.join(REPO, "demo"), 4)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ks = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "0,3").split(",")]
gen = pair.generator("auto", 96, B)
eng_session = gen.session if hasattr(gen, "session") else gen._session
ss = SamplingSettings(0.0)
prog = eng_session.program(B, 96, ss)
sp = ss.traced()
models = eng_session.models()
with eng_session.activate():
    state = blank_state(*models, jax.random.key(0), sp, program=prog)
    for k in ks:
        p = prog.with_draft_tokens(k)
        m = models if k else models[:2] + (None, None)
        t0 = time.perf_counter()
        tr = run_rounds.trace(*m, state, np.int32(4), np.int32(B + 1), sp, program=p)
        t1 = time.perf_counter()
        lo = tr.lower()
        t2 = time.perf_counter()
        co = lo.compile()
        t3 = time.perf_counter()
        print(f"B={B} K={k}: trace {t1-t0:.2f}s lower {t2-t1:.2f}s compile {t3-t2:.2f}s  hlo chars {len(lo.as_text())}", flush=True)
