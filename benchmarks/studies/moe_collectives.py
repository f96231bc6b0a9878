"""Expert-parallel token exchange for one MoE layer's routed experts, on an 8-device mesh.

E experts are sharded over the ``expert`` axis (E/8 per device); every scheme runs inside
``jax.shard_map`` and each device computes only its local experts with kernels/experts.py's ``experts_blocked``.
Two token layouts, two schemes each:

  replicated in/out (what serving with data=1 has: every device holds every token)
    * ``psum``        moe.py today: each device runs its experts on the tokens routed to them (all
                      tokens are there), then a psum over ``expert`` sums the partial outputs.
    * ``a2a``         each device takes its 1/8 of the tokens (a free slice), sends every (token,
                      expert) assignment to the device owning the expert (``all_to_all``, a fixed
                      capacity of C rows per destination), the owners compute, a second
                      ``all_to_all`` sends the rows back, the source combines them with the routing
                      weights, and an ``all_gather`` rebuilds the replicated output.
  sharded in/out (tokens split over the 8 devices, e.g. a batch sharded over them)
    * ``gather+rs``   ``all_gather`` the tokens, compute local experts, ``psum_scatter`` (reduce-
                      scatter) the outputs back to each device's tokens.
    * ``a2a``         as above without the final all_gather.

Capacity: ``dropless`` = C = tokens per device x top-k (no assignment can be dropped, the output
equals the reference); ``cf=X`` = C = ceil(X x tokens per device x top-k / 8) (the usual capacity
factor; assignments past C are dropped, counted in the ``dropped`` column, so its output differs
when any are).
Every output is compared with one device running all experts (``experts_blocked`` unsharded).
The 8 devices are fake CPU devices of one process sharing one memory: this measures the compute
and copy overhead of each scheme, not an interconnect.

    .venv/bin/python benchmarks/studies/moe_collectives.py [--tokens 8,64,512] [--experts 64] [--topk 8]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/_common.py
from _common import machine, table, time_calls  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from eagle3_jax.kernels.experts import experts_blocked  # noqa: E402
from eagle3_jax.sharding import make_mesh  # noqa: E402

AX = "expert"


def make_inputs(M, E, K, D, F, seed=0):
    kx, ks, kg, ku, kd = jax.random.split(jax.random.key(seed), 5)
    x_MD = jax.random.normal(kx, (M, D), jnp.float32)
    top_MK, idx_MK = jax.lax.top_k(jax.random.normal(ks, (M, E), jnp.float32), K)
    weights_MK = jax.nn.softmax(top_MK, axis=-1) * 2.5
    w_gate = jax.random.normal(kg, (E, D, F), jnp.float32) / np.sqrt(D)
    w_up = jax.random.normal(ku, (E, D, F), jnp.float32) / np.sqrt(D)
    w_down = jax.random.normal(kd, (E, F, D), jnp.float32) / np.sqrt(F)
    return x_MD, idx_MK.astype(jnp.int32), weights_MK, w_gate, w_up, w_down


# ---------------------------------------------------------------------- per-device bodies
def local_psum(x_MD, idx_MK, w_MK, wg, wu, wd):
    """moe.py's MoE._sharded body: local experts on every token, psum of the partial outputs."""
    first = jax.lax.axis_index(AX) * wg.shape[0]
    return jax.lax.psum(experts_blocked(x_MD, idx_MK, w_MK, wg, wu, wd, first), AX)


def local_gather_rs(x_md, idx_mK, w_mK, wg, wu, wd):
    """Tokens sharded: all_gather them, local experts, reduce-scatter the outputs."""
    x_MD, idx_MK, w_MK = (jax.lax.all_gather(a, AX, tiled=True) for a in (x_md, idx_mK, w_mK))
    first = jax.lax.axis_index(AX) * wg.shape[0]
    y_MD = experts_blocked(x_MD, idx_MK, w_MK, wg, wu, wd, first)
    return jax.lax.psum_scatter(y_MD, AX, scatter_dimension=0, tiled=True)


def a2a_exchange(x_md, idx_mK, w_mK, wg, wu, wd, *, capacity: int):
    """Dispatch each local (token, expert) assignment to the expert's owner, compute, send back,
    combine. Returns (y [m, D] for this device's tokens, assignments dropped on this device)."""
    n = jax.lax.axis_size(AX)
    E_local = wg.shape[0]
    m, K = idx_mK.shape
    C = capacity
    A = m * K
    expert_A = idx_mK.reshape(A)
    dest_A = expert_A // E_local
    token_A = jnp.arange(A, dtype=jnp.int32) // K
    # Position of each assignment among those bound for the same device (stable: token order).
    order_A = jnp.argsort(dest_A, stable=True)
    counts_n = jnp.bincount(dest_A, length=n)
    starts_n = jnp.cumsum(counts_n) - counts_n
    pos_sorted = jnp.arange(A, dtype=jnp.int32) - starts_n[dest_A[order_A]]
    pos_A = jnp.zeros((A,), jnp.int32).at[order_A].set(pos_sorted)
    kept_A = pos_A < C
    slot_A = jnp.where(kept_A, dest_A * C + pos_A, n * C)          # n*C: dropped (out of bounds)
    send_x = jnp.zeros((n * C, x_md.shape[1]), x_md.dtype).at[slot_A].set(x_md[token_A], mode="drop")
    send_e = jnp.full((n * C,), -1, jnp.int32).at[slot_A].set(expert_A, mode="drop")  # -1: empty slot
    # Row block i goes to device i; the received blocks come in source order.
    recv_x = jax.lax.all_to_all(send_x, AX, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, AX, 0, 0, tiled=True)
    first = jax.lax.axis_index(AX) * E_local
    # Weight 1 here; the routing weight is applied at the source. Empty slots (-1) are not local.
    y_recv = experts_blocked(recv_x, recv_e[:, None], jnp.ones((n * C, 1), jnp.float32), wg, wu, wd, first)
    y_back = jax.lax.all_to_all(y_recv, AX, 0, 0, tiled=True)
    contrib_A = y_back.at[slot_A].get(mode="fill", fill_value=0) * jnp.where(kept_A, w_mK.reshape(A), 0.0)[:, None]
    y_md = jnp.zeros_like(x_md).at[token_A].add(contrib_A)
    return y_md, jnp.sum(~kept_A).astype(jnp.int32)


