"""Checkpoint conversion speed and memory, against reading the same files.

Builds a synthetic bf16 DeepSeek-V3-shaped checkpoint of >= 1 GB (few layers, wide, many experts;
routers in float32 as in the published checkpoints), then measures, each in a fresh subprocess:
  * raw read   — every byte of the .safetensors files read in 64 MiB chunks (the disk / page-cache
                 ceiling), and every tensor read through our CheckpointReader;
  * to-jax     — ``python -m tools.convert to-jax`` at several ``--part-size`` values;
  * to-hf      — ``python -m tools.convert to-hf`` back, checked byte-identical to the source.
Throughput is source bytes / wall seconds; "÷ raw" divides by the raw-read throughput. Peak RSS is
the child's ru_maxrss; it is divided by the largest on-disk tensor, by the largest converted
parameter (a layer's stacked experts), and above the import-only baseline by that parameter.
All reads hit the page cache (a warm-up pass runs first), so this measures CPU and memory cost.

    .venv/bin/python benchmarks/convert.py [--experts 64] [--hidden 1024] [--part-sizes 256MB,1GB,64MB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine, table

import numpy as np

RUN = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:]).returncode
dt = time.perf_counter() - t
print(f"__RESULT__ {rc} {dt} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}")
"""

RAW_READ = r"""
import sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(p, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
"""

READER_READ = r"""
import sys
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
with CheckpointReader(sys.argv[1]) as r:
    for name, _ in r.iter_tensors():
        pass
"""

BASELINE = "import tools.convert.core, orbax.checkpoint, jax; jax.devices()"


def measure(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``cmd`` run in a fresh child of a fresh process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", RUN, *cmd], capture_output=True, text=True, env=env, cwd=REPO)
    line = [l for l in out.stdout.splitlines() if l.startswith("__RESULT__")]
    if not line or line[0].split()[1] != "0":
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    _, _, dt, rss = line[0].split()
    return float(dt), int(rss)


def bench_config(args) -> dict:
    """A DeepSeek-V3-shaped config of the chosen width (tools/random_target.py's tiny target resized)."""
    from tools.random_target import hf_config_dict

    return hf_config_dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, first_k_dense_replace=1,
        n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=4096, rope_scaling=None,
        torch_dtype="bfloat16")


def build_checkpoint(path: Path, config: dict, max_shard: str) -> tuple[int, int, int]:
    """Random weights through the target rule table, one parameter at a time.
    Returns (total bytes, largest tensor bytes, largest parameter bytes)."""
    import jax.numpy as jnp

    from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
    from eagle3_jax.checkpoint.target_map import target_rules
    from eagle3_jax.config import TargetConfig
    from tools.convert.models import target_spec

    cfg = TargetConfig.from_hf_dict(config)
    spec = target_spec(config, "DeepseekV3ForCausalLM", jnp.bfloat16)
    rng = np.random.default_rng(0)
    total = largest = largest_param = 0
    path.mkdir(parents=True)
    with CheckpointWriter(path, max_shard_bytes=max_shard) as w:
        for rule in target_rules(cfg):
            var = spec.flat[rule.path]
            dt = np.dtype(var.value.dtype)
            value = (rng.standard_normal(var.value.shape, dtype=np.float32) * 0.02).astype(dt)
            largest_param = max(largest_param, value.nbytes)
            for key, arr in zip(rule.hf_keys, rule.to_hf(value)):
                w.add(key, arr)
                total += arr.nbytes
                largest = max(largest, arr.nbytes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return total, largest, largest_param


def same_tensors(a: Path, b: Path) -> bool:
    from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    if set(ra.keys()) != set(rb.keys()):
        return False
    return all(ra.dtype_code(k) == rb.dtype_code(k) and ra.read(k).tobytes() == rb.read(k).tobytes()
               for k in ra.keys())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--part-sizes", default="256MB,1GB,64MB",
                   help="to-jax runs; to-hf exports the first one's output")
    p.add_argument("--max-shard-size", default="400MB")
    p.add_argument("--workdir", default=None, help="where to build the checkpoints (default: a temp dir, removed)")
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    try:
        src = work / "hf"
        total, largest, largest_param = build_checkpoint(src, bench_config(args), args.max_shard_size)
        print(f"# convert  machine: {machine()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"# checkpoint: {total / 1e9:.3f} GB bf16 in {len(list(src.glob('*.safetensors')))} files; "
              f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts x {args.moe_intermediate}; "
              f"largest tensor {largest / 1e6:.1f} MB, largest parameter (stacked experts) {largest_param / 1e6:.1f} MB")

        measure([sys.executable, "-c", RAW_READ, str(src)])  # warm the page cache
        rows = []
        raw_dt, raw_rss = measure([sys.executable, "-c", RAW_READ, str(src)])
        raw_gbs = total / raw_dt / 1e9
        _, base_rss = measure([sys.executable, "-c", BASELINE])

        def row(what, dt, rss, baseline=None):
            gbs = total / dt / 1e9
            above = "" if baseline is None else (rss - baseline) / largest_param
            rows.append([what, dt, gbs, gbs / raw_gbs, rss / 1e6, rss / largest, rss / largest_param, above])

        row("raw read (64 MiB chunks)", raw_dt, raw_rss)
        dt, rss = measure([sys.executable, "-c", READER_READ, str(src)])
        row("CheckpointReader, every tensor", dt, rss)
        convert = [sys.executable, "-m", "tools.convert"]
        first_jax = None
        for size in args.part_sizes.split(","):
            dst = work / f"jax-{size}"
            dt, rss = measure(convert + ["to-jax", str(src), str(dst), "--no-progress", "--part-size", size])
            row(f"to-jax --part-size {size}", dt, rss, base_rss)
            first_jax = first_jax or dst
        dt, rss = measure(convert + ["to-hf", str(first_jax), str(work / "back"), "--no-progress",
                                     "--max-shard-size", args.max_shard_size])
        row("to-hf", dt, rss, base_rss)
        print(f"# import-only baseline RSS (python + jax + orbax + tools.convert): {base_rss / 1e6:.0f} MB")
        print(f"# to-hf output byte-identical to the source: {'yes' if same_tensors(src, work / 'back') else 'NO'}")
        print()
        print(table(["step", "seconds", "GB/s", "÷ raw read", "peak RSS MB", "RSS ÷ largest tensor",
                     "RSS ÷ largest param", "(RSS − baseline) ÷ largest param"], rows))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
