"""The target's MoE layers unrolled (the model today) against one ``lax.scan`` over their weights
stacked on a leading axis: what each costs to compile and to run, for one target call.

The decode programs compile the target once per (batch, K, prompt block, draft kind): with its
layers unrolled a program grows with the depth, and compiling is most of the test suite's time
and of a first serve.py job's. A scan compiles one layer body whatever the depth, but every
iteration reads its layer's weights out of the stack. This measures both on one process, same
weights: the call as the loop makes it (cache donated, written in place), the two forms timed
alternately, medians, and their logits compared; each setting compiled twice, the faster kept;
unoptimized (the suite's setting, tests/conftest.py) and optimized (a user's). The scan form here
is a measuring harness built from the library's own layers, not a code path of the library.

    .venv/bin/python benchmarks/layer_scan.py [--target demo/target] [--shapes 1x1,8x5,8x64] [--repeats 31]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import REPO, load_average, machine, shown_path, table

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.models.layers import rope_cos_sin


def unrolled(tgraph, tstate, ids_BT, positions_BT, cache):
    model = nnx.merge(tgraph, tstate)
    out = model(ids_BT, positions_BT, cache, ())
    return model.logits(out.hidden_BTD), out.cache


def scanned(tgraph, tstate, lgraph, stacked, first_moe, ids_BT, positions_BT, cache):
    """Target.__call__ with the MoE layers (first_moe..L-1) as one scan over ``stacked``."""
    model = nnx.merge(tgraph, tstate)
    x_BTD = model.embed(ids_BT)
    cos, sin = rope_cos_sin(positions_BT, jnp.asarray(model.rope_inv_freq, jnp.float32), model.rope_attn_factor)
    for i in range(first_moe):
        x_BTD, cache = model.layers[i](x_BTD, positions_BT, cos, sin, cache, i, model.softmax_scale)

    def layer(carry, xs):
        x_BTD, cache = carry
        weights, i = xs
        return nnx.merge(lgraph, weights)(x_BTD, positions_BT, cos, sin, cache, i, model.softmax_scale), None

    layers = jnp.arange(first_moe, model.cfg.num_hidden_layers)
    (x_BTD, cache), _ = jax.lax.scan(layer, (x_BTD, cache), (stacked, layers))
    return model.logits(model.norm(x_BTD)), cache


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(REPO / "demo" / "target"))
    ap.add_argument("--shapes", default="1x1,8x5,8x64", help="batch x new tokens of each call")
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)   # every compile is a compile

    target = e3.load_target(args.target)
    cfg = target.model.cfg
    first_moe = cfg.first_k_dense_replace
    moe = [target.model.layers[i] for i in range(first_moe, cfg.num_hidden_layers)]
    if not moe or not all(cfg.is_moe_layer(i) for i in range(first_moe, cfg.num_hidden_layers)):
        raise SystemExit(f"{args.target}: expected dense layers then MoE layers only")
    lgraph = nnx.split(moe[0])[0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.split(m)[1] for m in moe])
    forms = {
        "unrolled": (jax.jit(unrolled, static_argnums=(0,), donate_argnums=(4,)), (target.graphdef, target.state), (target.state,)),
        "scan": (jax.jit(scanned, static_argnums=(0, 2, 4), donate_argnums=(7,)),
                 (target.graphdef, target.state, lgraph, stacked, first_moe), (target.state, stacked)),
    }
    print(f"# {shown_path(args.target)}: {cfg.num_hidden_layers} layers ({first_moe} dense, {len(moe)} MoE as the scan), "
          f"hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts, float32; cache capacity {args.capacity}")
    print(f"# {machine()}; load average {load_average()}; median of {args.repeats} calls, the two forms alternating")
    rows = []
    for optimized in (False, True):
        jax.config.update("jax_disable_most_optimizations", not optimized)
        for shape in args.shapes.split(","):
            B, T = (int(x) for x in shape.split("x"))
            ids_BT = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 16, (B, T))
            compiled, compile_s, caches, logits = {}, {}, {}, {}
            for name, (fn, static_args, _) in forms.items():
                for _ in range(2):
                    jax.clear_caches()   # else the second compile is found in memory
                    start = time.perf_counter()
                    compiled[name] = fn.lower(*static_args, ids_BT, positions_BT, target.init_cache(B, args.capacity)).compile()
                    compile_s[name] = min(compile_s.get(name, np.inf), time.perf_counter() - start)
                caches[name] = target.init_cache(B, args.capacity)
            ms = {name: [] for name in forms}
            for _ in range(args.repeats + 1):   # the first call of each is not timed
                for name, (_, _, dynamic) in forms.items():
                    start = time.perf_counter()
                    out, caches[name] = compiled[name](*dynamic, ids_BT, positions_BT, caches[name])
                    logits[name] = np.asarray(jax.block_until_ready(out))
                    ms[name].append(1e3 * (time.perf_counter() - start))
            med = {name: statistics.median(v[1:]) for name, v in ms.items()}
            diff = float(np.abs(logits["unrolled"] - logits["scan"]).max())
            rows.append(["yes" if optimized else "no", B, T, f"{compile_s['unrolled']:.1f}", f"{compile_s['scan']:.1f}",
                         f"{compile_s['scan'] / compile_s['unrolled']:.2f}", f"{med['unrolled']:.2f}",
                         f"{med['scan']:.2f}", f"{med['scan'] / med['unrolled']:.2f}", f"{diff:.1e}"])
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print()
    print(table(["optimized", "B", "T", "compile s, unrolled", "compile s, scan", "scan / unrolled",
                 "call ms, unrolled", "call ms, scan", "scan / unrolled", "largest logit difference"], rows))


if __name__ == "__main__":
    main()
