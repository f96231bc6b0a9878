"""Predicted EAGLE-3 speedup per batch size and K, from roofline round times (``--speedup``).

    python -m tools.plan --model configs/models/kimi_k25.json --platform tpu --topology v5p:2x2x4 \\
        --mesh data=1,expert=16,tensor=1 --speedup --json kimi_k.json

For each batch size and K = 0..6 a round's time is the roofline of its per-chip costs
(``roofline.py``): the compiler's costs of one round compiled on its own (``rounds.py``), cut to
one and two MoE layers and extrapolated per layer, the loop trips it does not count added
(``uncounted.py``), and routed experts priced by a routing model (uniform, and Zipf-skewed). Then

    speedup(K) = tau(K) * t(target-only step) / t(round of K)

at a stated acceptance: tau(K) = 1 + a_1 + ... + a_K with a_i the rate at which draft position i
is accepted. Sources: the demo pair's measured per-position rates (demo/README.md), and the
published Kimi-K2.5 EAGLE-3 draft (tau 2.69 on MT-Bench, 3.34 on MATH500 at 3 draft tokens), for
which the rate is taken constant over positions (a_i = a^i, a solved from tau(3)). Everything here
is a roofline *estimate* from a compiler, never a measurement.

The per-batch K table (``k_by_batch`` in the JSON, schema in docs/plan.md) is what a K chooser
can read.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

from tools.plan import rounds
from tools.plan.roofline import CHIPS, UNIFORM, ZIPF, Chip, Routing

SCHEMA = "eagle3_jax.k_table/1"
# The seed's regeneration (DESIGN.md section 9): ~83k prompts, ~2k new tokens each.
REGEN_PROMPTS, REGEN_TOKENS = 83_000, 2_000
REGEN_BATCHES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Acceptance:
    name: str
    source: str
    rates: tuple[float, ...]     # per draft position

    def tau(self, k: int) -> float:
        return 1.0 + sum(self.rates[:k])


def geometric(name: str, source: str, tau3: float, positions: int = 6) -> Acceptance:
    """Per-position rates a^i with 1 + a + a^2 + a^3 = tau3."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if 1 + a + a * a + a ** 3 < tau3 else (lo, a)
    return Acceptance(name, source + f" (a = {lo:.3f} per position, held constant)",
                      tuple(lo ** i for i in range(1, positions + 1)))


def acceptances() -> list[Acceptance]:
    from tools.plan.serve import DEMO_ACCEPTANCE

    return [
        geometric("kimi-k25 mt-bench", "published Kimi-K2.5 EAGLE-3, tau 2.69 at 3 draft tokens", 2.69),
        geometric("kimi-k25 math500", "published Kimi-K2.5 EAGLE-3, tau 3.34 at 3 draft tokens", 3.34),
        Acceptance("demo pair", "demo/README.md: the demo draft's measured greedy rates by position",
                   tuple(DEMO_ACCEPTANCE)),
    ]


def chip_of(platform: str, topology: str | None) -> Chip:
    if platform == "tpu" and topology:
        gen = topology.split(":")[0]
        if gen in CHIPS:
            return CHIPS[gen]
    raise SystemExit(f"--speedup: no chip figures for {platform} {topology or ''}; known: "
                     f"{', '.join(k for k in CHIPS if k.startswith('v'))} (TPU)")


# ---------------------------------------------------------------------- pricing
def price(full: dict, grid: rounds.GridSettings, chip: Chip, routing: Routing, data: int) -> dict:
    """{(batch, K): cell} at full depth: per-chip bytes, flops, collective bytes, roofline seconds.
    Cells not compiled are interpolated (or, past the compiled batches, extrapolated) linearly."""
    out = {}
    cells = [(b, k) for b in grid.batches for k in grid.ks] + [(b, 0) for b in grid.step_batches]
    for b, k in cells:
        c = full["cells"].get((b, k)) or rounds.interpolate(full["cells"], b, k)
        c = _extrapolate(full["cells"], c, b, k)
        cell = rounds.priced_cell(c, full["experts"], full["moe_layers"], b / data * (k + 1), routing, chip)
        out[b, k] = dict(cell, batch=b, k=k, compiled=(b, k) in full["cells"])
    return out


def _extrapolate(cells: dict, c: rounds.Counted, b: int, k: int) -> rounds.Counted:
    """Target-only steps past the largest compiled batch continue the last segment's slope (the
    counted costs are affine in the batch; experts are priced by the routing model at any batch)."""
    bs = sorted(bb for (bb, kk) in cells if kk == 0)
    if k != 0 or len(bs) < 2 or b <= bs[-1]:
        return c
    return cells[bs[-2], 0].lerp(cells[bs[-1], 0], (b - bs[-2]) / (bs[-1] - bs[-2]))


