"""Unrolled vs scanned target decode: compile time and runtime (demo target, float32)."""
import sys, time, statistics
import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax
jax.config.update("jax_enable_compilation_cache", False)
import jax.numpy as jnp, numpy as np
from flax import nnx
import eagle3_jax as e3
from eagle3_jax.models.layers import rope_cos_sin

B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
T = int(sys.argv[2]) if len(sys.argv) > 2 else 1
lt = e3.load_target(os.path.join(REPO, "demo", "target"), dtype="float32")
model = lt.model
S = 256
aux_ids = (1, 11, 20)

def unrolled(gdef, state, ids, pos, cache):
    m = nnx.merge(gdef, state)
    out = m(ids, pos, cache, aux_ids)
    return m.logits(out.hidden_BTD), out.aux_BTX, out.cache

layers = list(model.layers)
g0, s0 = nnx.split(layers[0])
gm, _ = nnx.split(layers[1])
bounds = [1, 2, 12, 21, 24]
stacked = [jax.tree.map(lambda *x: jnp.stack(x), *[nnx.split(l)[1] for l in layers[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])]
rest_g, rest_s = nnx.split(model)

def scanned(gdef, state, g0, s0, gm, stacked, ids, pos, cache):
    m = nnx.merge(gdef, state)
    x = m.embed(ids)
    cos, sin = rope_cos_sin(pos, jnp.asarray(m.rope_inv_freq, jnp.float32), m.rope_attn_factor)
    l0 = nnx.merge(g0, s0)
    x, cache = l0(x, pos, cos, sin, cache, 0, m.softmax_scale)
    aux = [None] * 3
    # segments ending at aux layers
    bounds = [1, 2, 12, 21, 24]
    auxs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = stacked[len(auxs)]
        def body(c, xs):
            x, cache = c
            st, i = xs
            layer = nnx.merge(gm, st)
            x, cache = layer(x, pos, cos, sin, cache, i, m.softmax_scale)
            return (x, cache), None
        (x, cache), _ = jax.lax.scan(body, (x, cache), (seg, jnp.arange(a, b)))
        auxs.append(x)
    return m.logits(m.norm(x)), jnp.concatenate(auxs[:3], -1), cache

f_u = jax.jit(unrolled, static_argnums=0, donate_argnums=4)
f_s = jax.jit(scanned, static_argnums=(0, 2, 4), donate_argnums=8)
ids = jnp.ones((B, T), jnp.int32) * 5
pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 40, (B, T))
def fresh():
    return lt.model.init_cache(B, S)
t = time.perf_counter(); cu = f_u.lower(rest_g, rest_s, ids, pos, fresh()).compile(); print("unrolled compile", time.perf_counter() - t)
t = time.perf_counter(); cs = f_s.lower(rest_g, rest_s, g0, s0, gm, stacked, ids, pos, fresh()).compile(); print("scanned compile", time.perf_counter() - t)
lu, au, _ = cu(rest_s, ids, pos, fresh())
ls, as_, _ = cs(rest_s, s0, stacked, ids, pos, fresh())
print("max |dlogits|", float(jnp.abs(lu - ls).max()), "max |daux|", float(jnp.abs(au - as_).max()))
cache_u, cache_s = fresh(), fresh()
tu, ts = [], []
for r in range(40):
    t = time.perf_counter(); lu, au, cache_u = cu(rest_s, ids, pos, cache_u); lu.block_until_ready(); tu.append(time.perf_counter() - t)
    t = time.perf_counter(); ls, as_, cache_s = cs(rest_s, s0, stacked, ids, pos, cache_s); ls.block_until_ready(); ts.append(time.perf_counter() - t)
mu, ms = statistics.median(tu[5:]), statistics.median(ts[5:])
print(f"B={B} T={T}: unrolled {mu*1e3:.2f} ms  scanned {ms*1e3:.2f} ms  ratio {ms/mu:.3f}")
