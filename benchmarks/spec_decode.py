"""Speculative (EAGLE-3) vs target-only greedy decoding, on the same random target, in one run.

1. Builds a random DeepSeek-V3-shaped target (``build_target``; default: the bench config of
   ``_common.py`` with vocab 2048 — hidden 256, 4 layers, 16 routed experts top-4), trains an EAGLE-3
   draft on the target's own greedy outputs (``tests.spec_fixtures``: step-0, hard labels, Adam).
2. Times ``Generator(target)`` vs ``Generator(target, draft, num_draft_tokens=K)`` for every K and
   batch, steady state (one warm-up call compiles first; best of --repeats, all configs of a batch
   timed round-robin so they share the background load). The timed prompts are
   the first P tokens of training-corpus rows, so the draft has learned their continuations: a
   random target has no structure a small draft can generalize from, which the "tau held-out"
   column (one untimed run on fresh random prompts, same shapes) shows. tok/s = batch *
   max_new_tokens / seconds; both include the prefill. Greedy spec tokens must equal target-only
   tokens (rows equal are printed).
3. Loop efficiency: seconds per spec round inside the jitted while_loop, against its parts timed
   alone as separately jitted calls:
     verify = ``LoadedTarget.extend`` of K+1 tokens (with the draft's aux layers),
     step   = one draft token step (``nnx.merge(draft.graphdef, draft.state)`` inside ``jax.jit``,
              with a ``KVCache``),
     catch  = the draft's catch-up pass over K+1 tokens (the round does K-1 steps + 1 catch-up).
   round = (spec seconds - spec prefill seconds) / while-loop iterations, where the prefill is a
   max_new_tokens=1 call and the iterations are the slowest row's rounds.
   eff = (verify + K * step) / round;  eff' = (verify + (K-1) * step + catch) / round.
   K=0 rows do the same for target-only decoding: (extend of 1 token) / (seconds per decode step).
   eff > 1 means the in-loop round is cheaper than its parts dispatched one by one from Python.
   "round / target step" is what a round costs in target-only decode steps: spec decoding only pays
   off (ignoring prefill) when tau exceeds it.

    .venv/bin/python benchmarks/spec_decode.py [--batch 1,4] [--num-draft-tokens 1,2,4]
        [--max-new-tokens 64] [--config bench|PATH.json] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import time
import warnings

from _common import BENCH_TARGET_CONFIG, REPO, block, machine, table

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle3_jax as e3
from tests import spec_fixtures


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def target_config(spec: str, overrides: list[str]) -> dict:
    if spec == "bench":
        d = dict(BENCH_TARGET_CONFIG, vocab_size=2048)
    else:
        path = spec if os.path.isabs(spec) or os.path.exists(spec) else os.path.join(REPO, spec)
        d = json.loads(open(path).read())
    for kv in overrides:
        k, v = kv.split("=", 1)
        d[k] = json.loads(v)
    return d


# ---------------------------------------------------------------- component timings
def _draft_step(graphdef, state, ids_BT, hidden_BTD, pos_BT, embed_VD, cache):
    draft = nnx.merge(graphdef, state)
    out = draft(ids_BT, hidden_BTD, pos_BT, embed_VD, cache)
    return out.logits_BTW, out.hidden_BTD, out.cache


_draft_step_jit = jax.jit(_draft_step, static_argnums=(0,), donate_argnums=(6,))


def verify_fn(target: e3.LoadedTarget, aux_ids, B: int, T: int, n: int, capacity: int):
    """LoadedTarget.extend of T tokens at lengths n (the same slots rewritten every call)."""
    box = {"cache": target.init_cache(B, capacity)}
    ids = jnp.ones((B, T), jnp.int32)
    lengths = jnp.full((B,), n, jnp.int32)

    def call():
        logits, aux, box["cache"], _ = target.extend(ids, lengths, box["cache"], aux_layer_ids=aux_ids)
        return logits, aux

    return call


def draft_fn(draft: e3.LoadedDraft, B: int, T: int, n: int, capacity: int):
    """One jitted draft call over T tokens at positions n..n+T-1 with a KVCache (T=1: a draft step)."""
    embed = draft.target.model.embed_tokens[...]
    box = {"cache": draft.model.init_cache(B, capacity)}
    ids = jnp.ones((B, T), jnp.int32)
    hidden = jnp.ones((B, T, draft.config.hidden_size), draft.model.dtype)
    pos = jnp.broadcast_to(n + jnp.arange(T, dtype=jnp.int32), (B, T))

    def call():
        logits, h, box["cache"] = _draft_step_jit(draft.graphdef, draft.state, ids, hidden, pos, embed, box["cache"])
        return logits, h

    return call


def best_of(fns: dict, repeats: int, warmup: int = 1) -> tuple[dict, dict]:
    """Times every fn in round-robin (so all see the same background load) after warm-up calls.
    Returns ({name: min seconds}, {name: last result}). The minimum, not the median: on a shared
    machine other jobs only ever add time, so the fastest call is the least-contended one."""
    for fn in fns.values():
        for _ in range(warmup):
            block(fn())
    secs = {k: [] for k in fns}
    res = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            res[k] = block(fn())
            secs[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in secs.items()}, res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--num-draft-tokens", default="1,2,4", help="comma-separated K values")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--config", default="bench", help="'bench' (_common.BENCH_TARGET_CONFIG, vocab 2048) or an HF "
                                                     "config.json path (e.g. configs/models/tiny_deepseek_v3.json)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="target config overrides")
    ap.add_argument("--aux-ids", default=None, help="draft aux layer ids (default 0,L//2,L-1)")
    ap.add_argument("--draft-intermediate", type=int, default=512)
    ap.add_argument("--corpus-prompts", type=int, default=8)
    ap.add_argument("--corpus-new-tokens", type=int, default=0, help="at least P-6+N+K+2")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    batches, Ks, N, P = parse_ints(args.batch), parse_ints(args.num_draft_tokens), args.max_new_tokens, args.prompt_len
    load0 = os.getloadavg()

    # ------------------------------------------------------------ 1. target + draft
    hf = target_config(args.config, args.set)
    tcfg = e3.TargetConfig.from_hf_dict(hf)
    target = e3.build_target(tcfg, "float32", seed=args.seed)
    L = tcfg.num_hidden_layers
    aux_ids = tuple(parse_ints(args.aux_ids)) if args.aux_ids else (0, L // 2, L - 1)
    dcfg = spec_fixtures.tiny_draft_config(tcfg, aux_ids=aux_ids, intermediate_size=args.draft_intermediate)
    draft0 = e3.build_draft(dcfg, target, seed=args.seed + 1)
    # The corpus covers the timed continuations: prompt (first P tokens of a row) + N new tokens + K.
    corpus_new = max(P - 6 + N + max(Ks) + 2, args.corpus_new_tokens)
    t0 = time.perf_counter()
    seqs = spec_fixtures.target_greedy_corpus(target, n_prompts=args.corpus_prompts, prompt_len=6,
                                              new_tokens=corpus_new, seed=args.seed)
    t_corpus = time.perf_counter() - t0
    t0 = time.perf_counter()
    draft, loss = spec_fixtures.train_draft_on_target(target, draft0, seqs, steps=args.train_steps,
                                                      batch=min(16, len(seqs)), seed=args.seed)
    t_train = time.perf_counter() - t0
    distinct = np.mean([len(set(r[6:].tolist())) / len(r[6:]) for r in seqs])

    print(f"# spec_decode  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(target.state))
    d_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(draft.state))
    print(f"target: {args.config} hidden {tcfg.hidden_size}, {L} layers, {hf.get('n_routed_experts')} experts "
          f"top-{hf.get('num_experts_per_tok')}, vocab {tcfg.vocab_size}, {n_params / 1e6:.2f}M params (float32); "
          f"draft: 1 layer, intermediate {args.draft_intermediate}, aux ids {list(aux_ids)}, "
          f"{d_params / 1e6:.2f}M params")
    print(f"draft training: corpus {seqs.shape} greedy target tokens ({t_corpus:.1f}s), {args.train_steps} Adam "
          f"steps ({t_train:.1f}s), final train loss {loss:.3f}; target greedy outputs have {distinct:.2f} distinct "
          f"tokens per position")

    # ------------------------------------------------------------ 2. timing (each batch: all configs round-robin)
    # Timed prompts: the first P tokens of corpus rows, so the continuation is what the draft was
    # trained on (a random target has no structure a draft can generalize from; see held-out tau).
    rng = np.random.default_rng(args.seed + 999)
    Tpad = -(-P // 16) * 16
    capacity = Tpad + N + max(Ks) + 2
    n_mid = P + N // 2
    rows, eff_rows, all_match = [], [], True
    for B in batches:
        prompts = seqs[:B, :P].tolist()
        heldout = rng.integers(2, tcfg.vocab_size, size=(B, P)).tolist()
        base = e3.Generator(target, None, max_len=capacity)
        gens = {K: e3.Generator(target, draft, num_draft_tokens=K, max_len=capacity) for K in Ks}
        runs = {"base": lambda: base.generate(prompts, N), "base_pre": lambda: base.generate(prompts, 1),
                # the spec prefill (target + draft prefill) does not depend on K
                "spec_pre": lambda: gens[Ks[0]].generate(prompts, 1)}
        runs.update({K: functools.partial(gens[K].generate, prompts, N) for K in Ks})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", e3.AcceptanceCollapseWarning)
            secs, res = best_of(runs, args.repeats)
            log = logging.getLogger("eagle3_jax")
            level, _ = log.level, log.setLevel(logging.ERROR)  # the collapse watchdog fires here, as it should
            tau_held = {K: gens[K].generate(heldout, N).stats.mean_accept_length for K in Ks}
            log.setLevel(level)
        print(f"  B={B}: generation timed  [{time.perf_counter() - t_start:.0f}s]", flush=True)
        parts = {"ext1": verify_fn(target, (), B, 1, n_mid, capacity), "step": draft_fn(draft, B, 1, n_mid, capacity)}
        for K in Ks:
            parts[("verify", K)] = verify_fn(target, draft.aux_layer_ids, B, K + 1, n_mid, capacity)
            parts[("catch", K)] = draft_fn(draft, B, K + 1, n_mid, capacity)
        comp, _ = best_of(parts, max(args.repeats, 10), warmup=2)
        print(f"  B={B}: components timed  [{time.perf_counter() - t_start:.0f}s]", flush=True)

        t_base, r_base = secs["base"], res["base"]
        tps_base = B * N / t_base
        step_base = (t_base - secs["base_pre"]) / (N - 1)
        ext1, step = comp["ext1"], comp["step"]
        eff_rows.append([0, B, 1e3 * step_base, 1e3 * ext1, "-", "-", ext1 / step_base, "-", 1.0, 1.0])
        for K in Ks:
            t_spec, r_spec = secs[K], res[K]
            tau = r_spec.stats.mean_accept_length
            match = sum(a == b for a, b in zip(r_spec.tokens, r_base.tokens))
            all_match &= match == B
            rows.append([K, B, tau, tau_held[K], tps_base, B * N / t_spec, t_base / t_spec, f"{match}/{B}"])
            # while-loop iterations = the slowest row's rounds (each row emits 1 token at prefill)
            iters = max(round((len(t) - 1) / a) for t, a in zip(r_spec.tokens, r_spec.stats.per_row_accept_length))
            t_round = (t_spec - secs["spec_pre"]) / iters
            verify, catch = comp[("verify", K)], comp[("catch", K)]
            eff_rows.append([K, B, 1e3 * t_round, 1e3 * verify, 1e3 * step, 1e3 * catch,
                             (verify + K * step) / t_round, (verify + (K - 1) * step + catch) / t_round,
                             t_round / step_base, tau])

    print()
    print(f"## spec vs target-only, greedy, prompt {P} tokens, {N} new tokens, capacity {capacity}, "
          f"best of {args.repeats}; prompts from the draft's training corpus, tau held-out on random prompts")
    print(table(["K", "batch", "tau", "tau held-out", "tok/s target-only", "tok/s spec", "ratio", "spec==target rows"], rows))
    print(f"greedy spec tokens == target-only tokens: {'YES, all rows' if all_match else 'NO (see table)'}")
    print()
    print("## loop efficiency (ms); K=0: target-only decode step vs one LoadedTarget.extend of 1 token")
    print(table(["K", "batch", "round in loop", "verify extend K+1", "draft step", "draft catch-up K+1",
                 "eff (verify+K*step)/round", "eff' (verify+(K-1)step+catch)/round",
                 "round / target step (break-even tau)", "tau"], eff_rows))
    load1 = os.getloadavg()
    print(f"\nload average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; total {time.perf_counter() - t_start:.0f}s; "
          f"{datetime.date.today()}")


if __name__ == "__main__":
    main()
