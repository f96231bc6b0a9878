"""Expert kernels compared by the TPU compiler's numbers (compiled for TPU on this host, not run).

One MoE layer's routed experts on one chip of a TPU slice, at a full-width model's shapes with the
experts split over an expert axis of ``--expert-shards`` chips (Kimi-K2.5: 384 / 16 = 24 local
experts, D 7168, F 2048, top-8), M tokens (decode of 32 rows verifying K = 4: 160). For each kernel:
temporaries and peak bytes per chip, and the compiler's flops / bytes accessed. A while loop's body
is counted once by the cost analysis, so ``blocked`` shows one trip; Pallas kernels report their
own cost estimate for the whole grid (padding blocks included).

  * bf16 stacks: ``blocked``, ``ragged`` (lax.ragged_dot), ``padded_blocks``, and megablox ``gmm``
    (jax.experimental.pallas.ops.tpu.megablox, rows sorted by expert and padded to its 128-row tiles);
  * INT4 / FP8 stacks as stored: ``blocked`` vs ``grouped`` (kernels/quant_gmm.py).

    .venv/bin/python benchmarks/tpu_expert_kernels.py [--topology v5p:2x2x1] [--tokens 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from _common import table

import jax
import jax.numpy as jnp

from eagle3_jax.kernels import experts
from eagle3_jax.models.quantized import Fp8Stack, Int4Stack, QuantLayout
from tools import tpu


def experts_megablox(x_MD, idx_MK, weights_MK, wg, wu, wd, first):
    """Float experts through megablox gmm: assignments sorted by expert, padded to 128-row tiles;
    rows past the local assignments are left unwritten by gmm, so they are masked, not trusted."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    token_A, weight_A, counts_E = experts.sort_assignments(idx_MK, weights_MK, first, wg.shape[0])
    A = token_A.shape[0]
    pad = -A % 128
    x_AD = jnp.pad(x_MD[token_A], ((0, pad), (0, 0)))
    valid_A1 = (jnp.arange(A + pad) < counts_E.sum())[:, None]
    g_AF = gmm(x_AD, wg, counts_E, preferred_element_type=x_MD.dtype)
    u_AF = gmm(x_AD, wu, counts_E, preferred_element_type=x_MD.dtype)
    h_AF = jnp.where(valid_A1, jax.nn.silu(g_AF) * u_AF, 0)
    y_AD = jnp.where(valid_A1, gmm(h_AF, wd, counts_E, preferred_element_type=x_MD.dtype), 0)[:A]
    return jnp.zeros_like(x_MD).at[token_A].add(y_AD * weight_A[:, None].astype(y_AD.dtype))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--local-experts", type=int, default=24, help="INT4 / bf16 (Kimi-K2.5 384 / 16)")
    ap.add_argument("--fp8-local-experts", type=int, default=16, help="FP8 (DeepSeek-V3 256 / 16)")
    ap.add_argument("--only", default="bf16,int4,fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    one = jax.sharding.SingleDeviceSharding(tpu.topology_devices(args.topology)[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    M, K, D, F = args.tokens, args.top_k, args.hidden, args.ffn
    routing = (sds((M, D), jnp.bfloat16), sds((M, K), jnp.int32), sds((M, K), jnp.float32))
    rows = []

    def run(stacks, name, fn, ws):
        st = tpu.compile_stats(jax.jit(fn), (*routing, *ws), name=name)
        rows.append({"stacks": stacks, "kernel": name, "temp": st.temp, "peak": st.peak, "flops": st.flops,
                     "bytes_accessed": st.bytes_accessed, "compile_s": round(st.compile_s, 1)})
        print(json.dumps(rows[-1]), flush=True)

    if "bf16" in args.only:
        E = args.local_experts
        ws = (sds((E, D, F), jnp.bfloat16), sds((E, D, F), jnp.bfloat16), sds((E, F, D), jnp.bfloat16))
        for name, fn in [("blocked", experts.experts_blocked), ("ragged", experts.experts_ragged),
                         ("padded_blocks", experts.experts_padded_blocks), ("megablox_gmm", experts_megablox)]:
            run("bf16", name, lambda x, i, w, a, b, c, fn=fn: fn(x, i, w, a, b, c, 0), ws)
    for kind in ("int4", "fp8"):
        if kind not in args.only:
            continue
        if kind == "int4":
            E, lay, cls = args.local_experts, QuantLayout(experts="int4"), Int4Stack
            mk = lambda O, I: (sds((E, O, I // 8), jnp.int32), sds((E, O, I // 32), jnp.bfloat16))
        else:
            E, lay, cls = args.fp8_local_experts, QuantLayout(experts="fp8"), Fp8Stack
            mk = lambda O, I: (sds((E, O, I), jnp.float8_e4m3fn), sds((E, O // 128, I // 128), jnp.float32))
        conts = (cls(1, F, D, (None,) * 3, lay, None), cls(1, F, D, (None,) * 3, lay, None),
                 cls(1, D, F, (None,) * 3, lay, None))
        ws = (*mk(F, D), *mk(F, D), *mk(D, F))
        for name, fn in [("blocked", experts.experts_blocked_quantized),
                         ("grouped", lambda *a, **k: experts.experts_grouped_quantized(*a, **k, platform="tpu"))]:
            def f(x, i, w, gv, gs, uv, us, dv, ds, fn=fn):
                return fn(x, i, w, (gv, gs, conts[0]), (uv, us, conts[1]), (dv, ds, conts[2]), 0)
            run(kind, name, f, ws)
    print(f"compiled for {args.topology}, one chip, {M} tokens, top-{K}, D {D}, F {F}")
    print(table(["stacks", "kernel", "temp MB", "peak MB", "GFLOP", "GB accessed"],
                [[r["stacks"], r["kernel"], r["temp"] / 1e6, r["peak"] / 1e6, r["flops"] / 1e9,
                  r["bytes_accessed"] / 1e9] for r in rows]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"benchmark": "tpu_expert_kernels", "topology": args.topology, "tokens": M, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
