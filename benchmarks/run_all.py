"""``make bench``: runs the benchmarks that matter, writes one JSON per benchmark, then RESULTS.md.

Each benchmark runs as its own process (``.venv/bin/python benchmarks/X.py ...``), one after
another, so none shares memory, compiled programs or a device with another. What it prints is kept:
its ``#`` lines (the setup: model, sizes, load average) and its markdown tables, read back into
``{"title", "headers", "rows"}``; a script that writes its own JSON (``--json``) has that object
under ``"data"`` too. Every result records the command, the machine, the commit and the date.
RESULTS.md is then generated from every JSON in the results folder: current tables only (the
history is in git). A benchmark that fails is recorded as failed, the rest still run, and the
exit status is 1.

    .venv/bin/python benchmarks/run_all.py                     # everything, a few hours on 2 CPU cores
    .venv/bin/python benchmarks/run_all.py --only moe_dispatch,convert
    .venv/bin/python benchmarks/run_all.py --quick             # tiny sizes: checks the pipeline, not speed
    .venv/bin/python benchmarks/run_all.py --render            # RESULTS.md from the JSON already there
    .venv/bin/python benchmarks/run_all.py --list

``--quick`` writes to a temporary folder unless --out / --results-md say otherwise, so a smoke
run never replaces measured results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import REPO, cpu_model, read_tables, table

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
TAIL_CHARS = 4000
QUICK_TIMEOUT_S = 1800
README = REPO / "README.md"
README_START, README_END = "<!-- results", "<!-- /results -->"   # the README's generated table
ONE_PASS_LABELS = ("P-EAGLE", "DFlash")   # speedup.py's one-pass draft modes ("P-EAGLE K=4", ...)


@dataclasses.dataclass(frozen=True)
class Bench:
    name: str
    script: str                 # path relative to the repository root
    purpose: str                # one line: what the tables answer
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    writes_json: bool = False   # the script takes --json PATH
    timeout_s: int = 4 * 3600


BENCHES = (
    Bench("speedup", "benchmarks/speedup.py",
          "EAGLE-3 vs target-only decode tok/s on the demo pair: batch 1/8/32, T = 0/1, fixed K and auto",
          args=(), quick_args=("--batch", "1", "--temperature", "0", "--k", "2", "--num-prompts", "1",
                               "--max-new-tokens", "8", "--repeats", "1", "--parallel-k", "2"), writes_json=True),
    Bench("speedup_versus", "benchmarks/versus.py",
          "the speedup matrix (target-only, K = 2 and 4, auto) of this checkout beside commit 163ab83's, on which "
          "the [core] and [auto] issues were filed: demo, third-party and held-out prompts, batch 1/8, T = 0/1",
          quick_args=("--prompts", "heldout", "--batch", "1", "--temperature", "0", "--k", "2", "--num-prompts", "1",
                      "--max-new-tokens", "4", "--repeats", "1"), writes_json=True),
    Bench("serve_paired", "benchmarks/serve_paired.py",
          "serve.py's default K against target-only and fixed Ks, whole jobs in paired passes, held-out prompts",
          args=("--k", "1,2", "--repeats", "2"),
          quick_args=("--batch", "1", "--k", "1", "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1"),
          writes_json=True),
    Bench("refill", "benchmarks/refill.py",
          "refill batching (the serve engine) vs static batches on mixed output lengths",
          quick_args=("--prompts", "4", "--batch", "2", "--max-new-tokens", "8", "--rounds-per-sync", "4",
                      "--repeats", "1")),
    Bench("admissions", "benchmarks/admissions.py",
          "the serve engine's admission shapes (calls of the whole batch or the refill size, prompts padded to a "
          "compiled block) against the rules before: programs compiled, first-pass compile seconds and tok/s, "
          "refill.py's workload",
          quick_args=("--prompts", "4", "--batch", "2", "--max-new-tokens", "8", "--repeats", "1")),
    Bench("target_decode", "benchmarks/target_decode.py",
          "greedy target-only decode: ours vs transformers' generate(), same weights, token agreement",
          quick_args=("--new-tokens", "4", "--prompt-len", "8", "--batches", "1", "--repeats", "1",
                      "--hf-threads", "1")),
    Bench("moe_dispatch", "benchmarks/moe_dispatch.py",
          "routed-expert kernels (blocked, ragged_dot, dense reference) vs number of experts",
          quick_args=("--experts", "8", "--rows", "8", "--topk", "2", "--hidden", "64", "--ffn", "32",
                      "--repeats", "1")),
    Bench("quant_decode", "benchmarks/quant_decode.py",
          "decode with INT4 routed experts held packed vs their exact bfloat16 twin",
          quick_args=("--batches", "1", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1")),
    Bench("convert", "benchmarks/convert.py",
          "checkpoint conversion (to-jax, to-hf) throughput and peak memory against a raw read",
          quick_args=("--experts", "8", "--hidden", "128", "--moe-intermediate", "64", "--layers", "2",
                      "--vocab", "512", "--part-sizes", "1MB", "--max-shard-size", "2MB")),
    Bench("round_costs", "benchmarks/round_costs.py",
          "decode rounds (K = 0, 1, 2, 4) measured beside the roofline the TPU planner prices them with "
          "(compiler costs, this CPU's measured bandwidth and flops): the demo pair at batch 1 and 8",
          args=("--pair", "demo", "--batches", "1,8", "--ks", "0,1,2,4", "--context", "160", "--headroom", "96"),
          quick_args=("--tiny",), writes_json=True, timeout_s=3600),
    Bench("draft_share", "benchmarks/round_costs.py",
          "the draft's share of a K = 4 round for each demo draft (EAGLE-3 chain, P-EAGLE, DFlash), batch 1 and 8: "
          "the round and the draft's part alone (propose + catch-up), timed alternately",
          args=("--pair", "demo", "--draft", "draft,peagle,dflash", "--batches", "1,8", "--ks", "4", "--context", "160",
                "--headroom", "96", "--rounds", "10", "--repeats", "5"),
          quick_args=("--tiny",), writes_json=True, timeout_s=3600),
    Bench("layer_scan", "benchmarks/layer_scan.py",
          "the demo target's MoE layers unrolled (the model today) vs one lax.scan over stacked weights: compile "
          "seconds and call ms of one target call, unoptimized (the test suite) and optimized",
          quick_args=("--shapes", "1x1", "--repeats", "2")),
    Bench("attention_capacity", "benchmarks/attention_capacity.py",
          "verify-round cost vs cache capacity at a fixed filled length (demo pair, batch 8)",
          quick_args=("--capacities", "128,256", "--ks", "0,1", "--batch", "2", "--rounds", "2", "--repeats", "1"),
          writes_json=True),
)


def available(benches=BENCHES) -> list[Bench]:
    """The benchmarks whose script is in this checkout."""
    return [b for b in benches if (REPO / b.script).is_file()]


# ---------------------------------------------------------------------- where and when
def machine_info(python: str = sys.executable) -> dict:
    """CPU, cores, and what jax sees, asked of a child process: importing jax here would hold the
    accelerator (and, on a GPU, most of its memory) for as long as the benchmarks run."""
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": sys.platform}
    probe = ("import json, jax; d = jax.devices(); print(json.dumps({'jax': jax.__version__, "
             "'backend': jax.default_backend(), 'devices': len(d), 'device_kind': d[0].device_kind}))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError):
        info["jax"] = "unavailable"
    return info


def describe_machine(m: dict) -> str:
    devices = f"{m.get('devices', '?')} × {m.get('device_kind', '?')}" if "device_kind" in m else "jax unavailable"
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores; jax {m.get('jax', '?')} on {m.get('backend', '?')} ({devices})"


def commit_info() -> str:
    def git(*a):
        r = subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + (" + uncommitted changes" if dirty else "")


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------- running one
def run_teed(cmd: list[str], env: dict, timeout_s: float, echo: bool) -> tuple[int | str, str, str]:
    """Runs ``cmd``; returns (exit status or "timeout", stdout, stderr). With ``echo`` both streams
    are also copied to ours as they come: a benchmark can run for an hour, and its progress lines
    are how one knows it is alive."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    kept = {"out": [], "err": []}

    def pump(stream, key, sink):
        for line in stream:
            kept[key].append(line)
            if echo:
                sink.write(line)
                sink.flush()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, "out", sys.stdout), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, "err", sys.stderr), daemon=True)]
    for t in pumps:
        t.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    for t in pumps:
        t.join()
    return rc, "".join(kept["out"]), "".join(kept["err"])


