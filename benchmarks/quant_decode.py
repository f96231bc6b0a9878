"""Decode speed of a target holding INT4 routed experts vs the same target in bfloat16.

One random DeepSeek-V3-shaped target (the bench shape of benchmarks/_common.py) is built with INT4
experts (packed words + bf16 group scales, as ``load_target(weights="native")`` holds Kimi-K2.5),
and its twin holds exactly those weights dequantized to bfloat16 (``weights="bfloat16"``); every
other parameter is shared. Both decode greedily, target only, the same prompts; calls alternate
(int4, bf16, int4, ...) so load from other processes hits both alike. Decode time = generate(N new
tokens) - generate(1 new token) (the prefill), each a median over the repeats after a warm-up
call (compile excluded); tok/s = batch * (N - 1) / decode time.

    .venv/bin/python benchmarks/quant_decode.py [--batches 1,8] [--new-tokens 32] [--repeats 5]
        [--int4-kernels grouped,blocked]   # INT4 expert kernels side by side (default: the platform's)
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import bench_target_config, machine, table

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.config import TargetConfig
from eagle3_jax.models.quantized import Int4Stack, QuantLayout


def twins(cfg: TargetConfig, seed: int = 0, int4_kernel: str | None = None):
    """(int4 target, bf16 target with the int4 experts dequantized and everything else equal).
    ``int4_kernel``: the quantized expert kernel (default: the platform's)."""
    q = e3.build_target(cfg, dtype="bfloat16", seed=seed, quant=QuantLayout(experts="int4"), moe_kernel=int4_kernel)
    f = e3.build_target(cfg, dtype="bfloat16", seed=seed)
    qflat = {tuple(p): v for p, v in nnx.to_flat_state(q.state)}
    fflat = {tuple(p): v for p, v in nnx.to_flat_state(f.state)}
    for path, var in fflat.items():
        if path in qflat:
            var.set_value(qflat[path].get_value())
    for i, layer in enumerate(q.model.layers):
        for name in ("w_gate", "w_up", "w_down"):
            stack = getattr(layer.mlp, name, None)
            if isinstance(stack, Int4Stack):
                packed = qflat[("layers", i, "mlp", name, "packed")].get_value()
                scale = qflat[("layers", i, "mlp", name, "scale")].get_value()
                # [E, out, in] in the checkpoint's orientation -> our float layout [E, in, out]
                w_EOI = stack.dequant_one(packed, scale, jnp.bfloat16)
                fflat[("layers", i, "mlp", name)].set_value(jnp.swapaxes(w_EOI, 1, 2))
    return q, f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--int4-kernels", default="",
                    help="comma-separated quantized expert kernels to run side by side (blocked, grouped); "
                         "default: the platform's own")
    args = ap.parse_args()
    cfg = TargetConfig.from_hf_dict(bench_target_config())
    names = [k.strip() for k in args.int4_kernels.split(",") if k.strip()] or [None]
    q, f = twins(cfg, int4_kernel=names[0])
    label = lambda name: "int4 experts" + (f" ({name})" if name else "")
    kinds = {label(names[0]): q}
    for name in names[1:]:   # the same seed: the same packed experts, another kernel over them
        kinds[label(name)] = e3.build_target(cfg, dtype="bfloat16", seed=0, quant=QuantLayout(experts="int4"),
                                             moe_kernel=name)
    kinds["bfloat16"] = f
    int4_kinds = [k for k in kinds if k != "bfloat16"]
    N = args.new_tokens
    bytes_ = {k: t.param_bytes_by_kind() for k, t in kinds.items()}
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        prompts = np.random.default_rng(B).integers(2, cfg.vocab_size, size=(B, args.prompt_len)).tolist()
        gens = {k: e3.Generator(t, None, max_len=args.prompt_len + N + 1) for k, t in kinds.items()}
        tokens = {}
        for k, g in gens.items():  # warm-up: compile both programs (N tokens, 1 token)
            tokens[k] = g.generate(prompts, N).tokens
            g.generate(prompts, 1)
        samples = {k: {"full": [], "prefill": []} for k in gens}
        for _ in range(args.repeats):
            for k, g in gens.items():
                for what, n in (("full", N), ("prefill", 1)):
                    t0 = time.perf_counter()
                    g.generate(prompts, n)
                    samples[k][what].append(time.perf_counter() - t0)
        decode = {k: statistics.median(s["full"]) - statistics.median(s["prefill"]) for k, s in samples.items()}
        for k in gens:
            # agreement of each int4 kernel's tokens with the first int4 kernel's and with bf16's
            agree = np.mean([a == b for ra, rb in zip(tokens[k], tokens["bfloat16"]) for a, b in zip(ra, rb)])
            same = np.mean([a == b for ra, rb in zip(tokens[k], tokens[int4_kinds[0]]) for a, b in zip(ra, rb)])
            print(f"  batch {B} {k}: decode {decode[k] * 1e3:.1f} ms, {B * (N - 1) / decode[k]:.1f} tok/s, "
                  f"agreement with bf16 {agree:.3f}", flush=True)
            rows.append([B, k, f"{bytes_[k]['routed experts (int4)' if k != 'bfloat16' else 'routed experts (bfloat16)'] / 1e6:.2f}",
                         f"{decode[k] * 1e3:.1f}", f"{B * (N - 1) / decode[k]:.1f}",
                         f"{decode['bfloat16'] / decode[k]:.2f}x", f"{agree:.3f}", f"{same:.3f}"])
    print(f"# quant_decode: {machine()}, jax {jax.__version__} on {jax.default_backend()}; "
          f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts x [{cfg.hidden_size} x "
          f"{cfg.moe_intermediate_size}] top-{cfg.num_experts_per_tok}; {N} new tokens after {args.prompt_len}; "
          f"median of {args.repeats} interleaved runs, compile excluded")
    print(table(["batch", "experts", "expert MB", "decode ms", "tok/s", "speed vs bf16", "token agreement with bf16",
                 f"with {int4_kinds[0]}"], rows))


if __name__ == "__main__":
    main()
