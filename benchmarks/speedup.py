"""Side by side on the demo pair: target-only vs EAGLE-3 at fixed K and at K = auto, on two prompt sets.

Prompt sets: ``demo`` is the pair's held-out prompts (standard-library modules the target never
saw); ``thirdparty`` is code unlike anything it trained on, cut the same way (a few lines before a
def/class line, the header and its first body line: ``tools/demo/corpus.prompts_from``) from the
third-party packages installed beside this interpreter (numpy, scipy, jinja2: one prompt per
file, files in sha256-of-path order, so the set is the same on every run of one environment);
``heldout`` is the set the K chooser is judged on and was never tuned on (longer function halves
with their context from other packages, ``heldout_prompts.py``; committed before any tuning).

For every prompt set, batch size B and temperature T, each mode decodes all prompts on B rows as
``Generator(..., batch_size=B)`` does (one Engine run per pass): target-only, EAGLE-3 with each
--k and ``num_draft_tokens="auto"``. Every mode shares one cache capacity, so round costs are
comparable. Untimed passes per mode compile (and, for auto, probe its round costs) until one
compiles nothing (at most three; "warm / compiled" gives how many ran, and how many timed passes
still compiled something); then --repeats passes run the modes interleaved (the order rotates).
Each mode's tok/s is the median over its passes (new tokens / wall seconds, compiles excluded);
its × target-only is the median over repeats of its pass / target-only's pass in the same repeat
(paired, so load drifting across repeats cancels), with the range of those ratios beside it. At
T = 0 every mode's tokens must equal target-only's (greedy is lossless); the table says how many
prompts do. For auto it also gives the K of its last run, loop iterations per K and its predicted
vs measured speedup (measured: both round costs timed in this process; "-" where one was not).

With a P-EAGLE draft (``--parallel-draft``, default ``DEMO/peagle`` when it exists), the modes
"P-EAGLE K=k" for each --parallel-k run beside the chain draft's, on the same prompts and capacity:
all K draft tokens come from one draft pass. So do "DFlash K=k" for each --dflash-k with a DFlash
draft (``--dflash-draft``, default ``DEMO/dflash``): K tokens of one block guessed in one pass. "round ms" is wall seconds per loop iteration
(rounds summed over rows / B), so the cost of a round at each K can be read beside its τ.

    .venv/bin/python benchmarks/speedup.py [--demo-dir demo] [--prompts demo,thirdparty,heldout] [--batch 1,8,32]
        [--temperature 0,1] [--k 1,2,3,4,5,6] [--num-prompts N] [--max-new-tokens 96] [--repeats 5]
        [--parallel-draft DIR] [--parallel-k 2,4,6,8] [--dflash-draft DIR] [--dflash-k 2,4,7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import sysconfig

from _common import REPO, describe, load_average, machine, parse_list, quiet_watchdog, shown_path, table

import jax

import eagle3_jax as e3
from eagle3_jax import compile_cache
from eagle3_jax.serve.demo import DemoPair
from eagle3_jax.speculative.autodraft import DEFAULT_MAX_DRAFT_TOKENS

MAX_WARM_PASSES = 3
THIRD_PARTY_PACKAGES = ("numpy", "scipy", "jinja2")
HELDOUT_PROMPTS = os.path.join(REPO, "benchmarks", "prompts", "heldout_code.jsonl")


def thirdparty_prompts(n: int, packages=THIRD_PARTY_PACKAGES) -> list[str]:
    """``n`` code prompts from the installed ``packages`` (not their tests), one per file, files in
    sha256-of-path order; cut as the demo's held-out prompts are."""
    from tools.demo.corpus import SourceFile, prompts_from

    root = sysconfig.get_paths()["purelib"]
    files = []
    for package in packages:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames[:] = sorted(d for d in dirnames if d not in ("tests", "test", "testing", "__pycache__"))
            files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames
                      if f.endswith(".py") and not f.startswith("test_")]
    if not files:
        raise SystemExit(f"none of {packages} is installed under {root}: no third-party prompts")
    out = []
    for rel in sorted(files, key=lambda r: hashlib.sha256(r.encode()).hexdigest()):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            out += [p["prompt"] for p in prompts_from([SourceFile(rel, f.read())], 1, "thirdparty")]
        if len(out) >= n:
            return out
    return out


def mode_name(k) -> str:
    return "target-only" if k == 0 else k if isinstance(k, str) else f"K={k}"


def one_pass_mode(draft, k: int):
    """A mode decoding with a one-pass ``draft`` (P-EAGLE, DFlash) at a fixed ``k``."""
    def make(pair: DemoPair, batch: int, capacity: int):
        return e3.Generator(pair.target, draft, num_draft_tokens=k, max_len=capacity, batch_size=batch)
    return make


