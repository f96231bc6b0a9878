"""Decode rounds measured beside their roofline: does the TPU planner's formula hold where we can run?

Each round (draft K, verify K + 1, accept, catch up; K = 0: one target-only step) is compiled on
its own (``tools/plan/rounds.one_round``) with this machine's compiler, priced exactly as
``python -m tools.plan --speedup`` prices TPU rounds (compiler flops and bytes, expert kernels
replaced by the uniform routing model, uncounted loop trips added: ``tools/plan/uncounted.py``),
and timed: rounds run back to back on a state whose rows hold ``--context`` filled slots (zeros:
a round's cost does not depend on the values); "host CPU ms" is this process's CPU time per round
(all threads: on a CPU the work itself, which a busy host's waiting does not inflate). The chip figures are the vendor's for a known GPU
(``tools/plan/roofline.CHIPS``) and, on a CPU, this CPU's own, measured here (streaming read and
float32 matmul); both are printed.

    python benchmarks/round_costs.py --pair demo --batches 1,8 --ks 0,1,2,4        # the demo pair
    python benchmarks/round_costs.py --model configs/models/deepseek_v3.json --layers 5 \\
        --batches 1,8,32 --ks 0,1,2,3,4,5,6 --budget-s 240                     # DeepSeek-V3 cut, FP8, random
    python benchmarks/round_costs.py --tiny                                        # seconds: a smoke run

``--budget-s`` stops starting new cells once spent (each cell's table row prints as it lands).
With ``--pair``, ``--draft draft,peagle,dflash`` times each of those drafts of the pair (the chain
draft in ``DIR/draft``, P-EAGLE's, DFlash's), one after another, on the same target. "draft ms" times the round's draft work alone (the kind's
proposal of K tokens and its catch-up over the K + 1 verified positions, the same functions the
loop calls, on the same state), so "draft share" is the part of the measured round the draft costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

from _common import REPO, load_average, machine, parse_list, table

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle3_jax.speculative import generate as gen
from eagle3_jax.speculative.static_graph import StaticGraph, merge_models
from tools.plan import rounds, uncounted
from tools.plan.roofline import UNIFORM, Chip, chip_for

TINY_CONFIG = REPO / "configs/models/tiny_deepseek_v3.json"


# ---------------------------------------------------------------------- the device
def measure_device(repeats: int = 5) -> dict:
    """This device's streaming read (bytes/s, a sum over 256 MiB) and matmul rate (flop/s, float32
    on CPU, bfloat16 elsewhere): the medians of ``repeats`` timed calls."""
    on_cpu = jax.default_backend() == "cpu"
    x = jnp.ones((64 * 2 ** 20,), jnp.float32)
    n = 2048 if on_cpu else 8192
    a = jnp.ones((n, n), jnp.float32 if on_cpu else jnp.bfloat16)
    read, mm = jax.jit(jnp.sum), jax.jit(lambda a: a @ a)

    def rate(fn, arg, amount):
        jax.block_until_ready(fn(arg))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - t0)
        return amount / statistics.median(times)

    return {"read_bytes_per_s": rate(read, x, x.nbytes), "matmul_flops_per_s": rate(mm, a, 2.0 * n ** 3),
            "matmul_dtype": str(a.dtype), "load_average": load_average()}


def device_chip(measured: dict) -> Chip:
    kind = jax.devices()[0].device_kind
    known = chip_for(kind)
    if known is not None:
        return known
    return Chip(f"{kind} (measured here)", measured["read_bytes_per_s"], measured["matmul_flops_per_s"], None,
                "benchmarks/round_costs.py measure_device")


# ---------------------------------------------------------------------- the models
@dataclasses.dataclass
class Models:
    name: str
    target: tuple           # (graphdef, state)
    draft: tuple
    cfg: object
    dcfg: object
    aux_ids: tuple
    dtype: object
    draft_label: str = "draft"   # the draft's folder in a demo pair, or its kind


def demo_models(demo_dir: str, sub: str = "draft") -> Models:
    import eagle3_jax as e3
    from eagle3_jax.serve.demo import DemoSettings

    dtype = DemoSettings.load(demo_dir).dtype
    t = e3.load_target(os.path.join(demo_dir, "target"), dtype=dtype)
    d = e3.load_draft(os.path.join(demo_dir, sub), t)
    name = f"demo pair {os.path.relpath(demo_dir, REPO)}, {sub}/ ({type(d.config).__name__}, {dtype})"
    return Models(name, (t.graphdef, t.state), (d.graphdef, d.state), t.config, d.config, tuple(d.aux_layer_ids),
                  jnp.dtype(dtype), sub)


def random_models(config: str, layers: int | None, dtype: str, quant_override: dict | None = None) -> Models:
    """A target from ``config`` cut to ``layers`` at full width, its checkpoint's quantized form,
    random weights; the draft the planner would pick for it (tools/plan/serve.choose_draft)."""
    from eagle3_jax.checkpoint.quant_native import layout_from_config
    from eagle3_jax.config import TargetConfig
    from eagle3_jax.contracts import resolve_aux_ids
    from eagle3_jax import drafts
    from eagle3_jax.models.target import Target
    from tools.plan.serve import choose_draft

    full = TargetConfig.from_path(config)
    if quant_override is not None:
        full = full.replace(hf_config=dict(full.hf_config, quantization_config=quant_override))
    cfg = full.replace(num_hidden_layers=layers) if layers else full
    dcfg, _ = choose_draft(full)
    L = cfg.num_hidden_layers
    dcfg = dataclasses.replace(dcfg, aux_layer_ids=(0, L // 2, L - 1)[:len(resolve_aux_ids(dcfg, full))])
    aux = resolve_aux_ids(dcfg, cfg)
    layout = layout_from_config(cfg)
    dt = jnp.dtype(dtype)
    target = nnx.split(Target(cfg, dt, nnx.Rngs(0), quant=layout))
    draft = nnx.split(drafts.of_config(dcfg).module(dcfg, len(aux), dt, nnx.Rngs(1)))
    what = f"{os.path.basename(config)} cut to {L} of {full.num_hidden_layers} layers at full width, random weights"
    return Models(what + (f", {layout.name}" if layout else ""), target, draft, cfg, dcfg, aux, dt)


def aux_ids(models: Models) -> np.ndarray:
    return np.asarray(models.aux_ids, np.int32)


def state_for(models: Models, batch: int, capacity: int, context: int, k_max: int):
    """A loop state of ``batch`` running rows with ``context`` filled slots (contents zero), and the
    session's program and greedy sampling settings."""
    program = gen.DecodeProgram(batch_size=batch, max_len=capacity, num_draft_tokens=k_max)
    sp = gen.Sampling(jnp.float32(0), jnp.int32(0), jnp.float32(1), jnp.array([-1], jnp.int32), jnp.bool_(True),
                      jnp.int32(capacity - context))
    (tg, ts), (dg, ds) = models.target, models.draft
    shapes = gen.blank_state.eval_shape(tg, ts, dg, ds, aux_ids(models), jax.random.key(0), sp, program=program)

    def make():
        zeros = jax.tree.map(lambda s: jax.random.key(0) if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)
                             else jnp.zeros(s.shape, s.dtype), shapes)
        return dataclasses.replace(zeros, lengths_B=jnp.full((batch,), context, jnp.int32),
                                   budget_B=jnp.full((batch,), capacity - context, jnp.int32),
                                   budget_is_max_new_B=jnp.ones((batch,), bool))
    return program, sp, make