def local_a2a_sharded(x_md, idx_mK, w_mK, wg, wu, wd, *, capacity):
    y_md, dropped = a2a_exchange(x_md, idx_mK, w_mK, wg, wu, wd, capacity=capacity)
    return y_md, jax.lax.psum(dropped, AX)


def local_a2a_replicated(x_MD, idx_MK, w_MK, wg, wu, wd, *, capacity):
    n, i = jax.lax.axis_size(AX), jax.lax.axis_index(AX)
    m = x_MD.shape[0] // n
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, i * m, m, axis=0)  # noqa: E731
    y_md, dropped = a2a_exchange(mine(x_MD), mine(idx_MK), mine(w_MK), wg, wu, wd, capacity=capacity)
    return jax.lax.all_gather(y_md, AX, tiled=True), jax.lax.psum(dropped, AX)


# ---------------------------------------------------------------------- programs
def build(mesh, body, tokens_sharded: bool, returns_dropped: bool):
    t = P(AX, None) if tokens_sharded else P(None, None)
    w = P(AX, None, None)
    out = (t, P()) if returns_dropped else t
    fn = jax.shard_map(body, mesh=mesh, in_specs=(t, t, t, w, w, w), out_specs=out, check_vma=False)
    return jax.jit(fn)


def capacity_for(M: int, K: int, n: int, cf: float | None) -> int:
    per_device = M // n * K
    return per_device if cf is None else max(1, math.ceil(cf * per_device / n))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,64,512", help="tokens M per layer call (multiples of 8)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--capacity-factor", type=float, default=2.0, help="the non-dropless a2a variant's factor")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    E, K, D, F, cf = args.experts, args.topk, args.hidden, args.ffn, args.capacity_factor
    mesh = make_mesh("data=1,expert=8,tensor=1")
    n = mesh.shape[AX]
    t_start = time.perf_counter()
    print(f"# moe_collectives  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}, "
          f"{jax.device_count()} devices); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# E={E} experts ({E // n} per device on expert={n}), top-{K}, D={D}, F={F}, float32; "
          "ms per layer call (routed experts only, routing given)")

    rows = []
    for M in (int(m) for m in args.tokens.split(",")):
        inputs = make_inputs(M, E, K, D, F)
        ref = np.asarray(jax.jit(experts_blocked, static_argnums=(6,))(*inputs, 0))
        scale = float(np.abs(ref).max())
        rep = NamedSharding(mesh, P())
        shd = NamedSharding(mesh, P(AX, None))
        wsh = NamedSharding(mesh, P(AX, None, None))
        w = [jax.device_put(a, wsh) for a in inputs[3:]]
        tok_rep = [jax.device_put(a, rep) for a in inputs[:3]]
        tok_shd = [jax.device_put(a, shd) for a in inputs[:3]]
        C_full, C_cf = capacity_for(M, K, n, None), capacity_for(M, K, n, cf)
        variants = [
            ("replicated", "psum (moe.py)", "-", build(mesh, local_psum, False, False), tok_rep),
            ("replicated", "a2a", f"dropless C={C_full}",
             build(mesh, functools.partial(local_a2a_replicated, capacity=C_full), False, True), tok_rep),
            ("replicated", "a2a", f"cf={cf:g} C={C_cf}",
             build(mesh, functools.partial(local_a2a_replicated, capacity=C_cf), False, True), tok_rep),
            ("sharded", "gather+rs", "-", build(mesh, local_gather_rs, True, False), tok_shd),
            ("sharded", "a2a", f"dropless C={C_full}",
             build(mesh, functools.partial(local_a2a_sharded, capacity=C_full), True, True), tok_shd),
            ("sharded", "a2a", f"cf={cf:g} C={C_cf}",
             build(mesh, functools.partial(local_a2a_sharded, capacity=C_cf), True, True), tok_shd),
        ]
        base = {}
        for layout, scheme, cap, fn, toks in variants:
            call = functools.partial(fn, *toks, *w)
            out = call()
            y, dropped = (out if isinstance(out, tuple) else (out, 0))
            diff = float(np.abs(np.asarray(y) - ref).max()) / scale
            ms = 1e3 * time_calls(call, args.repeats, warmup=1, min_time=0.5)
            base.setdefault(layout, ms)
            rows.append([M, layout, scheme, cap, int(dropped), ms, ms / base[layout], f"{diff:.1e}"])
        print(f"  M={M} done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    print()
    print("Token exchange schemes (ms per call; 'vs first' = relative to psum / gather+rs of the same M and layout)")
    print(table(["M tokens", "layout", "scheme", "capacity", "dropped", "ms", "vs first", "max diff / max |y|"], rows))
    print(f"\n# total wall time {time.perf_counter() - t_start:.0f} s; load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes share these cores)")


if __name__ == "__main__":
    main()
