"""Greedy target-only decoding: our JAX target vs transformers' generate(), same weights, same prompts.

One random DeepSeek-V3-shaped checkpoint is written with transformers' save_pretrained and read back
with ``eagle3_jax.load_target``. For each batch size, three decoders produce N new tokens from the
same prompts:
  * ``hf``      — ``model.generate(do_sample=False, max_new_tokens=N)`` with its KV cache;
  * ``py-loop`` — ours, one jitted ``LoadedTarget.extend`` call per token, driven from Python
                  (prefill, then argmax + extend per step; what the API offers today);
  * ``jit-loop``— ours, prefill + ``lax.fori_loop`` over decode steps in ONE jitted program
                  (``nnx.merge`` of ``graphdef/state`` inside ``jax.jit``).
transformers is timed with 1 and 2 torch threads (on a 2-core machine shared with other processes, 2
OpenMP threads can be ~10x slower than 1); the ratios use the faster of the two. Times are steady state (compile excluded by warm-up calls) and cover prefill + N new tokens, for
every decoder alike; tok/s = batch * N / seconds. Token agreement is each decoder's tokens against
transformers', position by position (float32; a near-tie argmax may flip and change the rest of
that row, so late positions disagree first).

    .venv/bin/python benchmarks/target_decode.py [--new-tokens 64] [--prompt-len 32] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import BENCH_TARGET_CONFIG, block, machine, save_random_hf_target, table, time_calls

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import eagle3_jax as e3


def hf_greedy(model, ids_BT: np.ndarray, n_new: int) -> np.ndarray:
    ids = torch.as_tensor(ids_BT, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0, eos_token_id=None,
        )
    return out[:, ids_BT.shape[1]:].numpy()


def _hf_decoder(model, ids_BT, n_new, threads):
    def run(n=n_new):
        torch.set_num_threads(threads)
        return hf_greedy(model, ids_BT, n)
    return run


def ours_python_loop(target: e3.LoadedTarget, ids_BT: np.ndarray, n_new: int) -> jax.Array:
    """What the API offers today: a jitted extend per token, argmax and bookkeeping in Python."""
    B, T = ids_BT.shape
    cache = target.init_cache(B, T + n_new)
    logits, _, cache, lengths = target.prefill(ids_BT, np.full((B,), T, np.int32), cache)
    tok_B = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    out = [tok_B]
    for _ in range(n_new - 1):
        logits, _, cache, lengths = target.extend(tok_B[:, None], lengths, cache)
        tok_B = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        out.append(tok_B)
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy_program(graphdef, state, ids_BT, n_new):
    """Prefill + (n_new - 1) decode steps as one XLA program; the cache lives in the loop carry."""
    model = nnx.merge(graphdef, state)
    B, T = ids_BT.shape
    cache = model.init_cache(B, T + n_new)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    step = model(ids_BT, positions_BT, cache)
    tok_B = jnp.argmax(model.logits(step.hidden_BTD[:, -1:])[:, 0], axis=-1).astype(jnp.int32)
    toks_BN = jnp.zeros((B, n_new), jnp.int32).at[:, 0].set(tok_B)

    def body(i, carry):
        tok_B, cache, toks_BN = carry
        m = nnx.merge(graphdef, state)
        pos_B1 = jnp.full((B, 1), T - 1, jnp.int32) + i
        s = m(tok_B[:, None], pos_B1, cache)
        tok_B = jnp.argmax(m.logits(s.hidden_BTD)[:, 0], axis=-1).astype(jnp.int32)
        return tok_B, s.cache, toks_BN.at[:, i].set(tok_B)

    _, _, toks_BN = jax.lax.fori_loop(1, n_new, body, (tok_B, step.cache, toks_BN))
    return toks_BN


def ours_jit_loop(target: e3.LoadedTarget, ids_BT: np.ndarray, n_new: int) -> jax.Array:
    return _greedy_program(target.graphdef, target.state, jnp.asarray(ids_BT, jnp.int32), n_new)


def agreement(a: np.ndarray, ref: np.ndarray) -> tuple[float, int]:
    """(% identical tokens, first position where any row differs, or N if none)."""
    a, ref = np.asarray(a), np.asarray(ref)
    same = a == ref
    bad_cols = np.nonzero(~same.all(axis=0))[0]
    return 100.0 * same.mean(), int(bad_cols[0]) if len(bad_cols) else a.shape[1]


def profile_step(target: e3.LoadedTarget, B: int, T: int, n_new: int, repeats: int) -> list[list]:
    """Splits one Python-driven decode step into: the jitted model call alone, and the eager rest."""
    cache = target.init_cache(B, T + n_new)
    tok_B1 = jnp.ones((B, 1), jnp.int32)
    lengths_B = jnp.full((B,), T, jnp.int32)
    pos_B1 = lengths_B[:, None]
    state = {"cache": cache}

    def call_only():  # the jitted model call at explicit positions, arguments already device arrays
        logits, _, state["cache"] = target.extend_at(tok_B1, pos_B1, state["cache"])
        return logits

    def full_step():  # what ours_python_loop does per token
        logits, _, state["cache"], _ = target.extend(tok_B1, lengths_B, state["cache"])
        return jnp.argmax(logits[:, -1], axis=-1)

    # the same model step, jitted alone, with graph/state flattening done once (nnx.merge inside)
    step_jit = jax.jit(lambda st, t, p, c: _step(target.graphdef, st, t, p, c), donate_argnums=(3,))

    def pure_step():
        logits, state["cache"] = step_jit(target.state, tok_B1, pos_B1, state["cache"])
        return logits

    flat_state = jax.tree_util.tree_leaves(target.state)
    leaves_jit = jax.jit(lambda leaves, t, p, c: _step(
        target.graphdef, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target.state), leaves),
        t, p, c), donate_argnums=(3,))

    def leaves_step():  # state passed as a flat list of arrays: no nnx.State pytree flattening
        logits, state["cache"] = leaves_jit(flat_state, tok_B1, pos_B1, state["cache"])
        return logits

    rows = []
    for name, fn in [("extend + argmax (py-loop step)", full_step), ("LoadedTarget.extend_at only", call_only),
                     ("jit(step), nnx.State arg", pure_step), ("jit(step), flat leaves arg", leaves_step)]:
        rows.append([f"B={B}", name, 1e3 * time_calls(fn, repeats=repeats, warmup=2, min_time=1.0)])
    return rows


def _step(graphdef, state, tok_B1, pos_B1, cache):
    m = nnx.merge(graphdef, state)
    s = m(tok_B1, pos_B1, cache)
    return m.logits(s.hidden_BTD), s.cache


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-threads", default="1,2",
                    help="torch thread counts to time transformers with; ratios use the fastest")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step breakdown")
    args = ap.parse_args()
    hf_threads = [int(t) for t in args.hf_threads.split(",")]
    N, T = args.new_tokens, args.prompt_len
    batches = [int(b) for b in args.batches.split(",")]
    cfg = BENCH_TARGET_CONFIG
    t_start = time.perf_counter()

    print(f"# target_decode  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"torch {torch.__version__} threads={args.hf_threads}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
          f"({cfg['first_k_dense_replace']} dense), {cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']}, "
          f"vocab {cfg['vocab_size']}, float32; prompt {T} tokens, {N} new tokens, median of {args.repeats}")

    with tempfile.TemporaryDirectory() as tmp:
        hf_model = save_random_hf_target(Path(tmp))
        hf_model.generation_config.eos_token_id = None
        hf_model.generation_config.pad_token_id = 0
        target = e3.load_target(tmp, dtype="float32")

    prompts = np.random.default_rng(0).integers(2, cfg["vocab_size"], size=(max(batches), T))
    rows, agree_rows, prof_rows = [], [], []
    for B in batches:
        ids = prompts[:B]
        decoders = {f"hf@{t}t": _hf_decoder(hf_model, ids, N, t) for t in hf_threads}
        decoders["py-loop"] = lambda: ours_python_loop(target, ids, N)
        decoders["jit-loop"] = lambda: ours_jit_loop(target, ids, N)
        for name, fn in decoders.items():  # warm-up: compiles ours; a short generate for transformers
            block(fn(4) if name.startswith("hf") else fn())
        # Round-robin repeats, so load from other processes hits every decoder alike; then medians.
        samples, toks = {name: [] for name in decoders}, {}
        for _ in range(args.repeats):
            for name, fn in decoders.items():
                t0 = time.perf_counter()
                toks[name] = np.asarray(block(fn()))
                samples[name].append(time.perf_counter() - t0)
        secs = {name: statistics.median(v) for name, v in samples.items()}
        hf_best = min((k for k in secs if k.startswith("hf")), key=secs.get)
        toks["hf"] = toks[hf_best]
        tps = {k: B * N / v for k, v in secs.items()}
        rows.append([B] + [tps[f"hf@{t}t"] for t in hf_threads] + [
            tps["py-loop"], tps["jit-loop"], tps["py-loop"] / tps[hf_best], tps["jit-loop"] / tps[hf_best],
            tps["jit-loop"] / tps["py-loop"]])
        for name in ("py-loop", "jit-loop"):
            pct, first = agreement(toks[name], toks["hf"])
            agree_rows.append([B, f"{name} vs hf", f"{pct:.1f}%", first])
        pct, first = agreement(toks["jit-loop"], toks["py-loop"])
        agree_rows.append([B, "jit-loop vs py-loop", f"{pct:.1f}%", first])
        if not args.no_profile:
            prof_rows += profile_step(target, B, T, N, repeats=20)

    print()
    print("Steady-state greedy decode, tok/s (higher is better); ratios > 1 mean ours is faster")
    print(table(["batch"] + [f"hf {t} thread{'s' if t > 1 else ''} tok/s" for t in hf_threads] + [
        "py-loop tok/s", "jit-loop tok/s", "py-loop / best hf", "jit-loop / best hf", "jit-loop / py-loop"], rows))
    print()
    print(f"Generated-token agreement over {N} new tokens (ours vs the fastest hf run; first differing position, {N} = none)")
    print(table(["batch", "pair", "identical tokens", "first diff at"], agree_rows))
    if prof_rows:
        print()
        print("One decode step (1 new token per row), median ms")
        print(table(["batch", "what", "ms / step"], prof_rows))
    print(f"\n# total wall time {time.perf_counter() - t_start:.0f} s; load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes share these cores)")


if __name__ == "__main__":
    main()