# ---------------------------------------------------------------------- the draft's part of a round
@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "k", "aux_width"))
def draft_part(tgraph, tstate, dgraph, dstate, state, *, k: int, aux_width: int):
    """The draft's work in a greedy round at ``k``: propose, then catch up over the k + 1 positions
    (the target's aux states there are zeros here: a round's cost does not depend on the values)."""
    from eagle3_jax import drafts
    from eagle3_jax.speculative.accept import first_argmax

    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    kind, embed_VD = drafts.of_module(draft), target.embed_tokens[...]
    keys = list(jax.random.split(jax.random.key(0), k))
    d_BK, _, dcache = kind.propose(draft, state.dlogits_BW, state.dhidden_BD, state.dcache, state.lengths_B, keys,
                                   lambda _, x: (first_argmax(x), jnp.zeros(x.shape, jnp.float32)), embed_VD,
                                   state.last_B, target.logits)
    ids_BK1 = jnp.concatenate([state.last_B[:, None], draft.to_target_ids(d_BK)], axis=1)
    pos_BK1 = state.lengths_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    aux_BTX = jnp.zeros(ids_BK1.shape + (aux_width,), embed_VD.dtype)
    step = kind.catch_up(draft, ids_BK1, aux_BTX, pos_BK1, embed_VD, dcache)
    return (step.hidden_BTD, step.logits_BTW, step.cache), d_BK


