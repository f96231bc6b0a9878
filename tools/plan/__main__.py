"""Command line: ``python -m tools.plan --model CONFIG --mesh data=1,expert=8,tensor=1 ...``.

    python -m tools.plan --model configs/models/kimi_k25.json --mesh data=1,expert=8,tensor=1 \\
        --batch 32 --max-len 8192 --num-draft-tokens 4 --hbm 141GB --expert-bits 16,4

``--mesh`` may be given several times (one plan per mesh). The fake CPU devices are created before
JAX starts, as many as the largest mesh needs (or ``--devices``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class DefaultsShownHelp(argparse.HelpFormatter):
    """Appends each option's default to its help; options without one (None, off) say nothing."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.plan", formatter_class=DefaultsShownHelp,
        description="Per-device memory of serving a DeepSeek-V3-class target with its EAGLE-3 draft on a mesh, "
                    "from abstract arrays and XLA's memory analysis of the compiled programs (no weights, no "
                    "accelerator needed).")
    p.add_argument("--model", required=True, help="target config.json (HF DeepseekV3 / Kimi-K2 / Kimi-K2.5 layout)")
    p.add_argument("--mesh", action="append", default=None,
                   help="data=D,expert=E,tensor=T; repeat for several meshes (default data=1,expert=8,tensor=1)")
    p.add_argument("--batch", type=int, default=32, help="rows decoded together")
    p.add_argument("--max-len", type=int, default=8192, help="cache capacity per row (prompt + generated)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K, draft tokens per round")
    p.add_argument("--prompt-len", type=int, default=1024,
                   help="prompt block the prefill program admits for every row at once")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="weights and caches")
    p.add_argument("--compile-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype the programs are compiled in to measure temporaries (XLA:CPU computes 2-byte dots "
                        "and scatters through float32 copies, which float32 avoids; see tools/plan/serve.py)")
    p.add_argument("--expert-bits", default=None,
                   help="comma list of routed-expert widths to report, e.g. 16,4 (4: INT4 + bf16 group scales as "
                        "Kimi-K2.5's checkpoint stores them; 8: FP8 + f32 block scales as DeepSeek-V3's); "
                        "default: the dtype's width")
    p.add_argument("--hbm", default=None, help="memory per device to fit, e.g. 141GB (10^9) or 96GiB (2^30)")
    p.add_argument("--weights", choices=["native", "bfloat16"], default="native",
                   help="native (default): plan what load_target holds for the checkpoint's quantization "
                        "(INT4 / FP8 values + scales); bfloat16: the dequantized model")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt positions per target call in prefill (default: the whole block, or with --hbm "
                        "the largest halving of it whose prefill fits)")
    p.add_argument("--admit-rows", type=int, default=None,
                   help="rows one prefill call admits (serving's max_admit_rows; default: the whole batch)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--draft", default=None,
                   help="draft config.json to plan for (default: a published shape for this target from "
                        "tools/plan/drafts/, else one derived from the target)")
    p.add_argument("--programs", default="decode,prefill",
                   help="comma list of decode (run_rounds), prefill (admit_rows), generate (generate_loop)")
    p.add_argument("--moe-kernel", choices=["blocked", "ragged", "padded_blocks"], default=None,
                   help="expert kernel to compile (default: the product's choice for the platform compiled for; "
                        "ragged lowers to a dense dot over all experts on CPU, which inflates temporaries there)")
    p.add_argument("--platform", choices=["cpu", "tpu"], default="cpu",
                   help="cpu: compile for fake CPU devices (GPU-style meshes); tpu: compile for --topology with the "
                        "TPU compiler (libtpu, the tpu extra; no TPU needed)")
    p.add_argument("--topology", default=None, help="TPU slice for --platform tpu, e.g. v5p:2x2x4, v6e:4x4")
    p.add_argument("--layers", type=int, default=None,
                   help="plan the target cut to its first N layers, at full width (quick what-ifs)")
    p.add_argument("--tau", type=float, default=None,
                   help="acceptance length (tokens per round) at K for the TPU predicted speedup (default: the "
                        "demo pair's measured greedy acceptance, demo/README.md)")
    p.add_argument("--speedup", action="store_true",
                   help="instead of the memory plan: price one decode round per batch size and K = 0..6 with a "
                        "roofline of the TPU compiler's per-chip costs and print the predicted EAGLE-3 speedup and "
                        "best K per batch (tools/plan/speedup.py; --platform tpu; --json writes the K table)")
    p.add_argument("--speedup-batches", default="1,8,32,128", help="batch sizes of the --speedup table")
    p.add_argument("--compile-batches", default=None,
                   help="batches --speedup compiles (default: every one of --speedup-batches; the costs are far from "
                        "linear in the batch); the others are interpolated linearly in tokens")
    p.add_argument("--context", type=int, default=2048,
                   help="filled cache slots per row when the priced rounds run (--speedup); --max-len is the capacity")
    p.add_argument("--round-store", default=None, metavar="PATH",
                   help="--speedup: keep compiled round costs in this JSON file and reuse them (a rerun compiles "
                        "only what is missing)")
    p.add_argument("--check", action="store_true",
                   help="--speedup: also compile one deeper cut and one interpolated cell, and print how far the "
                        "extrapolation and interpolation land")
    p.add_argument("--train", action="store_true",
                   help="also plan the draft training step (eagle3_jax.train.step.train_step)")
    p.add_argument("--train-batch", type=int, default=8, help="training rows per micro-batch")
    p.add_argument("--train-len", type=int, default=2048, help="training sequence length")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll")
    p.add_argument("--train-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the draft's weights and AdamW moments while training")
    p.add_argument("--hidden-source", choices=["online", "offline"], default="online",
                   help="online: the frozen target runs inside the step; offline: its states come from disk")
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices to create (default: largest mesh)")
    return p


