"""One decode round as its own program, compiled for its costs.

The serving loop (``generate.run_rounds``) is a ``while_loop`` whose body the compiler's cost
analysis counts once, whatever the trip count; a round compiled on its own is what one trip
costs. ``one_round`` is that body: at K >= 1 draft K tokens, verify K + 1, accept, catch up; at
K = 0 one target-only step (no draft weights handed in). Its state is donated, as in serving, so
the caches are updated in place and not copied.

``compile_round`` compiles it on a plan's abstract models (``serve.Setup``) for the platform the
plan names (the TPU compiler for a topology, XLA:CPU for fake devices) and keeps what the
roofline needs from the compiled program: flops and bytes accessed per device, the bytes its
collectives move, and the cost estimates that Pallas kernels carry (``roofline.hlo_costs``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax

from eagle3_jax.sharding import sharding_for
from eagle3_jax.speculative import generate as gen
from eagle3_jax.speculative.static_graph import merge_models
from tools.tpu import compile_stats
from tools.plan import uncounted
from tools.plan.roofline import HloCosts, hlo_costs


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "program"), donate_argnames=("state",))
def one_round(tgraph, tstate, dgraph, dstate, aux_ids_N, state, sp, *, program: gen.DecodeProgram):
    """One trip of the decode loop's body on ``state`` (all rows, running or not)."""
    target, draft = merge_models(tgraph, tstate, dgraph, dstate)
    return gen._round_fn(target, draft, aux_ids_N, sp, program)(state)


@dataclass(frozen=True)
class RoundCost:
    """The compiler's figures for one round program, per device."""

    batch: int
    k: int
    layers: int
    flops: float
    bytes_accessed: float
    hlo: HloCosts
    compile_s: float
    argument_bytes: int = 0
    temp_bytes: int = 0

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["hlo"] = self.hlo.to_json()
        return out


def round_program(static_program: gen.DecodeProgram, k: int) -> gen.DecodeProgram:
    return static_program.with_draft_tokens(k)


def compile_round(models, state, sp, program: gen.DecodeProgram, k: int, layers: int, keep: dict | None = None
                  ) -> RoundCost:
    """Compiles ``one_round`` at ``k`` draft tokens on abstract (or concrete) ``models``
    ((tgraph, tstate), (dgraph, dstate, aux layer ids)) and ``state``; ``program`` is the session's program
    (its ``max_draft_tokens`` fixes the state's layout). ``keep``, a dict, receives the compiled
    program under "compiled" (to run it: called with the traced arguments only)."""
    (tg, ts), (dg, ds, aux) = models
    if k == 0:
        dg = ds = aux = None
    seen = {}
    mem = compile_stats(one_round, (tg, ts, dg, ds, aux, state, sp), dict(program=program.with_draft_tokens(k)),
                        name=f"round_k{k}", inspect=lambda c: seen.update(hlo=hlo_costs(c.as_text()), compiled=c))
    if keep is not None:
        keep["compiled"] = seen["compiled"]
    if not mem.fits:
        raise RuntimeError(f"the round at K={k}, batch {program.batch_size} does not fit: {mem.error}")
    return RoundCost(batch=program.batch_size, k=k, layers=layers, flops=mem.flops or 0.0,
                     bytes_accessed=mem.bytes_accessed or 0.0, hlo=seen["hlo"], compile_s=mem.compile_s,
                     argument_bytes=mem.argument or 0, temp_bytes=mem.temp or 0)