def speedups(priced: dict, grid: rounds.GridSettings, acc: Acceptance) -> dict:
    """{batch: {"speedup": [per K], "best_k": K, "best": speedup}}."""
    out = {}
    for b in grid.batches:
        t0 = priced[b, 0]["seconds"]
        s = [acc.tau(k) * t0 / priced[b, k]["seconds"] for k in grid.ks]
        best = max(range(len(s)), key=lambda i: s[i])
        out[b] = {"speedup": s, "best_k": grid.ks[best], "best": s[best]}
    return out


def regeneration(priced: dict, data: int) -> list[dict]:
    """Target-only decode throughput per slice and the seed's regeneration time (decode only)."""
    rows = []
    for b in REGEN_BATCHES:
        if (b, 0) not in priced:
            continue
        t = priced[b, 0]["seconds"]
        tok_s = b / t
        rows.append({"batch": b, "step_ms": t * 1e3, "tokens_per_s": tok_s,
                     "regen_hours": REGEN_PROMPTS * REGEN_TOKENS / tok_s / 3600})
    return rows


# ---------------------------------------------------------------------- output
def report(model: str, settings, grid, full, chip, data, hbm: int | None) -> tuple[list[str], dict]:
    """The printed tables and the JSON object (``SCHEMA``)."""
    accs = acceptances()
    routings = [UNIFORM, ZIPF]
    lines = [f"# speedup: {model}, {settings.topology} ({chip.name}), mesh {settings.mesh}; context "
             f"{grid.context} filled slots of {grid.capacity}; roofline estimate from the TPU compiler, not a measurement",
             f"# chip: HBM {chip.hbm_bytes_per_s / 1e12:.3f} TB/s, {chip.flops_per_s / 1e12:.0f} TFLOP/s bf16, ICI "
             f"{(chip.ici_bytes_per_s or 0) / 1e9:.0f} GB/s ({chip.source})",
             f"# compiled: rounds cut to {full['cuts'][0]} and {full['cuts'][1]} layers at full width, extrapolated "
             f"to {full['layers']} ({full['moe_layers']} MoE); batches {list(grid.compile_batches)} x K "
             f"{list(grid.compile_ks)} compiled, other cells linear in tokens between them"]
    tables = []
    for routing in routings:
        priced = price(full, grid, chip, routing, data)
        head = ["batch"] + [f"K={k} ms" for k in grid.ks] + ["bound K=0/6", "held GB/chip"]
        body = [[str(b)] + [f"{priced[b, k]['seconds'] * 1e3:,.2f}" for k in grid.ks]
                + [f"{priced[b, 0]['bound']}/{priced[b, grid.ks[-1]]['bound']}",
                   f"{priced[b, grid.ks[-1]]['held_bytes'] / 1e9:,.1f}"
                   + ("" if hbm is None or priced[b, grid.ks[-1]]['held_bytes'] <= hbm else " (does not fit)")]
                for b in grid.batches]
        lines += ["", f"## round time (roofline), routing {routing.name}", *_table(head, body)]
        per_acc = []
        for acc in accs:
            sp = speedups(priced, grid, acc)
            head = ["batch"] + [f"K={k}" for k in grid.ks] + ["best K"]
            body = [[str(b)] + [f"{x:.2f}" for x in sp[b]["speedup"]] + [f"{sp[b]['best_k']} ({sp[b]['best']:.2f}x)"]
                    for b in grid.batches]
            lines += ["", f"## predicted speedup, routing {routing.name}, acceptance {acc.name}: tau(1..6) = "
                      + ", ".join(f"{acc.tau(k):.2f}" for k in range(1, 7)) + f" [{acc.source}]", *_table(head, body)]
            per_acc.append({"acceptance": acc.name, "source": acc.source,
                            "tau": [acc.tau(k) for k in grid.ks],
                            "best": {str(b): {"k": sp[b]["best_k"], "speedup": sp[b]["best"]} for b in grid.batches},
                            "speedup": {str(b): sp[b]["speedup"] for b in grid.batches}})
        regen = regeneration(priced, data)
        if routing is UNIFORM:
            lines += ["", f"## target-only decode for regeneration ({REGEN_PROMPTS:,} prompts x ~{REGEN_TOKENS:,} "
                      "new tokens; decode steps only, prefill not included), routing uniform",
                      *_table(["batch", "step ms", "tokens/s per slice", "hours for the seed"],
                              [[str(r["batch"]), f"{r['step_ms']:,.2f}", f"{r['tokens_per_s']:,.0f}",
                                f"{r['regen_hours']:,.1f}"] for r in regen])]
        tables.append({"routing": routing.name,
                       "rounds": [dict(c, bytes=c["bytes"], k=k, batch=b) for (b, k), c in sorted(priced.items())],
                       "acceptances": per_acc, "regeneration": regen})
    default = tables[0]["acceptances"][0]
    obj = {"schema": SCHEMA, "estimate": "roofline from the TPU compiler's per-chip costs; not a measurement",
           "date": datetime.date.today().isoformat(), "model": model, "platform": settings.platform,
           "topology": settings.topology, "mesh": settings.mesh, "chip": chip.to_json(), "context": grid.context,
           "max_len": grid.capacity, "batches": list(grid.batches), "ks": list(grid.ks),
           "compiled": {"cuts": list(full["cuts"]), "layers": full["layers"], "batches": list(grid.compile_batches),
                        "ks": list(grid.compile_ks),
                        "programs": [rc.to_json() for _, rc in sorted(full["compiled"].items())]},
           "default": {"routing": tables[0]["routing"], "acceptance": default["acceptance"]},
           "k_by_batch": {b: v["k"] for b, v in default["best"].items()},
           "tables": tables}
    return lines, obj


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    width = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, width)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 1) + ":" for w in width) + "|"] + [fmt(r) for r in body]


