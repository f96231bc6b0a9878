"""Routed-expert compute cost vs the number of experts E, at a fixed number of tokens.

For each (M rows, E experts) the same routed assignment (top-k of random scores) is run through:
  * ``blocked`` — ``eagle3_jax.kernels.experts.experts_blocked``: a loop over row blocks of the experts hit;
  * ``ragged``  — ``eagle3_jax.kernels.experts.experts_ragged``: ``jax.lax.ragged_dot`` (native grouped
                  matmul on TPU; on the CPU backend XLA lowers it to ONE dense dot over all E
                  experts' weights with the rows masked per group, i.e. O(rows x E));
  * ``dense``   — a reference that runs every token through every expert and masks the result
                  with the routing weights (O(M x E), what a naive MoE would do).
All three are jitted and compiled ahead of time (compile excluded); the timing is the median of
repeated calls (a single call where one call takes more than a few seconds). All three outputs are
compared (max |difference| against the dense reference, and relative to max |y|).

    .venv/bin/python benchmarks/moe_dispatch.py [--experts 8,64,384] [--rows 8,512] [--topk 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import machine, table

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.kernels.experts import block_rows, experts_blocked, experts_ragged


def experts_dense(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    """Every token through every expert, then the routing weights (0 for experts not chosen)."""
    M, E = x_MD.shape[0], w_gate_EDF.shape[0]
    combine_ME = jnp.zeros((M, E), jnp.float32).at[jnp.arange(M)[:, None], idx_MK - first_expert].add(
        weights_MK, mode="drop")
    g_MEF = jnp.einsum("md,edf->mef", x_MD, w_gate_EDF)
    u_MEF = jnp.einsum("md,edf->mef", x_MD, w_up_EDF)
    h_MEF = jax.nn.silu(g_MEF) * u_MEF * combine_ME[:, :, None].astype(x_MD.dtype)
    return jnp.einsum("mef,efd->md", h_MEF, w_down_EFD)


KERNELS = {"blocked": experts_blocked, "ragged": experts_ragged, "dense": experts_dense}


def make_inputs(M, E, K, D, F, seed=0, dtype=jnp.float32):
    kx, ks, kg, ku, kd = jax.random.split(jax.random.key(seed), 5)
    x_MD = jax.random.normal(kx, (M, D), dtype)
    scores_ME = jax.random.normal(ks, (M, E), jnp.float32)
    top_MK, idx_MK = jax.lax.top_k(scores_ME, K)
    weights_MK = jax.nn.softmax(top_MK, axis=-1) * 2.5
    w_gate = (jax.random.normal(kg, (E, D, F), jnp.float32) / np.sqrt(D)).astype(dtype)
    w_up = (jax.random.normal(ku, (E, D, F), jnp.float32) / np.sqrt(D)).astype(dtype)
    w_down = (jax.random.normal(kd, (E, F, D), jnp.float32) / np.sqrt(F)).astype(dtype)
    return x_MD, idx_MK.astype(jnp.int32), weights_MK, w_gate, w_up, w_down


def blocked_trips(idx_MK: np.ndarray, E: int) -> tuple[int, int, int]:
    """(experts hit, loop trips, block rows) of experts_blocked for this routing (moe.py's formula)."""
    M, K = idx_MK.shape
    b = block_rows(M, K, E)
    counts = np.bincount(np.asarray(idx_MK).reshape(-1), minlength=E)
    return int((counts > 0).sum()), int(((counts + b - 1) // b).sum()), b


def time_compiled(compiled, args, repeats: int, slow_s: float) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - t0
    if first > slow_s:
        return first
    samples = [first]
    while len(samples) < repeats or sum(samples) < 0.5:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="8,64,384")
    ap.add_argument("--rows", default="8,512", help="tokens M: 8 = a decode step, 512 = a prefill chunk")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--slow-s", type=float, default=3.0, help="one timed call only when a call takes longer")
    args = ap.parse_args()
    K, D, F = args.topk, args.hidden, args.ffn
    t_start = time.perf_counter()
    print(f"# moe_dispatch  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}); "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# top-{K}, D={D}, F={F}, {args.dtype}; times are ms per call (routing sort + 3 expert matmuls + combine)")

    rows = []
    for M in (int(m) for m in args.rows.split(",")):
        base = {}
        for E in (int(e) for e in args.experts.split(",")):
            inputs = make_inputs(M, E, K, D, F, dtype=jnp.dtype(args.dtype))
            ms, outs = {}, {}
            for name, fn in KERNELS.items():
                compiled = jax.jit(fn, static_argnums=(6,)).lower(*inputs, 0).compile()
                outs[name] = np.asarray(compiled(*inputs))
                ms[name] = 1e3 * time_compiled(compiled, inputs, args.repeats, args.slow_s)
            base.setdefault("blocked", ms["blocked"])
            base.setdefault("ragged", ms["ragged"])
            hit, trips, b = blocked_trips(np.asarray(inputs[1]), E)
            ref = outs["dense"].astype(np.float32)
            scale = float(np.abs(ref).max())
            d_blk = float(np.abs(outs["blocked"].astype(np.float32) - ref).max())
            d_rag = float(np.abs(outs["ragged"].astype(np.float32) - ref).max())
            rows.append([M, E, hit, f"{trips} x {b}", ms["blocked"], ms["ragged"], ms["dense"],
                         ms["blocked"] / base["blocked"], ms["ragged"] / base["ragged"],
                         ms["ragged"] / ms["blocked"], ms["dense"] / ms["blocked"],
                         f"{d_blk:.1e} / {d_rag:.1e}", f"{max(d_blk, d_rag) / scale:.1e}"])
            # the numbers as they come too: a run cut short (a lease, a timeout) keeps what it measured
            print(f"  M={M} E={E} done ({time.perf_counter() - t_start:.0f} s): blocked {ms['blocked']:.3f} ms, "
                  f"ragged {ms['ragged']:.3f} ms, dense {ms['dense']:.3f} ms", flush=True)
            del inputs, outs

    print()
    print("Expert compute vs number of experts (ms per call; growth columns are relative to the first E of that M)")
    print(table(["M rows", "E", "experts hit", "blocked trips x rows", "blocked ms", "ragged ms", "dense ms",
                 "blocked growth", "ragged growth", "ragged / blocked", "dense / blocked",
                 "max abs diff blk / rag vs dense", "diff / max abs y"], rows))
    print(f"\n# total wall time {time.perf_counter() - t_start:.0f} s; load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes share these cores)")


if __name__ == "__main__":
    main()