# ---------------------------------------------------------------------- a grid of rounds at full depth
@dataclass(frozen=True)
class Counted:
    """One round's per-device costs without its routed experts: the compiler's figures less its
    expert kernels' estimates, plus the loop trips it does not count (``uncounted.py``)."""

    flops: float
    bytes: float
    collective_bytes: float
    argument_bytes: float

    def lerp(self, other: "Counted", t: float) -> "Counted":
        return Counted(*(a + t * (b - a) for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True)
class GridSettings:
    """Which rounds to compile: ``batches`` x ``ks`` are priced; ``compile_batches`` and
    ``compile_ks`` (subsets that include the ends) are compiled, the rest interpolated linearly in
    tokens (at a fixed K a round's counted costs are affine in the batch, at a fixed batch in K).
    K = 0 is the target-only step; ``step_batches`` are extra batches priced for it only (past the
    compiled batches, extrapolated from the last two)."""

    batches: tuple[int, ...] = (1, 8, 32, 128)
    ks: tuple[int, ...] = tuple(range(7))
    compile_batches: tuple[int, ...] = (1, 32, 128)
    compile_ks: tuple[int, ...] = (0, 1, 6)
    step_batches: tuple[int, ...] = (256,)
    context: int = 2048            # filled slots per row when the round runs
    capacity: int = 4096           # cache slots per row (max_len)
    cuts: tuple[int, int] | None = None   # layers of the two compiled cuts; None: 1 and 2 MoE layers


def _between(points: list[int], x: int) -> tuple[int, int, float]:
    """Neighbours of ``x`` among sorted ``points`` and its position between them (clamped)."""
    lo = max([p for p in points if p <= x], default=points[0])
    hi = min([p for p in points if p >= x], default=points[-1])
    return lo, hi, 0.0 if hi == lo else (x - lo) / (hi - lo)


def interpolate(table: dict[tuple[int, int], Counted], b: int, k: int) -> Counted:
    """A cell from compiled cells: linear in the batch at each compiled K, then in K (K >= 1)."""
    ks = sorted({kk for (_, kk) in table if (kk == 0) == (k == 0)})
    k0, k1, tk = _between(ks, k)

    def at(kk):
        bs = sorted(bb for (bb, x) in table if x == kk)
        b0, b1, tb = _between(bs, b)
        return table[b0, kk].lerp(table[b1, kk], tb)

    return at(k0).lerp(at(k1), tk)


def cut_layers(cfg) -> tuple[int, int]:
    """The two cuts a per-layer extrapolation compiles: the dense layers plus one and two MoE layers."""
    return cfg.first_k_dense_replace + 1, cfg.first_k_dense_replace + 2


@dataclass(frozen=True)
class Pair:
    """What the uncounted costs of a round depend on besides its shape: the target and draft configs,
    the mesh's axis sizes, the compiled dtype, the target's parameter leaves."""

    cfg: object
    dcfg: object
    mesh_shape: dict
    dtype: object
    target_leaves: list

    def experts(self):
        return uncounted.expert_layer(self.cfg, self.target_leaves, self.mesh_shape, uncounted.itemsize(self.dtype))


def counted_cost(rc: RoundCost, pair: Pair, shape: uncounted.Shape) -> Counted:
    """A compiled round's costs with its expert kernels taken out and its uncounted loop trips added."""
    tensor = pair.mesh_shape.get("tensor", 1)
    size = uncounted.itemsize(pair.dtype)
    tb, tf = uncounted.target_attention_extra(pair.cfg, pair.cfg.num_hidden_layers, shape, size, tensor)
    db, df = uncounted.draft_attention_extra(pair.dcfg, shape, size, tensor)
    return Counted(flops=rc.flops - rc.hlo.kernel_flops + tf + df,
                   bytes=rc.bytes_accessed - rc.hlo.kernel_bytes + tb + db,
                   collective_bytes=rc.hlo.collective_bytes, argument_bytes=float(rc.argument_bytes))


class Store:
    """Round costs already compiled, kept in a JSON file by what determines them (model, slice, mesh,
    dtypes, kernel, layers, batch, K, capacity, the state's largest K): a long run that stops keeps
    what it compiled, and a rerun compiles only what is missing. No file: nothing kept."""

    def __init__(self, path: str | None):
        import json
        import os

        self.path = path
        self.rounds = json.load(open(path)) if path and os.path.isfile(path) else {}

    @staticmethod
    def key(s, layers: int, b: int, k: int, grid: GridSettings) -> str:
        return "|".join(map(str, (s.model, s.platform, s.topology, s.mesh, s.dtype, s.weights, s.moe_kernel, s.draft,
                                  layers, b, k, grid.capacity, max(grid.ks))))

    def get(self, key: str) -> RoundCost | None:
        d = self.rounds.get(key)
        return None if d is None else RoundCost(**dict(d, hlo=HloCosts(**d["hlo"])))   # older entries: no copy_bytes

    def put(self, key: str, rc: RoundCost) -> None:
        import json

        self.rounds[key] = rc.to_json()
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.rounds, f, indent=1)
            import os
            os.replace(self.path + ".tmp", self.path)