def run_one(bench: Bench, quick: bool, out_dir: Path, machine: dict, commit: str,
            python: str = sys.executable, echo: bool = True) -> dict:
    """Runs one benchmark, writes ``out_dir/<name>.json`` and returns what it wrote."""
    args = list(bench.quick_args if quick else bench.args)
    shown = " ".join(shlex.quote(a) for a in [".venv/bin/python", bench.script, *args])
    data_path = None
    if bench.writes_json:
        fd, data_path = tempfile.mkstemp(prefix=f"{bench.name}-", suffix=".json")
        os.close(fd)
        args += ["--json", data_path]
        shown += " --json OUT.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started, t0 = now_utc(), time.perf_counter()
    print(f"== {bench.name}: {shown}", flush=True)
    rc, stdout, stderr = run_teed([python, str(REPO / bench.script), *args], env,
                                  min(bench.timeout_s, QUICK_TIMEOUT_S) if quick else bench.timeout_s, echo)
    seconds = time.perf_counter() - t0
    result = {
        "name": bench.name, "purpose": bench.purpose, "command": shown, "quick": quick,
        "machine": machine, "commit": commit, "date": started, "seconds": round(seconds, 1),
        "returncode": rc,
        "context": [l[1:].strip() for l in stdout.splitlines() if l.startswith("#")],
        "tables": read_tables(stdout),
    }
    if data_path:
        try:
            result["data"] = json.loads(Path(data_path).read_text())
        except (OSError, ValueError):
            pass
        Path(data_path).unlink(missing_ok=True)
    if rc != 0:
        result["stderr_tail"] = stderr[-TAIL_CHARS:]
        result["stdout_tail"] = stdout[-TAIL_CHARS:]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{bench.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    status = "ok" if rc == 0 else f"FAILED ({rc})"
    print(f"   {status} in {seconds:.0f} s, {len(result['tables'])} table(s)", flush=True)
    return result


# ---------------------------------------------------------------------- RESULTS.md
def render(out_dir: Path, order=BENCHES) -> str:
    """RESULTS.md from every ``*.json`` in ``out_dir`` (benchmarks in BENCHES order, then others)."""
    results = []
    for p in sorted(out_dir.glob("*.json")):
        try:
            r = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(r, dict) and "name" in r and "tables" in r:
            results.append(r)
    rank = {b.name: i for i, b in enumerate(order)}
    results.sort(key=lambda r: (rank.get(r["name"], len(rank)), r["name"]))
    lines = ["# Benchmark results", "",
             "Generated by `make bench` (`benchmarks/run_all.py`) from `benchmarks/results/*.json`; do not edit by",
             "hand, rerun. Each section says the command, machine, commit and date it was measured with. Times on",
             "a shared machine are noisy: the scripts interleave the variants they compare and report medians.", ""]
    if not results:
        lines.append("No results yet: run `make bench`.")
    for r in results:
        lines += [f"## {r['name']}", "", r.get("purpose", ""), ""]
        quick = " (**--quick**: tiny sizes, a pipeline check, not a measurement)" if r.get("quick") else ""
        lines += [f"- command: `{r['command']}`{quick}",
                  f"- machine: {describe_machine(r.get('machine', {}))}",
                  f"- commit: {r.get('commit', '?')}; date: {r.get('date', '?')}; wall time {r.get('seconds', 0):.0f} s"]
        if r.get("returncode") != 0:
            lines += [f"- **failed** (exit status {r.get('returncode')}); last lines of its output:", "", "```",
                      (r.get("stderr_tail") or r.get("stdout_tail") or "").strip()[-1500:], "```"]
        lines.append("")
        if r.get("context"):
            lines += ["```"] + r["context"] + ["```", ""]
        for t in r["tables"]:
            if t.get("title"):
                lines += [t["title"], ""]
            lines += [table(t["headers"], t["rows"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def speedup_summary(out_dir: Path) -> str | None:
    """The README's results table from ``speedup.json`` (the script's own rows): per prompt set,
    batch and temperature, target-only tok/s, the best fixed K and auto against target-only (and the
    best fixed K of each one-pass draft, P-EAGLE and DFlash, that ran beside)."""
    path = out_dir / "speedup.json"
    try:
        r = json.loads(path.read_text())
        rows = r["data"]["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    groups: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("prompts", "demo"), row["batch"], row["temperature"])
        groups.setdefault(key, {})[str(row["mode"])] = row
    body = []
    for (prompts, batch, temperature), modes in groups.items():
        base = modes.get("target-only")
        auto = modes.get("auto") or modes.get("K=auto")
        fixed = [m for name, m in modes.items() if name.startswith("K=") and m is not auto]
        if base is None:
            continue
        best = max(fixed, key=lambda m: m["speedup"], default=None)
        one_pass = [max((m for name, m in modes.items() if name.startswith(label + " ")),
                        key=lambda m: m["speedup"], default=None) for label in ONE_PASS_LABELS]
        greedy = [m for m in modes.values() if "identical" in m and m is not base]
        same = "-"   # sampled rows: tokens differ by design
        if greedy:
            worst = min(m["identical"] for m in greedy)
            same = f"{worst}/{base['num_prompts']}" if "num_prompts" in base else str(worst)
        body.append([prompts, batch, f"{temperature:g}", round(base["tok_s"], 1),
                     f"{best['mode']}: {best['speedup']:.2f}×" if best else "-",
                     f"{auto['speedup']:.2f}×" if auto else "-",
                     auto.get("chosen_k", "-") if auto else "-",
                     *(f"{m['mode'].split(' ', 1)[1]}: {m['speedup']:.2f}×" if m else "-" for m in one_pass),
                     same])
    if not body:
        return None
    headers = ["prompts", "batch", "T", "target-only tok/s", "best fixed K", "auto", "auto's last K",
               *(f"{label}, best fixed K" for label in ONE_PASS_LABELS), "greedy identical"]
    first = headers.index(f"{ONE_PASS_LABELS[0]}, best fixed K")
    for i in reversed(range(first, first + len(ONE_PASS_LABELS))):   # a column for each one-pass draft that ran
        if all(row[i] == "-" for row in body):
            headers.pop(i)
            body = [row[:i] + row[i + 1:] for row in body]
    m = r.get("machine", {})
    return (table(headers, body)
            + f"\n\n{describe_machine(m)}; commit {r.get('commit', '?')}; {r.get('date', '?')}; "
            f"`{r.get('command', '')}`")


def update_readme(readme: Path, summary: str) -> bool:
    """Puts ``summary`` between README.md's results markers; False when they are missing."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return False
    head = text[:text.index("\n", start) + 1]   # keep the start marker's own line
    readme.write_text(head + summary + "\n" + text[end:], encoding="utf-8")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check of every script and of this pipeline")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (see --list)")
    ap.add_argument("--out", default=None, help=f"JSON folder (default {RESULTS_DIR.relative_to(REPO)}; --quick: a temp dir)")
    ap.add_argument("--results-md", default=None, help=f"(default {RESULTS_MD.relative_to(REPO)}; --quick: in --out)")
    ap.add_argument("--script-args", default="",
                    help="flags appended to each selected script's own (later flags win), e.g. with --only speedup: "
                         "'--temperature 0 --k 2,4'")
    ap.add_argument("--render", action="store_true", help="only regenerate RESULTS.md from the JSON in --out")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)

    benches = available()
    if args.list:
        for b in BENCHES:
            where = "" if b in benches else "  (script not in this checkout)"
            print(f"{b.name:20s} {b.script:34s} {b.purpose}{where}")
        return 0
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {b.name for b in BENCHES})
        if unknown:
            ap.error(f"unknown benchmark(s) {unknown}; choose from {[b.name for b in BENCHES]}")
        benches = [b for b in benches if b.name in wanted]
    if args.quick and args.out is None:
        out_dir = Path(tempfile.mkdtemp(prefix="eagle3-bench-quick-"))
    else:
        out_dir = Path(args.out) if args.out else RESULTS_DIR
    md_path = Path(args.results_md) if args.results_md else (out_dir / "RESULTS.md" if args.quick else RESULTS_MD)

    failed = []
    if not args.render:
        machine, commit = machine_info(), commit_info()
        print(f"# {describe_machine(machine)}; commit {commit}; results -> {out_dir}", flush=True)
        extra = tuple(shlex.split(args.script_args))
        for b in benches:
            if extra:
                b = dataclasses.replace(b, args=b.args + extra, quick_args=b.quick_args + extra)
            r = run_one(b, args.quick, out_dir, machine, commit)
            if r["returncode"] != 0:
                failed.append(b.name)
    summary = speedup_summary(out_dir)
    text = render(out_dir)
    if summary:
        text = text.replace("\n## ", "\n## Summary: EAGLE-3 vs target-only\n\n" + summary + "\n\n## ", 1)
    md_path.write_text(text)
    print(f"# wrote {md_path}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if summary and not args.quick and out_dir == RESULTS_DIR and update_readme(README, summary):
        print(f"# updated the results table in {README}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