def time_calls(fn, repeats: int, calls: int) -> float:
    """The median over ``repeats`` runs of ``calls`` back-to-back calls, seconds per call."""
    times = []
    for _ in range(repeats):
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        out = [fn() for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


# ---------------------------------------------------------------------- one cell
def run_cell(models: Models, batch: int, k: int, args, chip: Chip) -> dict:
    from tools.plan.common import _leaves

    program, sp, make = state_for(models, batch, args.context + args.headroom, args.context, max(args.ks))
    tg, dg = StaticGraph(models.target[0]), StaticGraph(models.draft[0])
    ts, ds = models.target[1], models.draft[1]
    kept = {}
    rc = rounds.compile_round(((tg, ts), (dg, ds, aux_ids(models))), make(), sp, program, k,
                              models.cfg.num_hidden_layers, keep=kept)
    axes = {".".join(map(str, p)): getattr(v, "axes", None) for p, v in nnx.to_flat_state(ts)}
    whole = NamedSharding(Mesh(jax.devices()[:1], ("one",)), P())   # one device: every array whole
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=whole), ts)
    pair = rounds.Pair(models.cfg, models.dcfg, {"data": 1, "expert": 1, "tensor": 1}, models.dtype,
                       _leaves(abstract, axes, "target."))
    shape = uncounted.Shape(rows=batch, k=k, context=args.context, capacity=args.context + args.headroom)
    counted = rounds.counted_cost(rc, pair, shape)
    priced = rounds.priced_cell(counted, pair.experts(), uncounted.moe_layers(models.cfg), batch * (k + 1),
                                UNIFORM, chip)
    # called with the traced arguments only
    run, draft_state, aux = kept["compiled"], ds if k else None, aux_ids(models) if k else None
    aux_width = len(models.aux_ids) * models.cfg.hidden_size
    frozen = make()   # the draft's part runs on a state of its own (a round donates its state)

    def draft_once():
        return draft_part(tg, ts, dg, ds, frozen, k=k, aux_width=aux_width)

    # Rounds and the draft's part alternate, repeat by repeat, so load that drifts hits both alike
    # and "draft share" compares like with like.
    times, cpu, draft_times = [], [], []
    for _ in range(args.repeats):
        state = run(ts, draft_state, aux, make(), sp)   # a warm-up round
        jax.block_until_ready(state)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.rounds):
            state = run(ts, draft_state, aux, state, sp)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / args.rounds)
        cpu.append((time.process_time() - c0) / args.rounds)
        if k:
            draft_times.append(time_calls(draft_once, 1, args.rounds))
    measured = statistics.median(times)
    draft_s = statistics.median(draft_times) if k else None
    return {"batch": batch, "k": k, "measured_s": measured, "draft_s": draft_s, "roofline_s": priced["seconds"],
            "ratio": measured / priced["seconds"], "bound": priced["bound"], "bytes": priced["bytes"],
            "flops": priced["flops"], "compiler_bytes": rc.bytes_accessed, "compiler_flops": rc.flops,
            "kernels": rc.hlo.kernels, "while_loops": rc.hlo.while_loops, "compile_s": rc.compile_s,
            "runs": times, "process_cpu_s": statistics.median(cpu)}


