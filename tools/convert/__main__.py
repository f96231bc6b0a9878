"""Command line: ``python -m tools.convert {to-jax,to-hf,inspect} ...``.

    python -m tools.convert to-jax SRC_HF_DIR DST_DIR [--dtype bfloat16] [--mesh data=1,expert=8,tensor=1]
    python -m tools.convert to-hf  SRC_JAX_DIR DST_DIR [--max-shard-size 5GB]
    python -m tools.convert inspect DIR
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.convert",
        description="Convert EAGLE-3 targets (DeepSeek-V3 / Kimi-K2 / Kimi-K2.5) and drafts (SpecForge / SGLang "
                    "LlamaForCausalLMEagle3) between Hugging Face safetensors and eagle3-jax orbax checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("to-jax", help="Hugging Face safetensors directory -> eagle3-jax checkpoint")
    a.add_argument("src", help="directory with config.json and *.safetensors")
    a.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    a.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast float weights (routers stay float32); default: keep each tensor's source dtype "
                        "(FP8 / INT4 weights dequantized by --weights bfloat16 become bfloat16)")
    a.add_argument("--weights", choices=["native", "bfloat16"], default="native",
                   help="native (default): keep INT4 / FP8 weights quantized as stored; bfloat16: dequantize them")
    a.add_argument("--mesh", default=None,
                   help="e.g. data=1,expert=8,tensor=1: lay arrays out in this mesh's shards as they are saved, "
                        "so restoring onto the same mesh reads each device's chunks only")
    a.add_argument("--part-size", default="256MB",
                   help="bytes per orbax part; host memory is about two parts or, when parameters are "
                        "larger, about three of the largest parameter")
    a.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")

    b = sub.add_parser("to-hf", help="eagle3-jax checkpoint -> Hugging Face safetensors directory")
    b.add_argument("src", help="directory written by to-jax")
    b.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 512MiB")
    b.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("inspect", help="what a checkpoint directory holds (either format)")
    c.add_argument("dir", help="checkpoint directory: Hugging Face safetensors (target or EAGLE-3 draft) or one "
                               "written by to-jax")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # orbax / absl are chatty at INFO; our own messages are what a user needs to see.
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from eagle3_jax.errors import Eagle3Error
    from tools.convert import core
    from tools.convert.inspect import inspect as inspect_checkpoint

    try:
        if args.command == "to-jax":
            meta = core.to_jax(args.src, args.dst, dtype=args.dtype, mesh=args.mesh, overwrite=args.overwrite,
                               part_size=args.part_size, progress=not args.no_progress, weights=args.weights)
            hf = meta["hf"]
            print(f"wrote {args.dst}: {meta['kind']} {meta['architecture']}, {len(meta['params'])} arrays, "
                  f"{meta['num_values']:,} values, dtype {meta['dtype']}, {len(meta['parts'])} orbax part(s)"
                  + (f"; dequantized {hf['dequantized']}" if hf["dequantized"] else "")
                  + (f"; dropped {len(hf['dropped'])} unused tensor(s)" if hf["dropped"] else ""))
        elif args.command == "to-hf":
            files = core.to_hf(args.src, args.dst, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                               progress=not args.no_progress)
            print(f"wrote {args.dst}: {len(files)} file(s)")
        else:
            print(inspect_checkpoint(args.dir))
    except (Eagle3Error, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
