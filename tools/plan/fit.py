"""Where the seed's models fit on TPU: one markdown table from the TPU compiler.

    python -m tools.plan.fit [--models kimi_k25,deepseek_v3] [--topologies v5p:2x2x2,v5p:2x2x4,v6e:4x4]
                             [--programs decode,prefill] [--batch 32] [--max-len 8192] [--num-draft-tokens 4]
                             [--data D] [--tensor T] [--cut]

For each model (native weights: Kimi-K2.5 INT4 experts, DeepSeek-V3 FP8) and TPU slice, the serving
programs are compiled for the slice (mesh ``data=D,expert=<chips / (D x T)>,tensor=T``, default
D = T = 1), all layers, and the table gives the compiler's per-chip peak: a few minutes per model
and slice on a 2-core host. "Fits" is against the chip HBM the compiler reports. Compiled for TPU
on this host, not run on one.

``--cut`` is the quick look: the target cut to one and to two MoE layers at full width, and
``held(2 MoE) + (MoE layers - 2) * (held(2 MoE) - held(1 MoE)) + max(temporaries of the two)``,
with held = arguments + outputs not aliased to them (parameters, caches, loop state: exact per
layer). Temporaries are not exact that way: Kimi-K2.5's prefill at 32 rows (chunk 256, v5p:2x2x4)
has 6.6-7.2 GiB of them cut to 1-4 MoE layers but 12.5 GiB at 61 layers, so the cut estimate
(89.6 GiB) undershoots the full compile (95.2 GiB); its decode estimate was within 1 GiB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

GiB = 2 ** 30


def held(mem) -> int:
    """Per-chip bytes a program holds besides its temporaries (the TPU compiler's figures)."""
    if not mem.fits:
        raise SystemExit(f"{mem.name} does not fit even cut to a few layers: {mem.error}")
    return mem.peak - mem.temp


def fit_peaks(model: str, topo: str, mesh: str, args, programs) -> dict[str, tuple[int, bool]]:
    """Per-chip (peak bytes, fits) of each program: the full compile's (the compiler's verdict), or
    with ``args.cut`` the estimate against the chip's HBM."""
    from eagle3_jax.config import TargetConfig
    from tools import tpu
    from tools.plan import serve

    cfg = TargetConfig.from_path(model)
    dense, L = cfg.first_k_dense_replace, cfg.num_hidden_layers
    plans = [serve.plan(serve.PlanSettings(
        model=model, mesh=mesh, batch=args.batch, max_len=args.max_len,
        num_draft_tokens=args.num_draft_tokens, prompt_len=args.prompt_len, prefill_chunk=args.prefill_chunk,
        admit_rows=args.admit_rows, platform="tpu", topology=topo, layers=n, programs=programs, cost_k0=False),
        log=lambda m: print(f"[fit {os.path.basename(model)} {topo}] {m}", file=sys.stderr, flush=True))
        for n in ((dense + 1, dense + 2) if args.cut else (None,))]
    if not args.cut:   # a refusal carries the compiler's own figure of what it would need
        return {prog: (plans[0].programs[prog].peak, plans[0].programs[prog].fits) for prog in programs}
    out = {}
    for prog in programs:
        a, b = (held(p.programs[prog]) for p in plans)
        peak = b + (L - dense - 2) * (b - a) + max(p.programs[prog].temp for p in plans)
        out[prog] = (peak, peak <= tpu.chip_hbm_bytes(topo))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.plan.fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="kimi_k25,deepseek_v3", help="configs/models/<name>.json, comma list")
    p.add_argument("--topologies", default="v5p:2x2x2,v5p:2x2x4,v6e:2x4,v6e:4x4", help="TPU slices, comma list")
    p.add_argument("--programs", default="decode,prefill")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--admit-rows", type=int, default=None,
                   help="rows one prefill call admits (serve.py --admit-rows; default the whole batch)")
    p.add_argument("--data", type=int, default=1, help="mesh data axis (rows and caches split); expert = chips / (data x tensor)")
    p.add_argument("--tensor", type=int, default=1, help="mesh tensor axis (attention heads and expert width split)")
    p.add_argument("--cut", action="store_true",
                   help="compile cut to 1 and 2 MoE layers and extrapolate (minutes less; temporaries underestimated)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from tools import tpu

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    programs = tuple(x for x in args.programs.split(",") if x)
    rows = []
    for name in args.models.split(","):
        model = os.path.join(repo, "configs", "models", f"{name}.json")
        for topo in args.topologies.split(","):
            chips, hbm = tpu.chips(topo), tpu.chip_hbm_bytes(topo)
            if chips % (args.data * args.tensor):
                raise SystemExit(f"{topo} has {chips} chips, not a multiple of data x tensor = {args.data * args.tensor}")
            mesh = f"data={args.data},expert={chips // (args.data * args.tensor)},tensor={args.tensor}"
            t0 = time.perf_counter()
            peaks = fit_peaks(model, topo, mesh, args, programs)
            row = [name, topo, str(chips), f"{hbm / GiB:.2f}", mesh]
            for prog in programs:
                peak, fits = peaks[prog]
                row += [f"{peak / GiB:,.1f}", "yes" if fits else "no"]
            row.append(f"{time.perf_counter() - t0:.0f}")
            rows.append(row)
            print("| " + " | ".join(row) + " |", file=sys.stderr, flush=True)
    head = ["model", "slice", "chips", "HBM/chip GiB", "mesh"]
    for prog in programs:
        head += [f"{prog} peak/chip GiB", f"{prog} fits"]
    head.append("compile s")
    print(f"# batch {args.batch}, max_len {args.max_len}, K={args.num_draft_tokens}, prompt block {args.prompt_len} "
          f"(prefill chunk {args.prefill_chunk}, {args.admit_rows or args.batch} rows per admission); native weights; TPU compiler, "
          + ("cut to 1 and 2 MoE layers, held bytes extrapolated per MoE layer, plus the larger cut's temporaries (an estimate)"
             if args.cut else "all layers"))
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
