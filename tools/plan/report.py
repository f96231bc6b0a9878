"""The plan as text: header, per-device table per mesh, notes, and the training step's table."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from eagle3_jax.config import resolve_dtype
from eagle3_jax.config import TargetConfig
from eagle3_jax.drafts.eagle3.config import DraftConfig
from tools import tpu
from tools.plan.serve import PROGRAM_DOC, Plan, compile_dtype


UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1))


def _unit(n: float) -> tuple[str, float]:
    return next((u for u in UNITS if n >= u[1]), UNITS[-1])


def _count(n: float) -> str:
    for name, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {name}"
    return str(int(n))


def describe_target(cfg: TargetConfig) -> str:
    return (f"{cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), {cfg.n_routed_experts} experts "
            f"top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads, MLA latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, "
            f"vocab {cfg.vocab_size}")


def describe_draft(d: DraftConfig) -> str:
    return (f"hidden {d.hidden_size}, intermediate {d.intermediate_size}, {d.num_attention_heads} heads / "
            f"{d.num_key_value_heads} kv x {d.head_dim}, draft vocab {d.draft_vocab_size}")


def row_bits(plan: Plan) -> list[int | None]:
    """One table row per expert width; None is the row of what ``load_target`` allocates (the
    checkpoint's own storage with weights=native), the others are what-if widths."""
    if plan.quant is not None:
        return [None]
    return [None if b >= 16 else b for b in plan.settings.expert_bits]


def bits_label(plan: Plan, bits: int | None) -> str:
    if bits is None and plan.quant is not None:
        return plan.quant.name
    if bits is None or bits >= 16:
        return plan.settings.dtype
    per, n = plan.scale_layout(bits)
    kind = {4: "int4", 8: "fp8"}.get(bits, f"{bits}-bit")
    return f"{kind} experts (+{'bf16' if per == 2 else 'f32'} scale / {n})"


def _scale(plan: Plan):
    unit, scale = _unit(plan.param_bytes())
    return unit, (lambda n: f"{n / scale:,.1f}")


def format_header(plan: Plan) -> list[str]:
    """What is planned: the model, the draft, the workload (the same for every mesh of a run)."""
    s = plan.settings
    total_params = sum(leaf.total_bytes for leaf in plan.target_params)
    return [
        f"# plan  model: {s.model}: {describe_target(plan.target)}",
        (f"#   target: {total_params / 1e9:,.1f} GB as held ({plan.quant.name}, {s.dtype} elsewhere); draft: "
         if plan.quant else
         f"#   target: {_count(sum(math.prod(leaf.shape) for leaf in plan.target_params))} parameters, "
         f"{_count(total_params)}B in {s.dtype}; draft: ")
        + f"{_count(sum(math.prod(leaf.shape) for leaf in plan.draft_params))} parameters",
        f"# draft: {plan.draft_source}: {describe_draft(plan.draft)}, aux layers {list(plan.aux_ids)}",
        f"# batch {s.batch}, max_len {s.max_len}, K={s.num_draft_tokens} draft tokens, prompt block {s.prompt_len}, "
        f"greedy and sampled (one program); {weights_text(plan)}; " + compiled_for(plan)
        + f", moe kernel '{plan.moe_kernel}'",
    ] + [f"#   {name}: {PROGRAM_DOC[name]}" for name in plan.programs]


def weights_text(plan: Plan) -> str:
    """The weights as the rows below hold them: a quantized checkpoint's experts are not ``--dtype``."""
    s = plan.settings
    if plan.quant is not None:
        return f"weights {plan.quant.name} as stored, {s.dtype} elsewhere"
    if any(b is not None for b in row_bits(plan)):
        return f"weights {s.dtype}, routed experts as each row says"
    return f"weights {s.dtype}"


def compiled_for(plan: Plan) -> str:
    s = plan.settings
    if s.platform == "tpu":
        return (f"compiled in {s.dtype} for TPU {s.topology} ({tpu.device_kind(s.topology)}, {tpu.chips(s.topology)} "
                "chips) by the TPU compiler on this host (deviceless; not run on a TPU)")
    return f"compiled in {compile_dtype(s)} on {jax.devices()[0].platform.upper()}"


def format_mesh(plan: Plan, hbm: int | None = None) -> list[str]:
    """One mesh: its line and the table (one row per expert width), then the training step if planned."""
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    unit, _gb = _scale(plan)
    times = ", ".join(f"{n} {m.lower_s:.0f}+{m.compile_s:.0f} s" for n, m in plan.programs.items())
    lines = [f"# mesh {mesh} ({plan.devices} devices): bytes per device in {unit}"
             + (f", HBM {_gb(hbm)} {unit}" if hbm else "") + (f"; lower+compile {times}" if times else "")]
    progs = list(plan.programs)
    head = ["experts", "params", "of which experts", "target cache", "draft cache", "other state"]
    for name in progs:
        head += [f"{name} temp (f32 / x{plan.temp_ratio:g})" if plan.temp_ratio < 1 else f"{name} temp",
                 f"{name} peak"]
    if hbm:
        head.append("fits")
    rows = []
    for b in row_bits(plan):
        label = bits_label(plan, b) + (" (runtime)" if b is None else " (what-if)")
        row = [label, _gb(plan.param_bytes(b)), _gb(plan.routed_expert_bytes(b)),
               _gb(plan.state_bytes("tcache")), _gb(plan.state_bytes("dcache")),
               _gb(plan.state_bytes() - plan.state_bytes("tcache") - plan.state_bytes("dcache"))]
        verdicts = []
        for name in progs:
            mem = plan.programs[name]
            hi, lo = plan.totals(name, b)
            if plan.temp_ratio < 1:
                row += [f"{_gb(mem.temp)} / {_gb(mem.temp * plan.temp_ratio)}", f"{_gb(hi)} / {_gb(lo)}"]
            else:
                row += [_gb(mem.temp), _gb(hi)]
            if hbm:
                verdicts.append(f"{name} " + ("yes" if hi <= hbm else "if bf16 temps" if lo <= hbm else "no"))
        if hbm and not progs:  # accounting only: what stays resident, before any program runs
            verdicts.append("params+state " + ("yes" if plan.param_bytes(b) + plan.state_bytes() <= hbm else "no"))
        if hbm:
            row.append(", ".join(verdicts))
        rows.append(row)
    lines += _table(head, rows)
    if plan.settings.platform == "tpu" and plan.programs:
        lines += [""] + format_costs(plan)
    if plan.train is not None:
        lines += [""] + format_train(plan, hbm)
    return lines


def format_costs(plan: Plan) -> list[str]:
    """The TPU compiler's cost analysis per program, and per K its round estimate and predicted speedup."""
    lines = ["# TPU compiler cost analysis per chip (estimates from its cost model, each loop body counted once)"]
    rows = [[n, f"{m.flops / 1e12:,.3f}" if m.flops is not None else "-",
             f"{m.bytes_accessed / 1e9:,.2f}" if m.bytes_accessed is not None else "-",
             f"{m.estimated_seconds * 1e3:,.2f}" if m.estimated_seconds is not None else "-"]
            for n, m in list(plan.programs.items()) + ([("decode K=0", plan.rounds[0])] if 0 in plan.rounds else [])]
    lines += _table(["program", "TFLOP", "GB accessed", "estimated ms"], rows)
    if any(r[3] == "-" for r in rows):
        lines.append("# '-': the cost model gave no time for that program (a non-positive figure, as it does for "
                     "full-depth Kimi-K2.5); no speedup is predicted from it: --speedup prices one round "
                     "per K and batch with a roofline instead (docs/plan.md)")
    if plan.rounds:
        source = "given" if plan.settings.tau else "the demo pair's measured greedy acceptance"
        lines += [f"# predicted speedup = tau * t(K=0 round) / t(K round), tau {source} (a compiler estimate, "
                  "not a measurement)"]
        lines += _table(["K", "tau", "estimated round ms", "predicted speedup"],
                        [[str(r["num_draft_tokens"]), f"{r['tau']:.2f}", f"{r['estimated_seconds'] * 1e3:,.2f}"
                          if r["estimated_seconds"] else "-",
                          f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "-"]
                         for r in round_estimates(plan)])
    return lines


def format_notes(plan: Plan) -> list[str]:
    notes = []
    if plan.settings.platform == "tpu":
        notes.append("compiled for TPU, not run on one: bytes are the TPU compiler's own per-chip figures (exact, "
                     "planned dtype); 'fits' uses the chip HBM it reports unless --hbm is given")
    if plan.quant is not None:
        notes.append(f"runtime row: the parameters load_target(weights='native') allocates ({plan.quant.name}: "
                     "values and scales as the checkpoint stores them, dequantized a tile of one matrix at a time "
                     "inside the matmuls); --weights bfloat16 plans the dequantized model")
    elif any(b < 16 for b in plan.settings.expert_bits):
        notes.append("what-if rows are computed from the shapes (packed weights + scales); the runtime row is the "
                     "model dtype, what load_target allocates for this config")
    if plan.prefill_chunk and "prefill" in plan.programs:
        notes.append(f"prefill admits the {plan.settings.prompt_len}-token prompt block {plan.prefill_chunk} "
                     "positions per target call (chunked prefill; the same tokens for every chunk size)")
    if plan.temp_ratio < 1:
        notes.append("temp and peak: upper / lower estimate (float32 compile, and that scaled to the 2-byte dtype)")
    notes.append("peak = params + loop state (caches, tokens) + temporaries; runtime reserves, collective "
                 "buffers and fragmentation are not included")
    return [f"# {n}" for n in notes]


def json_mesh(plan: Plan, hbm: int | None = None) -> dict:
    """One mesh for ``--json``: a row per expert width, each program's peak and verdict.

    ``peak_bytes`` / ``fits`` count temporaries in the planned (2-byte) dtype, as an accelerator
    computes a bf16 model; ``peak_bytes_f32_temps`` / ``fits_f32_temps`` are the float32 compile's
    upper estimate (the table prints both)."""
    rows = []
    for b in row_bits(plan):
        programs = {}
        for name in plan.programs:
            hi, lo = plan.totals(name, b)
            mem = plan.programs[name]
            entry = {"peak_bytes": int(lo), "fits": (lo <= hbm) if hbm else None,
                     "platform": plan.settings.platform, "topology": plan.settings.topology,
                     "flops": mem.flops, "bytes_accessed": mem.bytes_accessed,
                     "estimated_seconds": mem.estimated_seconds, "temp_bytes": mem.temp,
                     "compile_seconds": round(mem.lower_s + mem.compile_s, 1)}
            if plan.temp_ratio < 1:
                entry.update(peak_bytes_f32_temps=int(hi), fits_f32_temps=(hi <= hbm) if hbm else None)
            if name != "decode":
                entry["prefill_chunk"] = plan.prefill_chunk
            programs[name] = entry
        label = {4: "int4-experts", 8: "fp8-experts"}.get(b, plan.quant.name if plan.quant else plan.settings.dtype)
        rows.append({"weights": label, "runtime": b is None, "param_bytes": int(plan.param_bytes(b)),
                     "expert_bytes": int(plan.routed_expert_bytes(b)), "programs": programs})
    out = {"mesh": ",".join(f"{k}={v}" for k, v in plan.mesh_shape.items()), "hbm_bytes": hbm,
           "platform": plan.settings.platform, "topology": plan.settings.topology, "rows": rows}
    if plan.rounds:
        out["rounds"] = round_estimates(plan)
    if plan.train is not None:
        out["train"] = json_train(plan, hbm)
    return out


def json_train(plan: Plan, hbm: int | None) -> dict:
    """The draft training step: what each device holds, its temporaries, and the peak (upper and
    lower, as the table prints them) against ``hbm``."""
    s, t = plan.settings, plan.train
    hi, lo = t.totals(train_temp_ratio(s))
    return {"hidden_source": s.hidden_source, "train_batch": s.train_batch, "train_len": s.train_len,
            "ttt_steps": s.ttt_steps, "train_dtype": s.train_dtype, "platform": s.platform,
            "topology": s.topology, "frozen_target_bytes": t.frozen_target, "head_bytes": t.head,
            "draft_param_bytes": t.draft_params, "optimizer_bytes": t.optimizer, "batch_bytes": t.batch,
            "temp_bytes": t.program.temp, "peak_bytes": int(hi), "peak_bytes_lower": int(lo),
            "fits": (hi <= hbm) if hbm else None, "compile_seconds": round(t.program.lower_s + t.program.compile_s, 1)}


def round_estimates(plan: Plan) -> list[dict]:
    """Per K: the TPU compiler's estimate of one decode round and the speedup it predicts for the
    acceptance length tau (tokens per round). An estimate from the compiler's cost model, not a run."""
    return [{"num_draft_tokens": k, "estimated_seconds": m.estimated_seconds, "flops": m.flops,
             "bytes_accessed": m.bytes_accessed, "tau": plan.tau(k),
             "predicted_speedup": plan.predicted_speedup(k, plan.tau(k))}
            for k, m in sorted(plan.rounds.items())]


def format_plan(plan: Plan, hbm: int | None = None) -> str:
    return "\n".join(format_header(plan) + [""] + format_mesh(plan, hbm) + [""] + format_notes(plan))


def train_temp_ratio(s) -> float:
    """How the training step's compiled temporaries scale to the planned dtype. The draft trains in
    train_dtype: with float32 weights its TTT activations are float32 too, so only a narrower train
    dtype makes the float32 CPU compile an overestimate. On TPU the step compiles in its own
    dtypes: nothing to scale."""
    size = lambda name: jnp.dtype(resolve_dtype(name)).itemsize  # noqa: E731
    return 1.0 if s.platform == "tpu" else min(1.0, size(s.train_dtype) / size(s.compile_dtype))


def format_train(plan: Plan, hbm: int | None) -> list[str]:
    s, t = plan.settings, plan.train
    ratio = train_temp_ratio(s)
    hi, lo = t.totals(ratio)
    unit, scale = _unit(hi)
    _gb = lambda n: f"{n / scale:,.1f}"  # noqa: E731
    lines = [f"# train: eagle3_jax.train.step.train_step, hidden states {s.hidden_source}, {s.train_accum} x "
             f"{s.train_batch} rows x {s.train_len} tokens, TTT {s.ttt_steps} steps, draft + AdamW in "
             f"{s.train_dtype}; lowered {t.program.lower_s:.0f} s, compiled {t.program.compile_s:.0f} s; {unit}"]
    head = ["frozen target", "target head", "draft params", "AdamW state", "batch", "temp", "peak"]
    row = [_gb(t.frozen_target), _gb(t.head), _gb(t.draft_params), _gb(t.optimizer), _gb(t.batch)]
    if t.program.temp is None:   # the TPU compiler refused it: peak is its figure of what it needs
        row += ["-", _gb(hi)]
    elif ratio < 1:
        row += [f"{_gb(t.program.temp)} / {_gb(t.program.temp * ratio)}", f"{_gb(hi)} / {_gb(lo)}"]
    else:
        row += [_gb(t.program.temp), _gb(hi)]
    if hbm:
        head.append("fits")
        row.append("yes" if hi <= hbm else "if bf16 temps" if lo <= hbm else "no")
    lines += _table(head, [row])
    if t.program.temp is None:
        lines.append(f"# the TPU compiler refused the step for HBM: {t.program.error}")
    return lines


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [fmt(r) for r in rows]
