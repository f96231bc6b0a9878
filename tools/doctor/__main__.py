"""Command line: ``python -m tools.doctor --target T --draft D [--prompts P.jsonl] [--data DATA.jsonl]
[--num-prompts N] [--json]``.

Exit status: 0 the configured wiring is best, 3 another wiring accepts more (the verdict says which
ids to set), 4 (with --data) the draft accepts far less served than its accuracies on the data imply,
1 a static check failed (the message names both numbers and the fix; with --data, a data file
rendered unlike serve.py renders), 2 bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.doctor",
        description="Checks a target/draft pair from configs and headers (seconds, no weights), then measures "
                    "greedy acceptance for the configured aux-layer ids and the plausible alternatives (each id "
                    "-1 and +1, the SGLang and vLLM defaults) and says which wiring to use.")
    p.add_argument("--target", required=True, help="target checkpoint directory (HF DeepseekV3 / Kimi layout)")
    p.add_argument("--draft", required=True, help="EAGLE-3 draft directory (SpecForge / SGLang layout)")
    p.add_argument("--prompts", help="prompts JSONL (serve.py's input format); default: built-in prompts")
    p.add_argument("--data", help="training data JSONL (train.py's format): checks its rendering against serve.py's, "
                                  "measures on its prompts, and compares tau with what the draft's accuracies on "
                                  "it imply (the training eval's check)")
    p.add_argument("--num-prompts", type=int, default=6,
                   help="prompts to measure on (default 6; without --prompts at most the 8 built-in ones)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K, draft tokens per round (default 4)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default float32: the ranking of wirings does not depend on it)")
    p.add_argument("--mesh", default="none",
                   help="device mesh, e.g. data=1,expert=8,tensor=1; 'none' (default) runs on one device")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "num_draft_tokens"):
        if getattr(args, name) < 1:
            print(f"python -m tools.doctor: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from eagle3_jax.errors import Eagle3Error
    from tools.doctor.core import diagnose, format_report

    mesh = None if args.mesh == "none" else args.mesh
    say = (lambda msg: None) if args.json else (lambda msg: print(f"doctor: {msg}", file=sys.stderr, flush=True))
    try:
        report = diagnose(args.target, args.draft, prompts=args.prompts, data=args.data, num_prompts=args.num_prompts,
                          num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                          dtype=args.dtype, mesh=mesh, progress=say)
    except Eagle3Error as e:
        print(f"python -m tools.doctor: static check failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    if report.acceptance_gap:
        return 4
    return 0 if report.configured_is_best else 3


if __name__ == "__main__":
    sys.exit(main())
