"""Greedy target-only decoding: our JAX target vs transformers' generate(), same weights, same prompts.

One random checkpoint of the bench shape (benchmarks/_common.py) is written with transformers'
save_pretrained and read back with ``eagle3_jax.load_target``. For each batch size, both produce N
new tokens from the same prompts:
  * ``hf``   — ``model.generate(do_sample=False, max_new_tokens=N)`` with its KV cache;
  * ``ours`` — ``Generator(target, None)``: the library's decode loop (the serve engine, target only).
transformers is timed with 1 and 2 torch threads (on a 2-core machine shared with other processes, 2
OpenMP threads can be ~10x slower than 1); the ratios use the faster of the two. Times are steady
state (compile excluded by warm-up calls) and cover prefill + N new tokens for both; tok/s = batch *
N / seconds. Token agreement is ours against transformers', position by position (float32; a
near-tie argmax may flip and change the rest of that row, so late positions disagree first).

    .venv/bin/python benchmarks/target_decode.py [--new-tokens 64] [--prompt-len 32] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import bench_target_config, machine, table

import jax
import numpy as np
import torch

import eagle3_jax as e3
from tools.random_target import save_random_target


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


def agreement(a: np.ndarray, ref: np.ndarray) -> tuple[float, int]:
    """(% identical tokens, first position where any row differs, or N if none)."""
    a, ref = np.asarray(a), np.asarray(ref)
    same = a == ref
    bad_cols = np.nonzero(~same.all(axis=0))[0]
    return 100.0 * same.mean(), int(bad_cols[0]) if len(bad_cols) else a.shape[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-threads", default="1,2",
                    help="torch thread counts to time transformers with; ratios use the fastest")
    args = ap.parse_args()
    hf_threads = [int(t) for t in args.hf_threads.split(",")]
    N, T = args.new_tokens, args.prompt_len
    batches = [int(b) for b in args.batches.split(",")]
    cfg = bench_target_config()
    t_start = time.perf_counter()

    print(f"# target_decode  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"torch {torch.__version__} threads={args.hf_threads}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
          f"({cfg['first_k_dense_replace']} dense), {cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']}, "
          f"vocab {cfg['vocab_size']}, float32; prompt {T} tokens, {N} new tokens, median of {args.repeats}")

    with tempfile.TemporaryDirectory() as tmp:
        _, hf_model = save_random_target(Path(tmp), cfg)
        hf_model.generation_config.eos_token_id = None
        hf_model.generation_config.pad_token_id = 0
        target = e3.load_target(tmp, dtype="float32")

    prompts = np.random.default_rng(0).integers(2, cfg["vocab_size"], size=(max(batches), T))
    rows, agree_rows = [], []
    for B in batches:
        ids = prompts[:B]
        gen = e3.Generator(target, None, max_len=T + N + 2)
        decoders = {f"hf@{t}t": _hf_decoder(hf_model, ids, N, t) for t in hf_threads}
        decoders["ours"] = lambda n=N: np.array(gen.generate(ids.tolist(), n, prompt_len=T).tokens)
        for name, fn in decoders.items():  # warm-up: compiles ours; a short generate for transformers
            fn(4) if name.startswith("hf") else fn()
        # Round-robin repeats, so load from other processes hits every decoder alike; then medians.
        samples, toks = {name: [] for name in decoders}, {}
        for _ in range(args.repeats):
            for name, fn in decoders.items():
                t0 = time.perf_counter()
                toks[name] = fn()
                samples[name].append(time.perf_counter() - t0)
        secs = {name: statistics.median(v) for name, v in samples.items()}
        hf_best = min((k for k in secs if k.startswith("hf")), key=secs.get)
        tps = {k: B * N / v for k, v in secs.items()}
        rows.append([B] + [tps[f"hf@{t}t"] for t in hf_threads] + [tps["ours"], tps["ours"] / tps[hf_best]])
        pct, first = agreement(toks["ours"], toks[hf_best])
        agree_rows.append([B, "ours vs hf", f"{pct:.1f}%", first])

    print()
    print("Steady-state greedy decode, tok/s (higher is better); ratios > 1 mean ours is faster")
    print(table(["batch"] + [f"hf {t} thread{'s' if t > 1 else ''} tok/s" for t in hf_threads] + [
        "ours tok/s", "ours / best hf"], rows))
    print()
    print(f"Generated-token agreement over {N} new tokens (ours vs the fastest hf run; first differing position, {N} = none)")
    print(table(["batch", "pair", "identical tokens", "first diff at"], agree_rows))
    print(f"\n# total wall time {time.perf_counter() - t_start:.0f} s; load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes share these cores)")


if __name__ == "__main__":
    main()
