"""Roofline time of a compiled program on a chip, and what the compiled HLO says beyond its cost
analysis: the bytes its collectives move and the cost estimates its Pallas kernels carry.

    time = max(bytes accessed / HBM bandwidth, flops / peak flops) + collective bytes / ICI bandwidth

per chip, from the compiler's per-device figures. A roofline is a lower bound on time: it assumes
every byte and every flop runs at the chip's peak and nothing else waits. It is an estimate, never
a measurement; ``benchmarks/round_costs.py`` puts it beside measured times where something runs.

Routed experts are priced here by a routing model, not by the compiler: a static program reserves
room for the worst case (every expert block full), so its kernel's estimate is not what a round
reads. ``experts_touched`` gives the expected experts a chip reads and the rows it computes for
``tokens`` tokens, under uniform routing or a skewed one (``Routing``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

# Chip figures from the vendors' public pages (per chip; bytes and flops per second).
#   TPU v5p: cloud.google.com/tpu/docs/v5p, "Key specifications": 459 TFLOPs bf16 peak, HBM2e
#     2765 GBps, inter-chip interconnect 4800 Gbps (1200 GBps bidirectional, i.e. 600 GB/s each way).
#   H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense bf16
#     (1979 with sparsity), NVLink 900 GB/s (unused on one GPU).
#   H200 SXM: NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS dense bf16, NVLink 900 GB/s.
@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    ici_bytes_per_s: float | None
    source: str

    def to_json(self) -> dict:
        return asdict(self)


CHIPS = {
    "v5p": Chip("TPU v5p", 2765e9, 459e12, 600e9, "cloud.google.com/tpu/docs/v5p (key specifications)"),
    "h100": Chip("NVIDIA H100 SXM", 3.35e12, 989e12, 450e9, "NVIDIA H100 datasheet (dense bf16, no sparsity)"),
    "h200": Chip("NVIDIA H200 SXM", 4.8e12, 989e12, 450e9, "NVIDIA H200 datasheet (dense bf16, no sparsity)"),
}


def chip_for(device_kind: str) -> Chip | None:
    """The table's chip for a device kind as JAX names it ('TPU v5p', 'NVIDIA H100 80GB HBM3', ...)."""
    kind = device_kind.lower()
    for key, chip in CHIPS.items():
        if key in kind.replace(" ", ""):
            return chip
    return None


def roofline_seconds(bytes_accessed: float, flops: float, collective_bytes: float, chip: Chip) -> float:
    memory = bytes_accessed / chip.hbm_bytes_per_s
    compute = flops / chip.flops_per_s
    link = collective_bytes / chip.ici_bytes_per_s if collective_bytes and chip.ici_bytes_per_s else 0.0
    return max(memory, compute) + link


def bound(bytes_accessed: float, flops: float, chip: Chip) -> str:
    return "memory" if bytes_accessed / chip.hbm_bytes_per_s >= flops / chip.flops_per_s else "compute"


# ---------------------------------------------------------------------- the HLO
@dataclass(frozen=True)
class HloCosts:
    """Per device: bytes sent by collectives (ring algorithms: an all-reduce of S bytes over n
    devices sends 2 (n-1)/n S, an all-gather or all-to-all (n-1)/n of its result, a reduce-scatter
    (n-1) times its result, a permute its result), how many collectives; the summed cost
    estimates of the expert kernels (Pallas calls named *gmm*: what the cost analysis counted for
    them), how many; how many while loops the program has (each counted once); and the bytes of
    the program's copies (``copy``, ``copy-start``: layout changes the compiler inserted, e.g. of
    a whole cache between the scatter that updates it and the loop that reads it)."""

    collective_bytes: float = 0.0
    collectives: int = 0
    kernel_flops: float = 0.0
    kernel_bytes: float = 0.0
    kernels: int = 0
    while_loops: int = 0
    copy_bytes: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def scaled(self, a: "HloCosts", b: "HloCosts", t: float) -> "HloCosts":
        """a + t (b - a), field by field (per-layer extrapolation and interpolation)."""
        return HloCosts(**{k: getattr(a, k) + t * (getattr(b, k) - getattr(a, k)) for k in asdict(self)})