def cell_order(batches, ks):
    """The cells that answer most first: K = 0, 1, the middle and the largest per batch, then the rest."""
    first = [k for k in (0, 1, ks[len(ks) // 2], ks[-1]) if k in ks]
    seen, out = set(), []
    for group in (first, ks):
        for b in batches:
            for k in group:
                if (b, k) not in seen:
                    seen.add((b, k))
                    out.append((b, k))
    return out


HEAD = ["draft", "B", "K", "measured ms", "roofline ms", "measured / roofline", "bound", "GB", "GFLOP", "host CPU ms",
        "compile s", "draft ms", "draft share"]


def row_of(r: dict) -> list:
    return [r["draft"], r["batch"], r["k"], f"{r['measured_s'] * 1e3:.3f}", f"{r['roofline_s'] * 1e3:.3f}", f"{r['ratio']:.2f}",
            r["bound"], f"{r['bytes'] / 1e9:.3f}", f"{r['flops'] / 1e9:.2f}", f"{r['process_cpu_s'] * 1e3:.3f}",
            f"{r['compile_s']:.1f}",
            "-" if r.get("draft_s") is None else f"{r['draft_s'] * 1e3:.3f}",
            "-" if r.get("draft_s") is None else f"{r['draft_s'] / r['measured_s']:.2f}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="a demo directory (target/ and draft/): the trained pair")
    ap.add_argument("--draft", default="draft",
                    help="with --pair: the drafts' folders in it, comma-separated (draft, peagle, dflash)")
    ap.add_argument("--model", default=None, help="a target config.json: random weights, cut by --layers")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", help="--model's weights and caches")
    ap.add_argument("--tiny", action="store_true", help="the tiny config with FP8 experts, 2 batches, K 0-2: a smoke run")
    ap.add_argument("--batches", default=None, help="default 1,8,32 (--tiny: 2)")
    ap.add_argument("--ks", default=None, help="default 0,1,2,3,4,5,6 (--tiny: 0,1)")
    ap.add_argument("--context", type=int, default=512, help="filled slots per row")
    ap.add_argument("--headroom", type=int, default=256, help="capacity beyond the context")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new cell after this many seconds")
    ap.add_argument("--label", default="", help="a note printed with the table (e.g. an XLA flag)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.tiny:
        fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        models = random_models(str(TINY_CONFIG), None, "float32", fp8)
        args.batches, args.ks = args.batches or "2", args.ks or "0,1"
        args.context, args.headroom, args.rounds, args.repeats = 48, 16, 2, 1
    elif args.pair:
        models = [demo_models(args.pair, sub.strip()) for sub in args.draft.split(",") if sub.strip()]
    elif args.model:
        models = random_models(args.model, args.layers, args.dtype)
    else:
        ap.error("give --pair DIR, --model CONFIG or --tiny")
    pairs = models if isinstance(models, list) else [models]
    args.ks = parse_list(args.ks or "0,1,2,3,4,5,6")
    args.batches = args.batches or "1,8,32"
    measured = measure_device()
    chip = device_chip(measured)
    print(f"# {'; '.join(m.name for m in pairs)}; {jax.devices()[0].device_kind} via jax {jax.__version__} on {machine()}, load average "
          f"{load_average()}; context {args.context} of {args.context + args.headroom} slots; "
          f"{args.rounds} rounds x median of {args.repeats}" + (f"; {args.label}" if args.label else ""))
    print(f"# roofline chip: {chip.name}: {chip.hbm_bytes_per_s / 1e9:,.1f} GB/s, {chip.flops_per_s / 1e12:,.3f} "
          f"TFLOP/s ({chip.source}); measured here: read {measured['read_bytes_per_s'] / 1e9:,.1f} GB/s, "
          f"{measured['matmul_dtype']} matmul {measured['matmul_flops_per_s'] / 1e12:,.3f} TFLOP/s", flush=True)
    rows = []
    # rows on stderr as they land (a run that is cut short keeps them); the table on stdout at the end
    print("| " + " | ".join(HEAD) + " |", file=sys.stderr, flush=True)
    for m in pairs:
        for b, k in cell_order(parse_list(args.batches), args.ks):
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                print(f"# budget of {args.budget_s:.0f} s spent: cells from B={b} K={k} on not run", flush=True)
                break
            rows.append(dict(run_cell(m, b, k, args, chip), draft=m.draft_label))
            print("| " + " | ".join(map(str, row_of(rows[-1]))) + " |", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r["draft"], r["batch"], r["k"]))
    print()
    print(table(HEAD, [row_of(r) for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                       "device": jax.devices()[0].device_kind, "model": "; ".join(m.name for m in pairs), "chip": chip.to_json(),
                       "measured_device": measured, "args": vars(args), "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
