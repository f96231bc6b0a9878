"""How the serve engine shapes its admissions, against the rules it replaced, in one run.

Each distinct (rows per call, prompt block) of an admission is a program compiled for the whole
target. ``power of two`` padded each admission's rows to the next power of two (one program per
power of two up to the batch, per prompt block); ``two row counts`` is ``engine.admission_calls``
(a call of the whole batch while it is more than half used, else calls of the refill size) with
each call at its prompts' own bucket; ``current`` adds ``session.AdmissionBlocks`` (a call pads
its prompts to a block already compiled, up to ``PAD_TO_COMPILED`` times its bucket, until that
padding has cost a compile's worth of prefill). Workload: refill.py's (held-out demo prompts, stop
ids that end ~3/4 of the answers early, so rows are refilled a few at a time), greedy, target-only
and with the demo's EAGLE-3 draft.

Per mode and rule: the admission programs the job called, the seconds its first pass compiled
(in-memory caches cleared before it, no persistent cache), then ``--repeats`` interleaved timed
passes (the rules alternate; the median counts). Outputs must be identical.

    .venv/bin/python benchmarks/admissions.py [--prompts 32] [--batch 8] [--max-new-tokens 128]
        [--num-draft-tokens 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import jax

import eagle3_jax as e3
from _common import REPO, describe, load_average, machine, table
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative import engine as engine_module
from eagle3_jax.speculative import session as session_module
from refill import pick_stop_ids


def power_of_two_calls(n: int, whole: int, part: int) -> list[int]:
    """The rule before ``admission_calls``: calls of ``whole`` rows, the last padded to a power of two.
    The old rule capped the padding at the batch, this at ``whole``: the same here, where
    ``max_admit_rows`` is left at its default (the batch)."""
    calls = []
    while n > 0:
        calls.append(min(1 << (min(n, whole) - 1).bit_length(), whole))
        n -= calls[-1]
    return calls


# name -> (how an admission splits into calls, PAD_TO_COMPILED: 1 runs each call at its own bucket)
RULES = {"power of two": (power_of_two_calls, 1), "two row counts": (engine_module.admission_calls, 1),
         "current": (engine_module.admission_calls, session_module.PAD_TO_COMPILED)}


def run(rule, target, draft, K, cap, prompts, B, N, eos):
    """One job under ``rule``: (outputs, distinct admission shapes, compile seconds, wall seconds)."""
    shapes = set()
    admit = engine_module.admit_rows

    def recorded(*args, **kw):
        shapes.add((len(args[6]), args[7].shape[1], args[2] is not None))
        return admit(*args, **kw)

    engine_module.admission_calls, session_module.PAD_TO_COMPILED = rule
    engine_module.admit_rows = recorded
    try:
        eng = engine_module.Engine(target, draft=draft, num_draft_tokens=K, max_len=cap, batch_size=B,
                                   max_new_tokens=N, eos_token_ids=eos)
        t = time.perf_counter()
        got = {f.key: f.tokens for f in eng.run([engine_module.Request(str(i), p) for i, p in enumerate(prompts)])}
        seconds = time.perf_counter() - t
    finally:
        engine_module.admission_calls, session_module.PAD_TO_COMPILED = RULES["current"]
        engine_module.admit_rows = admit
    return [got[str(i)] for i in range(len(prompts))], shapes, eng.compile_seconds, seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    B, N, K = args.batch, args.max_new_tokens, args.num_draft_tokens
    logging.getLogger("eagle3_jax").setLevel(logging.ERROR)   # the acceptance watchdog is not measured here
    warnings.simplefilter("ignore", e3.AcceptanceCollapseWarning)
    pair = DemoPair.load(str(REPO / "demo"), num_prompts=args.prompts)
    target, prompts = pair.target, pair.prompt_ids
    cap = pair.capacity(N, K)
    eos, lengths = pick_stop_ids(e3.Generator(target, None, max_len=cap).generate(prompts, N).tokens, N)

    rows = []
    for mode, draft in (("target-only", None), (f"EAGLE-3 K={K}", pair.draft)):
        first = {}
        for name, rule in RULES.items():
            jax.clear_caches()   # each rule's first pass compiles all it calls
            first[name] = run(rule, target, draft, K, cap, prompts, B, N, eos)
        for name in list(RULES)[:-1]:   # compiled again (the caches were cleared since), untimed
            run(RULES[name], target, draft, K, cap, prompts, B, N, eos)
        secs = {name: [] for name in RULES}
        for rep in range(args.repeats):
            for name in (RULES if rep % 2 == 0 else reversed(list(RULES))):
                secs[name].append(run(RULES[name], target, draft, K, cap, prompts, B, N, eos)[3])
        tokens = sum(len(t) for t in first["current"][0])
        same = {name: sum(a == b for a, b in zip(first[name][0], first["power of two"][0])) for name in RULES}
        base = statistics.median(secs["power of two"])
        for name in RULES:
            med = statistics.median(secs[name])
            rows.append((mode, name, len(first[name][1]), f"{first[name][2]:.1f}", f"{tokens / med:.1f}",
                         f"{base / med:.2f}", f"{min(secs[name]):.2f}-{max(secs[name]):.2f}",
                         f"{same[name]}/{len(prompts)}"))

    print(f"# admissions  machine: {machine()}, jax {jax.__version__} ({jax.default_backend()}), {load_average()}")
    print(f"# {describe(pair)}")
    print(f"# workload: {len(prompts)} held-out prompts, batch {B}, max_new_tokens {N}, greedy, stop ids {list(eos)}; "
          f"answer lengths median {statistics.median(lengths):.0f}, {sum(n >= N for n in lengths)} run to the limit; "
          f"median of {args.repeats} interleaved passes")
    print()
    print(table(("mode", "admission rule", "admission programs", "first pass compiling (s)", "tok/s (median)",
                 "× power of two", "seconds range", "identical"), rows))


if __name__ == "__main__":
    main()