_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\(")
_COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_COST = re.compile(r'cost_estimate\\?"\s*:\s*\{([^}]*)\}')


def array_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO result type (``bf16[8,128]{1,0}`` or a tuple of them)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else None)
        if bits is None:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * bits // 8)
    return out


def _group_size(line: str) -> int:
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(line)
    return len(m.group(1).split(",")) if m and m.group(1) else 1


def _sent(op: str, size: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n * size
    if op in ("all-gather", "all-to-all"):
        return (n - 1) / n * size
    if op == "reduce-scatter":
        return float((n - 1) * size)
    return float(size)   # collective-permute


def hlo_costs(text: str) -> HloCosts:
    """Reads a compiled module's text (``compiled.as_text()``)."""
    coll_bytes = k_flops = k_bytes = copies = 0.0
    colls = kernels = loops = 0
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, op = m.groups()
        base = op.removesuffix("-start")
        if base in _COLLECTIVE and not op.endswith("-done"):
            sizes = array_bytes(result)
            if sizes:
                # an async start's result is a tuple of its operands and outputs: the largest is what moves
                coll_bytes += _sent(base, max(sizes), _group_size(line))
                colls += 1
        elif op == "while":
            loops += 1
        elif op in ("copy", "copy-start"):
            sizes = array_bytes(result)
            copies += max(sizes) if sizes else 0
        elif op == "custom-call" and "gmm" in name:
            kernels += 1
            c = _COST.search(line)
            if c:
                fields = json.loads("{" + c.group(1).replace('\\"', '"') + "}")
                k_flops += float(fields.get("flops", 0))
                k_bytes += float(fields.get("bytes_accessed", 0))
            else:   # no estimate carried: the cost analysis counts operands and result, no flops
                k_bytes += sum(array_bytes(result)) + sum(array_bytes(line[line.index("custom-call("):]))
    return HloCosts(coll_bytes, colls, k_flops, k_bytes, kernels, loops, copies)


# ---------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """How tokens pick experts. ``uniform``: each token's top-k is k distinct experts, every expert
    equally likely. ``zipf``: expert popularity falls as rank^-s (s = ``skew``), the probability
    that a token picks the expert of rank r is min(1, c r^-s) with c set so a token picks k in
    all; ranks are dealt round-robin over the chips (what a placement balancer aims at), and the
    busiest chip (the one holding rank 1) sets the time. Tokens pick independently in both: the
    experts a row's consecutive tokens share would lower the count further."""

    name: str = "uniform"
    skew: float = 0.0

    def pick_probabilities(self, n_experts: int, top_k: int) -> list[float]:
        if self.skew <= 0:
            return [top_k / n_experts] * n_experts
        w = [(r + 1) ** -self.skew for r in range(n_experts)]
        lo, hi = 0.0, float(n_experts) * top_k / min(w)
        for _ in range(100):   # bisection on c: sum(min(1, c w)) = top_k
            c = (lo + hi) / 2
            lo, hi = (c, hi) if sum(min(1.0, c * x) for x in w) < top_k else (lo, c)
        return [min(1.0, hi * x) for x in w]


UNIFORM = Routing()
ZIPF = Routing("zipf s=1", 1.0)


def experts_touched(tokens: float, n_experts: int, top_k: int, groups: int, routing: Routing = UNIFORM
                    ) -> tuple[float, float]:
    """(expected experts the busiest of ``groups`` expert groups reads, expected token-expert rows
    it computes) when ``tokens`` tokens are routed."""
    p = routing.pick_probabilities(n_experts, top_k)
    mine = p[0::groups]   # the group holding rank 1 (uniform: every group alike)
    return sum(1.0 - (1.0 - q) ** tokens for q in mine), tokens * sum(mine)
