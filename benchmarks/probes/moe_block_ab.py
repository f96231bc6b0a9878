"""``experts_blocked`` of two checkouts side by side in one process, µs per call (median of 9 interleaved
runs of 30 calls) and their max |difference|.

    python benchmarks/probes/moe_block_ab.py OLD_CHECKOUT NEW_CHECKOUT 1,2,5,7,8,16,24,40,256 [D,F,E,K]
"""
import sys, time, statistics, importlib.util
import jax, jax.numpy as jnp
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path + "/eagle3_jax/models/moe.py")
    sys.path.insert(0, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); sys.path.pop(0); return m
old = load(sys.argv[1], "moe_old"); new = load(sys.argv[2], "moe_new")
D, F, E, K = [int(v) for v in sys.argv[4].split(",")] if len(sys.argv) > 4 else (256, 48, 16, 4)
def make(M):
    kx, ks, kg, ku, kd = jax.random.split(jax.random.key(M), 5)
    x = jax.random.normal(kx, (M, D)); top, idx = jax.lax.top_k(jax.random.normal(ks, (M, E)), K)
    return x, idx.astype(jnp.int32), jax.nn.softmax(top, -1), jax.random.normal(kg,(E,D,F))/16, jax.random.normal(ku,(E,D,F))/16, jax.random.normal(kd,(E,F,D))/7
for M in [int(a) for a in sys.argv[3].split(",")]:
    a = make(M)
    fs = {"old": jax.jit(old.experts_blocked, static_argnums=6).lower(*a, 0).compile(),
          "new": jax.jit(new.experts_blocked, static_argnums=6).lower(*a, 0).compile()}
    r = {k: [] for k in fs}
    for _ in range(9):
        for k, f in fs.items():
            f(*a).block_until_ready(); t = time.perf_counter()
            for _ in range(30): o = f(*a)
            o.block_until_ready(); r[k].append((time.perf_counter() - t) / 30 * 1e6)
    o, n = statistics.median(r["old"]), statistics.median(r["new"])
    err = float(jnp.abs(fs["old"](*a) - fs["new"](*a)).max())
    print(f"M={M:4d} b_new={new.block_rows(M, K, E):3d} old {o:8.1f}us new {n:8.1f}us  new/old {n/o:.2f}  maxdiff {err:.1e}", flush=True)