def _mesh_size(spec: str) -> int:
    """Devices a mesh spec needs, read before JAX starts (bad specs are reported later, in full)."""
    size = 1
    for part in spec.split(","):
        _, _, n = part.partition("=")
        size *= int(n) if n.strip().isdigit() else 1
    return size


def _speedup(args, meshes, start) -> int:
    import jax

    from eagle3_jax.errors import Eagle3Error
    from tools.plan import serve, speedup

    if args.platform != "tpu" or len(meshes) != 1:
        print("error: --speedup prices rounds for one TPU mesh: give --platform tpu --topology T and one --mesh",
              file=sys.stderr)
        return 2
    settings = serve.PlanSettings(model=args.model, mesh=meshes[0], dtype=args.dtype, draft=args.draft,
                                  moe_kernel=args.moe_kernel, platform="tpu", topology=args.topology,
                                  weights=args.weights)
    try:
        grid = speedup.grid_from(args.speedup_batches, args.context, args.max_len, args.compile_batches)
        # Mosaic kernels refuse bf16 operands at float32 contract precision: compile what the product runs.
        with jax.default_matmul_precision("default"):
            lines, obj = speedup.run(settings, grid, lambda m: print(f"[speedup] {m}", file=sys.stderr, flush=True),
                                     store=args.round_store, check=args.check)
    except (Eagle3Error, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(obj, f, indent=1)
    print(f"# total wall time {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    meshes = args.mesh or ["data=1,expert=8,tensor=1"]
    devices = args.devices or max(_mesh_size(m) for m in meshes)
    if "jax" not in sys.modules:  # the device count is fixed when JAX starts (eagle3_jax imports it)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        os.environ["JAX_PLATFORMS"] = "cpu"

    from eagle3_jax.errors import Eagle3Error
    from tools.plan import report, serve

    start = time.perf_counter()
    if args.speedup:
        return _speedup(args, meshes, start)
    try:
        bits = tuple(int(b) for b in args.expert_bits.split(",")) if args.expert_bits else (
            {"bfloat16": 16, "float16": 16, "float32": 32}[args.dtype],)
        hbm = serve.parse_bytes(args.hbm) if args.hbm else None
        json_meshes = []
        for mesh in meshes:
            settings = serve.PlanSettings(
                model=args.model, mesh=mesh, batch=args.batch, max_len=args.max_len,
                num_draft_tokens=args.num_draft_tokens, prompt_len=args.prompt_len,
                dtype=args.dtype, compile_dtype=args.compile_dtype, expert_bits=bits, draft=args.draft,
                programs=tuple(p.strip() for p in args.programs.split(",") if p.strip()),
                moe_kernel=args.moe_kernel, train=args.train,
                train_batch=args.train_batch, train_len=args.train_len, train_accum=args.grad_accum,
                ttt_steps=args.ttt_steps, train_dtype=args.train_dtype, hidden_source=args.hidden_source,
                weights=args.weights, prefill_chunk=args.prefill_chunk, hbm=hbm,
                admit_rows=args.admit_rows, platform=args.platform, topology=args.topology,
                layers=args.layers, tau=args.tau)
            result = serve.plan(settings, log=lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True))
            json_meshes.append(report.json_mesh(result, result.hbm))
            if mesh is meshes[0]:
                print("\n".join(report.format_header(result)) + "\n")
            print("\n".join(report.format_mesh(result, result.hbm)) + "\n", flush=True)
        print("\n".join(report.format_notes(result)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "meshes": json_meshes}, f, indent=2)
    except (Eagle3Error, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# total wall time {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