def run(settings, grid: rounds.GridSettings, log, store: str | None = None, check: bool = False
        ) -> tuple[list[str], dict]:
    """Compiles and prices; returns (lines to print, JSON object)."""
    from tools import tpu
    from eagle3_jax.config import MeshConfig

    chip = chip_of(settings.platform, settings.topology)
    data = MeshConfig.parse(settings.mesh).data
    if any(b % data for b in grid.batches):
        raise SystemExit(f"--speedup batches {list(grid.batches)} must split over data={data}")
    kept = rounds.Store(store)
    full = rounds.full_depth(settings, grid, log, store=kept)
    hbm = tpu.chip_hbm_bytes(settings.topology) if settings.platform == "tpu" else None
    lines, obj = report(settings.model, settings, grid, full, chip, data, hbm)
    if check:
        checks = scaling_checks(settings, grid, full, log, kept)
        obj["checks"] = checks
        lines += ["", "## checks of the extrapolation and interpolation (compiler costs, experts excluded)",
                  *_table(["check", "cell", "predicted GB", "compiled GB", "predicted TFLOP", "compiled TFLOP"],
                          [[c["check"], f"B={c['batch']} K={c['k']}", f"{c['predicted_bytes'] / 1e9:,.2f}",
                            f"{c['compiled_bytes'] / 1e9:,.2f}", f"{c['predicted_flops'] / 1e12:,.3f}",
                            f"{c['compiled_flops'] / 1e12:,.3f}"] for c in checks])]
    return lines, obj


def scaling_checks(settings, grid, full, log, store) -> list[dict]:
    """One deeper compile (the dense layers plus four MoE layers) against the per-layer
    extrapolation from the two cuts, and one cell between compiled batches and Ks (B = 32, K = 3,
    both cuts, extrapolated) against its interpolation."""
    out = []
    L1, L2 = full["cuts"]
    deep = L2 + 2
    b, k = grid.compile_batches[0], grid.compile_ks[-1]
    got = rounds.compile_cut(settings, deep, [(b, k)], grid, log, store)[b, k][1]
    t = (deep - L1) / (L2 - L1)
    c1 = rounds.compile_cut(settings, L1, [(b, k)], grid, log, store)[b, k][1]
    c2 = rounds.compile_cut(settings, L2, [(b, k)], grid, log, store)[b, k][1]
    want = c1.lerp(c2, t)
    out.append({"check": f"{deep} layers from {L1} and {L2}", "batch": b, "k": k, "predicted_bytes": want.bytes,
                "compiled_bytes": got.bytes, "predicted_flops": want.flops, "compiled_flops": got.flops})
    b, k = 32, 3
    if (b, k) not in full["cells"] and grid.compile_batches[0] < b < grid.compile_batches[-1]:
        cuts = [rounds.compile_cut(settings, n, [(b, k)], grid, log, store)[b, k][1] for n in (L1, L2)]
        got = cuts[0].lerp(cuts[1], (full["layers"] - L1) / (L2 - L1))
        want = rounds.interpolate(full["cells"], b, k)
        out.append({"check": "interpolated cell", "batch": b, "k": k, "predicted_bytes": want.bytes,
                    "compiled_bytes": got.bytes, "predicted_flops": want.flops, "compiled_flops": got.flops})
    return out


def grid_from(batches: str, context: int, max_len: int, compile_batches: str | None) -> rounds.GridSettings:
    bs = tuple(int(x) for x in batches.split(",") if x)
    # Every listed batch is compiled unless told otherwise: a round's compiled costs are far from
    # linear in the batch (Kimi-K2.5 on v5p:2x2x4, K = 0: batch 32 interpolated from 1 and 128 came
    # out at 39 ms, compiled 58.5 ms; docs/plan.md, "Predicted speedup on v5p:2x2x4").
    cb = tuple(int(x) for x in compile_batches.split(",")) if compile_batches else bs
    if context + 8 > max_len:
        raise SystemExit(f"--context {context} needs --max-len above {context + 8}, found {max_len}")
    return dataclasses.replace(rounds.GridSettings(), batches=bs, compile_batches=cb, context=context,
                               capacity=max_len, step_batches=tuple(b for b in REGEN_BATCHES if b not in bs))


