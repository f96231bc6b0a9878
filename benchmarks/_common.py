"""Shared helpers for the benchmark scripts: timing, table printing and reading back, the demo
pair's description, the bench target's shape. The one module benchmark scripts import from
each other.

Benchmarks are not tests: they print tables of ratios measured side by side in one run;
``run_all.py`` turns what they print into JSON and RESULTS.md.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def machine() -> str:
    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_list(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def shown_path(path: str) -> str:
    """Relative to the repo when inside it (as a newcomer types it), else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if path.startswith(str(REPO) + os.sep) else path


def describe(pair) -> str:
    """One line on a loaded ``eagle3_jax.serve.demo.DemoPair``: sizes, aux layers, dtype, prompts."""
    import jax

    n_target = sum(x.size for x in jax.tree.leaves(pair.target.state))
    n_draft = sum(x.size for x in jax.tree.leaves(pair.draft.state))
    c = pair.target.config
    return (f"demo pair {shown_path(pair.demo_dir)}: target {n_target / 1e6:.1f}M params ({c.num_hidden_layers} "
            f"layers, {c.n_routed_experts} routed experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}), "
            f"draft {n_draft / 1e6:.1f}M params (aux layers {list(pair.draft.aux_layer_ids)}), "
            f"{pair.settings.dtype}; {len(pair.prompt_ids)} held-out prompts, padded to {pair.prompt_len} tokens")


class quiet_watchdog:
    """Silences the acceptance-collapse watchdog: a weak draft at T=1 is a result here, not an alarm."""

    def __enter__(self):
        from eagle3_jax.metrics import AcceptanceCollapseWarning

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore", AcceptanceCollapseWarning)
        self._log = logging.getLogger("eagle3_jax")
        self._level = self._log.level
        self._log.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        self._log.setLevel(self._level)
        return self._warnings.__exit__(*exc)


def block(x):
    """Waits for every jax array in a pytree (no-op for anything else)."""
    import jax

    for leaf in jax.tree_util.tree_leaves(x):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
    return x


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median seconds per call of fn() after warmup calls; fn's result is blocked on.

    Keeps calling past ``repeats`` until ``min_time`` seconds of samples are collected (fast calls).
    """
    for _ in range(warmup):
        block(fn())
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats or (time.perf_counter() - start) < min_time:
        t0 = time.perf_counter()
        block(fn())
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return statistics.median(samples)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def read_tables(text: str) -> list[dict]:
    """The markdown tables in a script's printed output, as ``{"title", "headers", "rows"}``:
    what ``table`` printed, read back. The title is the nearest non-empty, non-comment line above
    a table ("" if none); cells that read as numbers become numbers."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if not (_is_row(lines[i]) and i + 1 < len(lines) and _is_separator(lines[i + 1])):
            i += 1
            continue
        title = next((l.strip() for l in reversed(lines[:i]) if l.strip() and not l.startswith("#")), "")
        if title and _is_row(title):
            title = ""
        headers = _cells(lines[i])
        rows = []
        i += 2
        while i < len(lines) and _is_row(lines[i]):
            rows.append([_number(c) for c in _cells(lines[i])])
            i += 1
        tables.append({"title": title, "headers": headers, "rows": rows})
    return tables


def _is_row(line: str) -> bool:
    line = line.strip()
    return len(line) > 1 and line.startswith("|") and line.endswith("|")


def _is_separator(line: str) -> bool:
    return _is_row(line) and set(line.strip()) <= set("|-: ")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def _number(cell: str):
    try:
        return int(cell)
    except ValueError:
        pass
    try:
        return float(cell)
    except ValueError:
        return cell


def _fmt(c) -> str:
    if isinstance(c, float):
        if c == 0:
            return "0"
        if abs(c) >= 100:
            return f"{c:.0f}"
        if abs(c) >= 1:
            return f"{c:.2f}"
        if abs(c) >= 1e-3:
            return f"{c:.3f}"
        return f"{c:.1e}"
    return str(c)


# The benchmarks' DeepSeek-V3-shaped target (tools/random_target.py's tiny target at a size whose
# timings mean something on a laptop CPU): MLA with q-LoRA, group-limited sigmoid routing, one dense
# layer then MoE layers with a shared expert, plain RoPE.
BENCH_SHAPE = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
    "max_position_embeddings": 1024, "rope_scaling": None,
}


def bench_target_config(**overrides) -> dict:
    """The bench target's config.json (``overrides`` on top)."""
    from tools.random_target import hf_config_dict

    return hf_config_dict(**{**BENCH_SHAPE, **overrides})
