"""How lossless greedy speculation is in bfloat16, on the demo pair's held-out prompts.

For float32 and bfloat16 (target and draft in that dtype): how many prompts' EAGLE-3 output
(K draft tokens, batch 1) equals target-only output token for token. For bf16 also: how far the
target's logits for the same positions differ between the 1-token decode path and the
(K+1)-token verify path (in bf16 ulps of the position's largest logit), and, at each prompt's
first divergence, target-only's top-2 margin in the same unit — a divergence at a margin of a
few ulps is a near tie that rounding flipped; a large margin would be a bug.

    .venv/bin/python benchmarks/studies/bf16_lossless.py [--demo-dir demo] [--num-prompts 16] [--max-new-tokens 96] [--k 6]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/_common.py
from _common import REPO, load_average, machine, quiet_watchdog, table  # noqa: E402

import eagle3_jax as e3
from eagle3_jax.serve.demo import read_prompts
from eagle3_jax.tokenizer import load_tokenizer

BF16_EPS = 2.0 ** -8


def logits_along(target, prompt, tokens, chunk: int, capacity: int) -> np.ndarray:
    """Teacher-forced logits predicting each of ``tokens``, fed ``chunk`` tokens per target call."""
    seq = list(prompt) + list(tokens)
    cache = target.init_cache(1, capacity)
    logits, _, cache, lengths = target.prefill(jnp.asarray([prompt]), jnp.asarray([len(prompt)]), cache)
    rows = [np.asarray(logits[0, -1])]
    i = len(prompt)
    while len(rows) < len(tokens):
        piece = seq[i:i + chunk]
        piece += [0] * (chunk - len(piece))
        logits, _, cache, lengths = target.extend(jnp.asarray([piece]), lengths, cache)
        rows += list(np.asarray(logits[0]))
        i += chunk
    return np.stack(rows[:len(tokens)])


def ulps(x, logits_TV) -> np.ndarray:
    return x / (BF16_EPS * np.abs(logits_TV).max(-1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=6)
    args = ap.parse_args(argv)
    tok = load_tokenizer(os.path.join(args.demo_dir, "target"))
    prompts = [tok.encode(r["prompt"]) for r in read_prompts(os.path.join(args.demo_dir, "prompts.jsonl"),
                                                             args.num_prompts)]
    capacity = max(map(len, prompts)) + args.max_new_tokens + args.k + 2
    rows = []
    with quiet_watchdog():
        for dtype in ("float32", "bfloat16"):
            target = e3.load_target(os.path.join(args.demo_dir, "target"), dtype=dtype)
            draft = e3.load_draft(os.path.join(args.demo_dir, "draft"), target)
            base_gen = e3.Generator(target, None, max_len=capacity)
            spec_gen = e3.Generator(target, draft, num_draft_tokens=args.k, max_len=capacity)
            same, margins, worst = 0, [], 0.0
            for p in prompts:
                want = base_gen.generate([p], args.max_new_tokens, eos_token_ids=tok.eos_token_ids).tokens[0]
                got = spec_gen.generate([p], args.max_new_tokens, eos_token_ids=tok.eos_token_ids).tokens[0]
                same += got == want
                if dtype == "float32":
                    continue
                step_TV = logits_along(target, p, want, 1, capacity)
                verify_TV = logits_along(target, p, want, args.k + 1, capacity)
                worst = max(worst, float(ulps(np.abs(step_TV - verify_TV).max(-1), step_TV).max()))
                first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
                if first is not None:
                    top2 = np.sort(step_TV[first])[-2:]
                    margins.append(float(ulps(top2[1] - top2[0], step_TV[first:first + 1])[0]))
            rows.append([dtype, f"{same}/{len(prompts)}",
                         f"{worst:.2f}" if dtype == "bfloat16" else "-",
                         ", ".join(f"{m:.2f}" for m in margins) if dtype == "bfloat16" else "-"])
            print(f"  {dtype}: {same}/{len(prompts)} identical", file=sys.stderr, flush=True)
    print(f"{machine()}, load average {load_average()}; demo pair, {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, greedy, K={args.k}, batch 1")
    print(table(["dtype", "EAGLE-3 == target-only", "max |verify - decode| logit (bf16 ulps)",
                 "top-2 margin at each divergence (bf16 ulps)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