def make_generator(pair: DemoPair, k, batch: int, capacity: int):
    return e3.Generator(pair.target, pair.draft if k != 0 else None, num_draft_tokens=k, max_len=capacity,
                        batch_size=batch, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS if k == "auto" else None)


def measure(pair: DemoPair, prompts: list[list[int]], batch: int, temperature: float, ks: list,
            max_new_tokens: int, repeats: int, extra_modes: dict | None = None) -> list[dict]:
    """``extra_modes``: name -> factory(pair, batch, capacity) of another generator to run beside."""
    most_k = max([DEFAULT_MAX_DRAFT_TOKENS] + [m.k for m in (extra_modes or {}).values() if hasattr(m, "k")])
    capacity = max(map(len, prompts)) + max_new_tokens + most_k + 2
    modes = [0] + ks + ["auto"] + list(extra_modes or {})
    gens = {k: (extra_modes[k](pair, batch, capacity) if k in (extra_modes or {})
                else make_generator(pair, k, batch, capacity)) for k in modes}

    def run_once(k):
        return gens[k].generate(prompts, max_new_tokens, temperature=temperature, eos_token_ids=pair.eos)

    first, warm_passes = {}, {}
    for k in modes:
        # Untimed passes until one compiles nothing: the first compiles (and, for auto, probes);
        # a later one can still meet an admission size or, under auto, a K not run before.
        for n in range(1, MAX_WARM_PASSES + 1):
            first[k] = run_once(k)
            warm_passes[k] = n
            if n > 1 and gens[k].last_compile_seconds == 0:
                break
        print(f"  B={batch} T={temperature:g} {mode_name(k)}: warm after {warm_passes[k]} passes",
              file=sys.stderr, flush=True)
    compiled_timed = {k: 0 for k in modes}
    tps, taus, round_ms = {k: [] for k in modes}, {k: [] for k in modes}, {k: [] for k in modes}
    tokens = {k: first[k].tokens for k in modes}
    for r in range(repeats):
        for k in modes[r % len(modes):] + modes[:r % len(modes)]:
            res = run_once(k)
            compiled_timed[k] += gens[k].last_compile_seconds > 0
            tps[k].append(res.stats.tokens_per_second)
            taus[k].append(res.stats.mean_accept_length)
            round_ms[k].append(1e3 * res.stats.seconds / max(res.stats.rounds / batch, 1))
            tokens[k] = res.tokens
    rows = []
    for k in modes:
        ratios = [a / b for a, b in zip(tps[k], tps[0])]
        row = {"batch": batch, "temperature": temperature, "mode": mode_name(k), "tok_s": statistics.median(tps[k]),
               "speedup": statistics.median(ratios), "speedup_runs": ratios,
               "tau": statistics.median(taus[k]) if k != 0 else 1.0, "tok_s_runs": tps[k],
               "round_ms": statistics.median(round_ms[k]),
               "warm_passes": warm_passes[k], "timed_passes_that_compiled": compiled_timed[k]}
        if temperature == 0:
            row["identical"] = sum(a == b for a, b in zip(tokens[k], tokens[0]))
        c = getattr(gens[k], "draft_choice", None)
        if c is not None:
            row.update(chosen_k=c.num_draft_tokens, iterations_per_k=c.rounds_per_k,
                       predicted_speedup=c.predicted_speedup, measured_speedup=c.measured_speedup)
        rows.append(row)
    # Each mode's programs stay loaded until the caches are cleared, and XLA:CPU maps every
    # compiled kernel separately: a matrix of cells in one process would run into the kernel's
    # limit on memory mappings (vm.max_map_count, 65530 by default; mmap then fails mid-run).
    del gens
    jax.clear_caches()
    gc.collect()
    return rows


MIN_MAP_COUNT = 262144


def warn_map_count() -> None:
    """XLA:CPU maps every compiled kernel separately and a cell holds every mode's programs at once:
    with seven modes (auto's K programs among them) one run died mid-matrix at Linux's default
    vm.max_map_count of 65530 (LLVM: "Cannot allocate memory"), with memory to spare."""
    try:
        limit = int(open("/proc/sys/vm/max_map_count").read())
    except (OSError, ValueError):
        return
    if limit < MIN_MAP_COUNT:
        print(f"warning: vm.max_map_count is {limit}; a matrix with many modes can run out of memory mappings "
              f"(raise it: sudo sysctl -w vm.max_map_count={MIN_MAP_COUNT})", file=sys.stderr)