def compile_cut(settings, layers: int, cells: list[tuple[int, int]], grid: GridSettings, log,
                store: Store | None = None) -> dict:
    """{(batch, K): (RoundCost, Counted)} of the target cut to ``layers`` layers, one program per cell
    (read from ``store`` where it has them); also ``"experts"``: the ExpertLayer of the cut (None
    without routed experts)."""
    from tools.plan import serve
    from tools.plan.common import _leaves

    out = {}
    for b in sorted({b for b, _ in cells}):
        s = dataclasses.replace(settings, batch=b, max_len=grid.capacity, num_draft_tokens=max(grid.ks),
                                prompt_len=1, layers=layers, programs=(), train=False)
        su = serve.setup(s)
        # Rows of attention (and of its uncounted cache trips) per chip, as the sharding table splits them.
        rows = sharding_for(su.mesh, ("attn_batch",), (b,)).shard_shape((b,))[0]
        with jax.set_mesh(su.mesh):
            (tg, ts, taxes), (dg, ds, _) = su.models(su.compiled)
            state = su.loop_state((tg, ts), (dg, ds), su.compiled)
            pair = Pair(su.cfg, su.dcfg, dict(zip(su.mesh.axis_names, su.mesh.devices.shape)), su.compiled,
                        _leaves(ts, taxes, "target."))
            out.setdefault("experts", pair.experts())
            for k in sorted(k for bb, k in cells if bb == b):
                key = Store.key(settings, layers, b, k, grid)
                rc = store.get(key) if store else None
                if rc is None:
                    rc = compile_round(((tg, ts), (dg, ds, su.aux)), state, su.sp, su.static["program"], k, layers)
                    if store:
                        store.put(key, rc)
                shape = uncounted.Shape(rows=rows, k=k, context=grid.context, capacity=grid.capacity)
                out[b, k] = (rc, counted_cost(rc, pair, shape))
                log(f"{layers} layers, batch {b}, K={k}: {rc.bytes_accessed / 1e9:,.2f} GB, "
                    f"{rc.flops / 1e12:,.3f} TFLOP counted, compiled in {rc.compile_s:.0f} s")
    return out


def compiled_cells(grid: GridSettings) -> list[tuple[int, int]]:
    return [(b, k) for b in grid.compile_batches for k in grid.compile_ks]


def full_depth(settings, grid: GridSettings, log, extra_cells=(), store: Store | None = None) -> dict:
    """Compiles the grid's cells at the two cuts and extrapolates per layer to the full target:
    {"cells": {(b, k): Counted at full depth}, "cuts": (L1, L2), "layers": L, "moe_layers": n,
    "experts": ExpertLayer, "compiled": {(L, b, k): RoundCost}}. ``extra_cells`` are compiled too
    (checks of the interpolation)."""
    from tools.plan import serve

    full = serve.target_config(dataclasses.replace(settings, layers=None))
    cuts = grid.cuts or cut_layers(full)
    cells = compiled_cells(grid) + [c for c in extra_cells if c not in compiled_cells(grid)]
    per_cut = [compile_cut(settings, n, cells, grid, log, store) for n in cuts]
    t = (full.num_hidden_layers - cuts[0]) / (cuts[1] - cuts[0])
    return {"cells": {c: per_cut[0][c][1].lerp(per_cut[1][c][1], t) for c in cells},
            "cuts": cuts, "layers": full.num_hidden_layers, "moe_layers": uncounted.moe_layers(full),
            "experts": per_cut[1]["experts"],
            "compiled": {(n, *c): cut[c][0] for n, cut in zip(cuts, per_cut) for c in cells}}


def priced_cell(c: Counted, experts, moe_layers: int, tokens: float, routing, chip) -> dict:
    """One round at full depth: the counted costs plus ``moe_layers`` layers of routed experts for
    ``tokens`` tokens per chip's expert group, and its roofline time on ``chip``."""
    from tools.plan.roofline import bound, roofline_seconds

    eb = ef = touched = 0.0
    if experts is not None:
        eb, ef, touched = experts.cost(tokens, routing)
    byt, flo = c.bytes + moe_layers * eb, c.flops + moe_layers * ef
    return {"bytes": byt, "flops": flo, "collective_bytes": c.collective_bytes,
            "seconds": roofline_seconds(byt, flo, c.collective_bytes, chip), "bound": bound(byt, flo, chip),
            "experts_per_layer": touched, "held_bytes": c.argument_bytes}
