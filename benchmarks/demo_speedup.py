"""Speedup of EAGLE-3 over target-only decoding: measured on the demo pair, projected on a big target.

(a) Measured. The demo pair (demo/target + demo/draft) decodes the held-out prompts greedily twice,
    target-only and speculative with K draft tokens (demo.yaml num_draft_tokens, or --k), at each
    batch size. Per batch size: one untimed warm-up call per mode compiles (every batch pins the
    same padded prompt length, so nothing compiles later); then --repeats rounds, each running
    every batch target-only and speculative back to back (the order alternates between rounds),
    so both modes share the machine's background load. A batch's time is its best over the
    rounds; tok/s = new tokens / the sum of those times. Greedy decoding is lossless, so the
    speculative tokens must equal the target-only tokens; the table says how many rows do.
    Batch B uses the first floor(prompts / B) * B prompts.

(b) Projection. The demo target is tiny, so on a CPU its decoding is compute-bound, while on
    GPUs/TPUs (and for big models on a CPU) a decode step is bound by reading the weights, which
    is what makes verifying K+1 tokens nearly as cheap as decoding one. So a random-weight
    DeepSeek-V3-shaped target of >= 100M parameters (default: hidden 1024, 8 layers, 64 routed
    experts top-4, vocab 32768) and a random EAGLE-3 draft sized for it (one layer of the target's
    width; aux layers = the target's default ids) are timed as separately jitted calls, steady
    state, best of --proj-repeats, round-robin, at each batch size:
      t(1)            one decode step       = LoadedTarget.extend of 1 token
      t_verify(K+1)   the verify pass       = LoadedTarget.extend of K+1 tokens with aux layers
      t_draft         one draft token step  = the draft over 1 token with its KV cache
    and projected speedup = tau_demo x t(1) / (t_verify(K+1) + K x t_draft), with tau_demo the
    tau measured in (a) at that batch. A projection, not a measurement: it leaves out the
    prefill, the draft's catch-up pass and sampling, and assumes the big pair would reach the
    demo's tau.

    .venv/bin/python benchmarks/demo_speedup.py [--demo-dir demo] [--batch 1,8] [--k K]
        [--num-prompts N] [--max-new-tokens 96] [--repeats 3]
        [--proj-hidden 1024] [--proj-layers 8] [--proj-experts 64] [--proj-topk 4] [--proj-vocab 32768]
        [--proj-set KEY=JSON ...] [--proj-dtype float32] [--proj-context 256] [--proj-repeats 10]
        [--skip-projection] [--skip-measured --tau TAU] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

from _common import BENCH_TARGET_CONFIG, REPO, machine, table
from demo_accept import describe, load_average, parse_list, quiet_watchdog

import jax

import eagle3_jax as e3
from eagle3_jax.metrics import GenerationStats
from eagle3_jax.serve.demo import DemoPair, DemoSettings, batches_of
from spec_decode import best_of, draft_fn, verify_fn

MODES = ("target-only", "eagle3")


# ---------------------------------------------------------------- (a) measured on the demo pair
@dataclass
class MeasuredRow:
    batch: int
    prompts: int
    new_tokens: int            # target-only; equal to EAGLE-3's when every row is identical
    new_tokens_eagle3: int
    seconds_target_only: float
    seconds_eagle3: float
    tau: float
    identical_rows: int
    compile_seconds_target_only: float
    compile_seconds_eagle3: float

    @property
    def tok_s_target_only(self) -> float:
        return self.new_tokens / self.seconds_target_only

    @property
    def tok_s_eagle3(self) -> float:
        return self.new_tokens_eagle3 / self.seconds_eagle3

    @property
    def speedup(self) -> float:
        return self.tok_s_eagle3 / self.tok_s_target_only

    def as_dict(self) -> dict:
        return dict(asdict(self), tok_s_target_only=self.tok_s_target_only, tok_s_eagle3=self.tok_s_eagle3,
                    speedup=self.speedup)


def measure_batch_size(pair: DemoPair, batch: int, k: int, max_new_tokens: int, repeats: int) -> MeasuredRow | None:
    n_prompts = len(pair.prompt_ids) // batch * batch
    if n_prompts == 0:
        print(f"  B={batch}: skipped, fewer than {batch} prompts")
        return None
    batches = batches_of(pair.prompt_ids[:n_prompts], batch)
    gens = {"target-only": pair.generator(0, max_new_tokens), "eagle3": pair.generator(k, max_new_tokens)}

    def call(mode, prompts):
        return gens[mode].generate(prompts, max_new_tokens, eos_token_ids=pair.eos, prompt_len=pair.prompt_len)

    compile_s = {}
    for mode in MODES:   # compiles; untimed
        t0 = time.perf_counter()
        call(mode, batches[0])
        compile_s[mode] = time.perf_counter() - t0
    best = {mode: [math.inf] * len(batches) for mode in MODES}
    first = {mode: [] for mode in MODES}   # greedy: every repeat gives the same tokens and stats
    for r in range(repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for i, prompts in enumerate(batches):
            for mode in order:
                res = call(mode, prompts)
                best[mode][i] = min(best[mode][i], res.stats.seconds)
                if r == 0:
                    first[mode].append(res)
    base, spec = first["target-only"], first["eagle3"]
    base_tokens = [t for res in base for t in res.tokens]
    spec_tokens = [t for res in spec for t in res.tokens]
    return MeasuredRow(
        batch=batch, prompts=n_prompts, new_tokens=sum(len(t) for t in base_tokens),
        new_tokens_eagle3=sum(len(t) for t in spec_tokens),
        seconds_target_only=sum(best["target-only"]), seconds_eagle3=sum(best["eagle3"]),
        tau=GenerationStats.combine(r.stats for r in spec).mean_accept_length,
        identical_rows=sum(a == b for a, b in zip(base_tokens, spec_tokens)),
        compile_seconds_target_only=compile_s["target-only"], compile_seconds_eagle3=compile_s["eagle3"])


def measured_table(rows: list[MeasuredRow]) -> str:
    return table(["batch", "prompts", "new tokens", "target-only tok/s", "EAGLE-3 tok/s", "speedup", "tau",
                  "identical rows", "compile s (target-only / EAGLE-3, untimed)"],
                 [[r.batch, r.prompts, r.new_tokens, r.tok_s_target_only, r.tok_s_eagle3, f"{r.speedup:.2f}x",
                   r.tau, f"{r.identical_rows}/{r.prompts}",
                   f"{r.compile_seconds_target_only:.1f} / {r.compile_seconds_eagle3:.1f}"] for r in rows])


# ---------------------------------------------------------------- (b) projection on a big random target
def projection_target_config(hidden: int, layers: int, experts: int, topk: int, vocab: int,
                             overrides: list[str]) -> dict:
    """A DeepSeek-V3-shaped HF config scaled down to ``hidden``: MLA with q-LoRA, one dense layer,
    then MoE layers with a shared expert and group-limited sigmoid routing. Widths follow the
    hidden size; ``overrides`` are KEY=JSON pairs applied last."""
    n_group = 8 if experts >= 32 else 4 if experts % 4 == 0 and experts >= 8 else 1
    cfg = dict(BENCH_TARGET_CONFIG,
               vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
               intermediate_size=hidden * 11 // 4, moe_intermediate_size=max(32, hidden // 8),
               n_routed_experts=experts, num_experts_per_tok=topk, n_group=n_group, topk_group=max(1, n_group // 2),
               num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
               q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
               qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=4096)
    for kv in overrides:
        key, value = kv.split("=", 1)
        cfg[key] = json.loads(value)
    return cfg


def projection_draft_config(target_cfg: e3.TargetConfig) -> e3.DraftConfig:
    """An EAGLE-3 draft for the target: one Llama layer of the target's width, the target's MLP
    width, a quarter of the vocabulary (like the demo's map), aux layers left to the target's default."""
    hidden = target_cfg.hidden_size
    heads = max(1, hidden // 128)
    return e3.DraftConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden, "intermediate_size": target_cfg.intermediate_size,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": 128,
        "vocab_size": target_cfg.vocab_size, "draft_vocab_size": target_cfg.vocab_size // 4,
        "target_hidden_size": hidden, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "eagle_config": {"use_aux_hidden_state": True}})


def count_params(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state))


@dataclass
class ProjectionRow:
    batch: int
    t1: float          # seconds: one decode step
    t_verify: float    # seconds: extend of K+1 tokens
    t_draft: float     # seconds: one draft token step
    k: int
    tau_demo: float

    @property
    def round_cost(self) -> float:
        """One speculative round in units of target decode steps: the break-even tau."""
        return (self.t_verify + self.k * self.t_draft) / self.t1

    @property
    def projected_speedup(self) -> float:
        return self.tau_demo / self.round_cost

    def as_dict(self) -> dict:
        return dict(asdict(self), verify_over_t1=self.t_verify / self.t1, draft_over_t1=self.t_draft / self.t1,
                    break_even_tau=self.round_cost, projected_speedup=self.projected_speedup)


def time_components(target: e3.LoadedTarget, draft: e3.LoadedDraft, batch: int, k: int, context: int,
                    repeats: int) -> dict[str, float]:
    """Best-of seconds of t(1), t_verify(K+1), t_draft, with the new tokens written after ``context`` cached ones."""
    capacity = context + max(16, k + 1)
    calls = {"t1": verify_fn(target, (), batch, 1, context, capacity),
             "t_verify": verify_fn(target, draft.aux_layer_ids, batch, k + 1, context, capacity),
             "t_draft": draft_fn(draft, batch, 1, context, capacity)}
    seconds, _ = best_of(calls, repeats, warmup=2)
    return seconds


def projection_table(rows: list[ProjectionRow]) -> str:
    return table(["batch", "t(1) ms", "t_verify(K+1) ms", "t_draft ms", "t_verify/t(1)", "t_draft/t(1)",
                  "break-even tau", "tau_demo", "PROJECTED speedup"],
                 [[r.batch, 1e3 * r.t1, 1e3 * r.t_verify, 1e3 * r.t_draft, r.t_verify / r.t1, r.t_draft / r.t1,
                   r.round_cost, r.tau_demo, f"{r.projected_speedup:.2f}x"] for r in rows])


# ---------------------------------------------------------------- main
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (default: demo.yaml num_draft_tokens)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: every prompt in prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds over all batches, best of")
    ap.add_argument("--skip-measured", action="store_true", help="projection only; needs --tau")
    ap.add_argument("--tau", type=float, default=None, help="tau for the projection instead of the measured one")
    ap.add_argument("--skip-projection", action="store_true")
    ap.add_argument("--proj-hidden", type=int, default=1024)
    ap.add_argument("--proj-layers", type=int, default=8)
    ap.add_argument("--proj-experts", type=int, default=64)
    ap.add_argument("--proj-topk", type=int, default=4)
    ap.add_argument("--proj-vocab", type=int, default=32768)
    ap.add_argument("--proj-set", nargs="*", default=[], metavar="KEY=JSON", help="more target config overrides")
    ap.add_argument("--proj-dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU/TPU)")
    ap.add_argument("--proj-context", type=int, default=256, help="cached tokens before the timed ones")
    ap.add_argument("--proj-repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the numbers as JSON")
    args = ap.parse_args()
    if args.skip_measured and args.tau is None and not args.skip_projection:
        ap.error("--skip-measured needs --tau for the projection")
    return args


def run_measured(args, batches: list[int]) -> tuple[list[MeasuredRow], int, str]:
    pair = DemoPair.load(args.demo_dir, args.num_prompts)
    k = args.k or pair.settings.num_draft_tokens
    print(describe(pair))
    print(f"(a) measured: greedy, K={k}, {args.max_new_tokens} new tokens per prompt, best of {args.repeats} "
          f"interleaved rounds", flush=True)
    rows = []
    with quiet_watchdog():
        for b in batches:
            t0 = time.perf_counter()
            row = measure_batch_size(pair, b, k, args.max_new_tokens, args.repeats)
            if row:
                rows.append(row)
                print(f"  B={b}: {row.speedup:.2f}x, tau {row.tau:.2f}  [{time.perf_counter() - t0:.0f}s]", flush=True)
    return rows, k, describe(pair)


def run_projection(args, batches: list[int], k: int, tau_at: dict[int, float]) -> tuple[list[ProjectionRow], dict]:
    hf = projection_target_config(args.proj_hidden, args.proj_layers, args.proj_experts, args.proj_topk,
                                  args.proj_vocab, args.proj_set)
    t0 = time.perf_counter()
    target = e3.build_target(e3.TargetConfig.from_hf_dict(hf), args.proj_dtype, seed=args.seed)
    draft = e3.build_draft(projection_draft_config(target.config), target, seed=args.seed + 1)
    info = {"target_config": hf, "target_params": count_params(target.state), "draft_params": count_params(draft.state),
            "aux_layer_ids": list(draft.aux_layer_ids), "dtype": args.proj_dtype, "context": args.proj_context}
    print(f"(b) projection target: random DeepSeek-V3 shape, hidden {hf['hidden_size']}, {hf['num_hidden_layers']} "
          f"layers, {hf['n_routed_experts']} routed experts top-{hf['num_experts_per_tok']} (+1 shared, "
          f"moe width {hf['moe_intermediate_size']}), vocab {hf['vocab_size']}: {info['target_params'] / 1e6:.0f}M "
          f"params ({args.proj_dtype}); draft {info['draft_params'] / 1e6:.0f}M params, aux layers "
          f"{info['aux_layer_ids']}; built in {time.perf_counter() - t0:.0f}s; {args.proj_context} cached tokens, "
          f"best of {args.proj_repeats}", flush=True)
    rows = []
    for b in batches:
        if b not in tau_at:
            print(f"  B={b}: skipped, no tau measured at this batch size")
            continue
        t0 = time.perf_counter()
        sec = time_components(target, draft, b, k, args.proj_context, args.proj_repeats)
        rows.append(ProjectionRow(b, sec["t1"], sec["t_verify"], sec["t_draft"], k, tau_at[b]))
        print(f"  B={b}: components timed  [{time.perf_counter() - t0:.0f}s]", flush=True)
    return rows, info


def main() -> int:
    args = parse_args()
    batches = parse_list(args.batch)
    t_start = time.perf_counter()
    print(f"# demo_speedup  {datetime.date.today()}  machine: {machine()}, jax {jax.__version__} "
          f"({jax.default_backend()}: {jax.devices()[0].device_kind}), load average at start {load_average()}")
    print("command: " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]), flush=True)
    out = {"date": str(datetime.date.today()), "machine": machine(), "backend": jax.default_backend(),
           "command": sys.argv}

    measured, k = [], args.k
    if not args.skip_measured:
        measured, k, out["demo"] = run_measured(args, batches)
        out["measured"] = [r.as_dict() for r in measured]
    k = k or DemoSettings.load(args.demo_dir).num_draft_tokens
    tau_at = {b: args.tau for b in batches} if args.tau is not None else {r.batch: r.tau for r in measured}

    projection = []
    if not args.skip_projection:
        projection, out["projection_setup"] = run_projection(args, batches, k, tau_at)
        out["projection"] = [r.as_dict() for r in projection]

    if measured:
        print()
        print(f"## (a) MEASURED speedup, demo pair, greedy, K={k}, {args.max_new_tokens} new tokens per prompt, "
              f"steady state, best of {args.repeats} interleaved rounds")
        print(measured_table(measured))
        print("greedy EAGLE-3 tokens == target-only tokens: "
              + ("YES, every row" if all(r.identical_rows == r.prompts for r in measured) else "NO (see table)"))
    if projection:
        setup = out["projection_setup"]
        print()
        print(f"## (b) PROJECTION (not a measurement): {setup['target_params'] / 1e6:.0f}M-parameter random "
              f"DeepSeek-V3-shaped target, K={k}, {setup['dtype']}; components as separately jitted calls, "
              f"best of {args.proj_repeats}; tau_demo from "
              + ("--tau" if args.tau is not None else "(a)"))
        print("projected speedup = tau_demo x t(1) / (t_verify(K+1) + K x t_draft); break-even tau = "
              "(t_verify(K+1) + K x t_draft) / t(1)")
        print(projection_table(projection))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    print(f"\nload average at end {load_average()}; total {time.perf_counter() - t_start:.0f}s")
    return 0 if all(r.identical_rows == r.prompts for r in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