def prompt_sets(pair: DemoPair, names: list[str], n: int | None) -> dict[str, list[list[int]]]:
    sets = {}
    for name in names:
        if name == "demo":
            sets[name] = pair.prompt_ids[:n] if n else pair.prompt_ids
        elif name == "thirdparty":
            sets[name] = [pair.tokenizer.encode(p) for p in thirdparty_prompts(n or len(pair.prompt_ids))]
        elif name == "heldout":
            with open(HELDOUT_PROMPTS, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            sets[name] = [pair.tokenizer.encode(r["prompt"]) for r in rows[:n or len(pair.prompt_ids)]]
        else:
            raise SystemExit(f"--prompts: unknown set {name!r}; use demo, thirdparty and/or heldout")
    return sets


def main(argv=None, extra_modes: dict | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo"))
    ap.add_argument("--prompts", default="demo,thirdparty,heldout", help="prompt sets: demo, thirdparty, heldout")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--temperature", default="0,1")
    ap.add_argument("--k", default=",".join(str(k) for k in range(1, DEFAULT_MAX_DRAFT_TOKENS + 1)))
    ap.add_argument("--num-prompts", type=int, default=None, help="per set; default: every held-out demo prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parallel-draft", default=None,
                    help="a P-EAGLE draft to run beside the chain draft (default DEMO/peagle when it exists; "
                         "'none': skip)")
    ap.add_argument("--parallel-k", default="2,4,6,8", help="the P-EAGLE draft's fixed Ks")
    ap.add_argument("--dflash-draft", default=None,
                    help="a DFlash draft to run beside the chain draft (default DEMO/dflash when it exists; "
                         "'none': skip)")
    ap.add_argument("--dflash-k", default="2,4,7", help="the DFlash draft's fixed Ks (at most its block_size - 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    compile_cache.enable()   # as serve.py: a rerun reads its programs from disk
    warn_map_count()
    pair = DemoPair.load(args.demo_dir, num_prompts=args.num_prompts)
    ks = parse_list(args.k)
    if any(not 1 <= k <= DEFAULT_MAX_DRAFT_TOKENS for k in ks):
        ap.error(f"--k values must be in 1..{DEFAULT_MAX_DRAFT_TOKENS}")
    sets = prompt_sets(pair, [s.strip() for s in args.prompts.split(",") if s.strip()], args.num_prompts)
    print(describe(pair), file=sys.stderr)
    extra_modes = dict(extra_modes or {})
    for label, flag, given, sub, k_list in (
            ("P-EAGLE", "--parallel-draft", args.parallel_draft, "peagle", args.parallel_k),
            ("DFlash", "--dflash-draft", args.dflash_draft, "dflash", args.dflash_k)):
        where = given or os.path.join(args.demo_dir, sub)
        if where != "none" and os.path.isdir(where):
            one_pass = e3.load_draft(where, pair.target)
            print(f"{label} draft {shown_path(where)}: aux layers {list(one_pass.aux_layer_ids)}", file=sys.stderr)
            for k in parse_list(k_list):
                make = one_pass_mode(one_pass, k)
                make.k = k
                extra_modes[f"{label} K={k}"] = make
        elif given not in (None, "none"):
            raise SystemExit(f"{flag}: no draft at {where}")
    rows = []
    with quiet_watchdog():
        for name, prompts in sets.items():
            for temperature in parse_list(args.temperature, float):
                for batch in parse_list(args.batch):
                    for row in measure(pair, prompts, batch, temperature, ks, args.max_new_tokens, args.repeats,
                                       extra_modes):
                        rows.append(dict(row, prompts=name, num_prompts=len(prompts)))
    headers = ["prompts", "B", "T", "mode", "tok/s", "× target-only", "× range", "τ", "round ms", "identical",
               "warm / compiled",
               "auto: K (iterations per K)", "auto: predicted / measured ×"]

    def x(v):
        return f"{v:.2f}" if v is not None and math.isfinite(v) else "-"

    body = []
    for r in rows:
        auto = pm = ""
        if "chosen_k" in r:
            auto = f"{r['chosen_k']} ({', '.join(f'{k}:{n}' for k, n in sorted(r['iterations_per_k'].items()))})"
            pm = f"{x(r['predicted_speedup'])} / {x(r['measured_speedup'])}"
        body.append([r["prompts"], r["batch"], f"{r['temperature']:g}", r["mode"], r["tok_s"], f"{r['speedup']:.3f}",
                     f"{min(r['speedup_runs']):.2f}–{max(r['speedup_runs']):.2f}", f"{r['tau']:.2f}",
                     f"{r['round_ms']:.1f}",
                     f"{r['identical']}/{r['num_prompts']}" if "identical" in r else "-",
                     f"{r['warm_passes']} / {r['timed_passes_that_compiled']}", auto, pm])
    print(f"{machine()}, load average {load_average()}, {', '.join(f'{n}: {len(p)} prompts' for n, p in sets.items())}, "
          f"{args.max_new_tokens} new tokens, median of {args.repeats} interleaved passes")
    print(table(headers, body))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                       "args": vars(args), "rows": rows}, f, indent=1, default=str)
    bad = [r for r in rows if r.get("identical", r["num_prompts"]) != r["num_prompts"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
