"""The serving memory plan: abstract models on a mesh, compiled serving programs, bytes per device.

The draft training step is planned in ``train.py``, what both share lives in ``common.py``, and
everything is printed by ``report.py``.

What is computed and what is measured:
  * parameter and cache bytes per device are exact: every array's global shape and dtype, and the
    shard each device holds under the NamedSharding that ``sharding.py``'s table gives it;
  * temporaries are measured: the programs are lowered with ``jax.ShapeDtypeStruct`` arguments that
    carry their shardings, compiled, and read from ``compiled.memory_analysis()`` (per device,
    after SPMD partitioning).

Two compilers. ``platform="tpu"`` compiles for a TPU slice (``topology``, e.g. ``v5p:2x2x4``) with
the TPU compiler itself (libtpu, deviceless: no TPU needed): bytes are exact in the planned dtype,
the budget defaults to the chip's HBM as that compiler counts it, and its cost analysis (flops,
bytes accessed, time estimate) comes with each program. ``platform="cpu"`` (GPU-style meshes)
compiles for fake CPU devices, in float32 by default: XLA:CPU computes bfloat16 dots and scatters
through float32 copies of their operands (and hoists the copies of weights out of the loop), so a
bfloat16 program compiled for CPU reports float32 copies no accelerator would allocate. Its
temporaries are an upper estimate for the 2-byte program; half of them is the lower estimate.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax import drafts
from eagle3_jax.checkpoint.quant_native import layout_from_config
from eagle3_jax.config import MeshConfig, TargetConfig, resolve_dtype
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.drafts import DraftConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.kernels.experts import pick as pick_kernel
from eagle3_jax.models.quantized import QuantLayout
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import make_mesh
from eagle3_jax.speculative import generate as gen
from tools import tpu
from tools.plan.common import (Leaf, PlanSettings, ProgramMemory, _abstract_model, _leaf, _leaves, _sds,
                               abstract_state, compile_program, itemsize, parse_bytes, sampling_args)
from tools.plan.train import TrainMemory, plan_train

__all__ = ["Plan", "PlanSettings", "ProgramMemory", "Leaf", "plan", "parse_bytes", "itemsize", "choose_draft"]
DRAFTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafts")
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The draft vocabulary SpecForge-trained drafts use; a derived draft takes it (or the whole vocab if smaller).
DEFAULT_DRAFT_VOCAB = 32000
PROGRAMS = ("decode", "prefill", "generate")
PROGRAM_DOC = {
    "decode": "run_rounds: the steady-state speculative loop (draft K, verify K+1, accept), state donated",
    "prefill": "admit_rows: prefill of [admit_rows, prompt_len] prompts into rows of the running state, state donated",
    "generate": "generate_loop: prefill + rounds in one program (Generator.generate)",
}
# Scale layouts of quantized expert weights: (bits, scale bytes, weights per scale) as the public
# checkpoints store them. Kimi-K2.5: compressed-tensors pack-quantized INT4, one bf16 scale per
# group of 32 inputs. DeepSeek-V3: FP8 e4m3 with one float32 scale per 128x128 block.
QUANT_DEFAULTS = {4: (2, 32), 8: (4, 128 * 128)}
# The shipped demo pair's measured greedy acceptance by draft position (demo/README.md, K = 6, 32
# held-out prompts): tau(K) = 1 + the first K rates. The default acceptance of a TPU speedup estimate.
DEMO_ACCEPTANCE = (0.82, 0.70, 0.58, 0.49, 0.44, 0.37)


def demo_tau(k: int) -> float:
    return 1.0 + sum(DEMO_ACCEPTANCE[:k])

# ---------------------------------------------------------------------- settings and results
@dataclass
class Plan:
    settings: PlanSettings
    target: TargetConfig
    draft: DraftConfig
    draft_source: str
    aux_ids: tuple[int, ...]
    mesh_shape: dict[str, int]
    target_params: list[Leaf]
    draft_params: list[Leaf]
    state: list[Leaf]
    programs: dict[str, ProgramMemory] = field(default_factory=dict)
    train: "TrainMemory | None" = None
    quant: QuantLayout | None = None     # what load_target holds quantized (None: all in the model dtype)
    prefill_chunk: int | None = None     # the chunk the prefill program was compiled with
    hbm: int | None = None               # the budget: given, or a TPU chip's HBM
    rounds: dict[int, ProgramMemory] = field(default_factory=dict)  # TPU: decode compiled per K (cost)
    moe_kernel: str | None = None

    # -------------------------------------------------------------- per-device sums (planned dtype)
    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    def param_bytes(self, expert_bits: int | None = None) -> int:
        return sum(self._leaf_bytes(leaf, expert_bits) for leaf in self.target_params + self.draft_params)

    def routed_expert_bytes(self, expert_bits: int | None = None) -> int:
        return sum(self._leaf_bytes(leaf, expert_bits) for leaf in self.target_params if leaf.routed_expert)

    def _leaf_bytes(self, leaf: Leaf, expert_bits: int | None) -> int:
        if not leaf.routed_expert or expert_bits is None or expert_bits == 8 * leaf.itemsize:
            return leaf.device_bytes
        return quantized_bytes(leaf.numel_device, expert_bits, *self.scale_layout(expert_bits))

    def scale_layout(self, bits: int) -> tuple[int, int]:
        """(bytes per scale, weights per scale) of ``bits``-bit experts, from the model's own
        quantization_config when it describes that width, else the public checkpoints' layout."""
        q = (self.target.hf_config.get("text_config") or self.target.hf_config).get("quantization_config") or {}
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("num_bits") == bits and w.get("group_size"):
                return 2, int(w["group_size"])
        if bits == 8 and q.get("weight_block_size"):
            return 4, int(np.prod(q["weight_block_size"]))
        if bits not in QUANT_DEFAULTS:
            raise ConfigError(f"--expert-bits {bits}: supported widths are 4 and 8 (or the model dtype's 16/32)")
        return QUANT_DEFAULTS[bits]

    def state_bytes(self, which: str | None = None) -> int:
        leaves = self.state
        if which is not None:
            leaves = [leaf for leaf in leaves if leaf.path.startswith(which + ".")]
        return sum(leaf.device_bytes for leaf in leaves)

    def totals(self, program: str, expert_bits: int | None = None) -> tuple[int, int]:
        """(upper, lower) estimate of one program's peak bytes per device."""
        mem = self.programs[program]
        if self.settings.platform == "tpu" and expert_bits is None:
            # the TPU compiler's own per-chip figure: it also counts the padding of arrays to its tiles
            return mem.peak, mem.peak
        ratio = self.temp_ratio
        params = self.param_bytes(expert_bits)
        if program == "generate":  # the loop state is its output, not an input
            resident, extra = params, self.state_bytes()
        else:
            resident, extra = params + self.state_bytes(), max(0, mem.output - mem.alias)
        return resident + extra + mem.temp, resident + extra + int(mem.temp * ratio)

    @property
    def temp_ratio(self) -> float:
        """Planned dtype size / compile dtype size: the lower estimate of temporaries scales by it."""
        planned = jnp.dtype(resolve_dtype(self.settings.dtype)).itemsize
        compiled = jnp.dtype(resolve_dtype(compile_dtype(self.settings))).itemsize
        return min(1.0, planned / compiled)

    def tau(self, k: int) -> float:
        """Acceptance length assumed at K: the user's (for the plan's K), else the demo's measured."""
        return self.settings.tau if self.settings.tau and k == self.settings.num_draft_tokens else demo_tau(k)

    def predicted_speedup(self, k: int, tau: float) -> float | None:
        """tau * t(target-only round) / t(round of K drafts), from the TPU compiler's time estimates."""
        t0, tk = self.rounds.get(0), self.rounds.get(k)
        if not t0 or not tk or not t0.estimated_seconds or not tk.estimated_seconds:
            return None
        return tau * t0.estimated_seconds / tk.estimated_seconds


def compile_dtype(s: PlanSettings) -> str:
    """The TPU compiler computes bf16 as bf16: it compiles the planned dtype, exactly."""
    return s.dtype if s.platform == "tpu" else s.compile_dtype


def quantized_bytes(numel: int, bits: int, scale_bytes: int, per_scale: int) -> int:
    return -(-numel * bits // 8) + -(-numel // per_scale) * scale_bytes


def choose_draft(target: TargetConfig, path: str | None = None) -> tuple[DraftConfig, str]:
    """The draft to plan for: the given config.json, a published shape for this target, or one
    derived from the target's own widths."""
    if path:
        return drafts.read_config(path), path
    for name in sorted(os.listdir(DRAFTS_DIR)):
        if not name.endswith(".json"):
            continue
        p = os.path.join(DRAFTS_DIR, name)
        cfg = drafts.read_config(p)
        ids = cfg.aux_layer_ids or ()
        if (cfg.vocab_size == target.vocab_size and cfg.target_hidden_size == target.hidden_size
                and all(0 <= i < target.num_hidden_layers for i in ids)):
            return cfg, os.path.relpath(p, REPO_DIR)
    H, N = target.hidden_size, target.num_attention_heads
    derived = DraftConfig(
        hidden_size=H, intermediate_size=target.intermediate_size, num_attention_heads=N, num_key_value_heads=N,
        head_dim=H // N if H % N == 0 else target.v_head_dim, vocab_size=target.vocab_size,
        draft_vocab_size=min(DEFAULT_DRAFT_VOCAB, target.vocab_size), target_hidden_size=H, aux_layer_ids=None)
    return derived, "derived from the target (hidden, intermediate and heads of the target; no published shape matches)"



def _compile_prefill(result: Plan, name, fn, args, static, log) -> ProgramMemory:
    """Compiles a program that prefills, with the settings' chunk; with a budget and no chunk given,
    halves the chunk from the whole prompt block until the program's upper peak fits (or 16)."""
    s = result.settings
    chunk = s.prefill_chunk or s.prompt_len
    while True:
        log(f"compiling {name} ({PROGRAM_DOC[name]}), prefill chunk {chunk} ...")
        program = dataclasses.replace(static["program"], prefill_chunk=chunk)
        mem = compile_program(name, fn, args, dict(static, program=program), result.hbm)
        log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
        result.programs[name] = mem
        result.prefill_chunk = chunk
        if s.prefill_chunk or not result.hbm or chunk <= 16 or result.totals(name)[0] <= result.hbm:
            return mem
        chunk //= 2


def check_settings(s: PlanSettings, cfg: TargetConfig, mesh_cfg: MeshConfig) -> None:
    if s.platform not in ("cpu", "tpu"):
        raise ConfigError(f"platform must be cpu or tpu, found {s.platform!r}")
    if s.platform == "tpu":
        if not s.topology:
            raise ConfigError("platform tpu needs a topology, e.g. --topology v5p:2x2x4")
        have, where = tpu.chips(s.topology), f"topology {s.topology} has"
    else:
        have, where = len(jax.devices()), "are visible;"
    if mesh_cfg.size > have:
        fix = ("pick a mesh whose sizes multiply to the chip count" if s.platform == "tpu" else
               f"run with --devices {mesh_cfg.size} (python -m tools.plan sets them up before JAX starts)")
        raise ConfigError(f"mesh {s.mesh} needs {mesh_cfg.size} devices but {where} {have}; {fix}")
    if cfg.n_routed_experts % mesh_cfg.expert:
        raise ConfigError(f"{cfg.n_routed_experts} routed experts do not split over expert={mesh_cfg.expert}; "
                          "pick an expert axis that divides the expert count")
    if s.batch % mesh_cfg.data:
        raise ConfigError(f"batch {s.batch} does not split over data={mesh_cfg.data}; use a multiple of it")
    if s.admit_rows is not None and (not 1 <= s.admit_rows <= s.batch or s.admit_rows % mesh_cfg.data):
        raise ConfigError(f"admit_rows {s.admit_rows} must lie in [1, batch={s.batch}] and split over "
                          f"data={mesh_cfg.data}")
    if not 1 <= s.prompt_len < s.max_len:
        raise ConfigError(f"prompt_len {s.prompt_len} must lie in [1, max_len={s.max_len})")
    if s.num_draft_tokens < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, found {s.num_draft_tokens}")
    if s.layers is not None and not 1 <= s.layers <= cfg.num_hidden_layers:
        raise ConfigError(f"layers {s.layers} must lie in [1, {cfg.num_hidden_layers}]")
    unknown = [p for p in s.programs if p not in PROGRAMS]
    if unknown:
        raise ConfigError(f"unknown program(s) {unknown}; choose from {list(PROGRAMS)}")


def target_config(s: PlanSettings) -> TargetConfig:
    """The target to plan: the config, cut to its first ``layers`` layers at full width if asked."""
    cfg = TargetConfig.from_path(s.model)
    if s.layers is not None and s.layers != cfg.num_hidden_layers:
        if not 1 <= s.layers <= cfg.num_hidden_layers:
            raise ConfigError(f"layers {s.layers} must lie in [1, {cfg.num_hidden_layers}]")
        cfg = cfg.replace(num_hidden_layers=s.layers)
    return cfg


# ---------------------------------------------------------------------- the plan
@dataclass
class Setup:
    """What every program of a plan is compiled on: the mesh, the target (cut if asked) and its
    draft, the static decode program, and abstract models and loop state (ShapeDtypeStructs that
    carry their shardings) in a dtype. ``plan`` compiles the serving programs on it; ``rounds.py``
    one decode round at each K."""

    settings: PlanSettings
    cfg: TargetConfig
    dcfg: DraftConfig
    draft_source: str
    aux_ids: tuple[int, ...]
    mesh: jax.sharding.Mesh
    hbm: int | None
    moe_kernel: str
    layout: QuantLayout | None
    planned: jnp.dtype
    compiled: jnp.dtype
    static: dict
    key: jax.ShapeDtypeStruct
    aux: jax.ShapeDtypeStruct   # the draft's aux layer ids, a traced argument of every program
    sp: gen.Sampling

    def models(self, dtype):
        """((graphdef, abstract state, axes by path) of the target, the same of the draft) in ``dtype``.
        The float32 compile holds INT4 scales in float32 too: a bf16 -> float32 convert of every
        scale stack is one of the CPU-only copies the float32 compile exists to avoid."""
        layout = self.layout
        held = layout if dtype == self.planned or layout is None else dataclasses.replace(
            layout, int4_scale_dtype=jnp.dtype(dtype).name)
        cfg, dcfg, mesh, kernel = self.cfg, self.dcfg, self.mesh, self.moe_kernel
        t = _abstract_model(lambda: Target(cfg, dtype, None, mesh=mesh, moe_kernel=kernel, quant=held), mesh)
        d = _abstract_model(lambda: drafts.of_config(dcfg).module(dcfg, len(self.aux_ids), dtype, None), mesh)
        return t, d

    def loop_state(self, t, d, dtype, log=None, static=None):
        """The abstract loop state of ``static`` (default: the plan's program) for models ``t``, ``d``."""
        t0 = time.perf_counter()
        shapes = gen.blank_state.eval_shape(t[0], t[1], d[0], d[1], self.aux, self.key, self.sp,
                                            **(static or self.static))
        (log or (lambda m: None))(f"traced the loop state ({dtype}) in {time.perf_counter() - t0:.1f} s")
        return abstract_state(self.mesh, shapes)


def setup(s: PlanSettings) -> Setup:
    """Checks the settings and builds the mesh, configs and static program a plan compiles on."""
    cfg, full = target_config(s), TargetConfig.from_path(s.model)
    mesh_cfg = MeshConfig.parse(s.mesh)
    check_settings(s, cfg, mesh_cfg)
    on_tpu = s.platform == "tpu"
    mesh = tpu.topology_mesh(s.topology, s.mesh) if on_tpu else make_mesh(mesh_cfg)
    dcfg, draft_source = choose_draft(full, s.draft)
    if cfg.num_hidden_layers < full.num_hidden_layers:
        # A cut target keeps the full model's draft (same widths, same cache), tapping layers it has.
        L = cfg.num_hidden_layers
        dcfg = dataclasses.replace(dcfg, aux_layer_ids=(0, L // 2, L - 1)[:len(resolve_aux_ids(dcfg, full))])
        draft_source += f" (aux layers moved into the {L}-layer cut)"
    aux_ids = resolve_aux_ids(dcfg, cfg)
    check_pairing(dcfg, cfg, len(aux_ids) * cfg.hidden_size, len(aux_ids), None, None)
    B, S, K = s.batch, s.max_len, s.num_draft_tokens
    static = dict(program=gen.DecodeProgram(batch_size=B, max_len=S, num_draft_tokens=K))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return Setup(
        settings=s, cfg=cfg, dcfg=dcfg, draft_source=draft_source, aux_ids=aux_ids, mesh=mesh,
        hbm=s.hbm or (tpu.chip_hbm_bytes(s.topology) if on_tpu else None),
        # The expert kernel the product picks for the platform compiled for, not for this host.
        moe_kernel=s.moe_kernel or pick_kernel(None, s.platform),
        layout=layout_from_config(cfg) if s.weights == "native" else None,
        planned=jnp.dtype(resolve_dtype(s.dtype)), compiled=jnp.dtype(resolve_dtype(compile_dtype(s))),
        static=static, key=jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P())),
        aux=jax.ShapeDtypeStruct((len(aux_ids),), jnp.int32, sharding=NamedSharding(mesh, P())),
        sp=sampling_args(mesh))


def plan(s: PlanSettings, log=None) -> Plan:
    """Builds everything abstractly, compiles the requested programs, returns the numbers."""
    log = log or (lambda msg: None)
    su = setup(s)
    mesh, static, sp, planned, compiled = su.mesh, su.static, su.sp, su.planned, su.compiled
    on_tpu, B, K = s.platform == "tpu", s.batch, s.num_draft_tokens
    with jax.set_mesh(mesh):
        # Bytes are counted on models built in the planned dtype; the programs are compiled on models
        # built in the compile dtype (float32 parts such as the router stay float32 in both).
        (tg, ts, taxes), (dg, ds, daxes) = su.models(planned)
        state = su.loop_state((tg, ts), (dg, ds), planned, log)
        result = Plan(settings=s, target=su.cfg, draft=su.dcfg, draft_source=su.draft_source, aux_ids=su.aux_ids,
                      mesh_shape=dict(zip(mesh.axis_names, mesh.devices.shape)),
                      target_params=_leaves(ts, taxes, "target."), draft_params=_leaves(ds, daxes, "draft."),
                      state=[_leaf(jax.tree_util.keystr(p).lstrip("."), x)
                             for p, x in jax.tree_util.tree_leaves_with_path(state)], quant=su.layout, hbm=su.hbm)
        result.moe_kernel = su.moe_kernel
        hbm = su.hbm
        if compiled != planned and (s.programs or s.train):
            (tg, ts, _), (dg, ds, _) = su.models(compiled)
            if s.programs:
                state = su.loop_state((tg, ts), (dg, ds), compiled, log)
        prompt = _sds(mesh, (B, s.prompt_len), jnp.int32, ("batch", None))
        rows = _sds(mesh, (B,), jnp.int32, ("batch",))
        scalar = lambda: _sds(mesh, (), jnp.int32)  # noqa: E731
        for name in s.programs:
            if name == "decode":
                args = (tg, ts, dg, ds, su.aux, state, scalar(), scalar(), sp)
                log(f"compiling {name} ({PROGRAM_DOC[name]}) ...")
                mem = compile_program(name, gen.run_rounds, args, static, hbm)
                log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
                result.programs[name] = mem
                if on_tpu and s.cost_k0:  # the target-only round on the same state: the step a speedup is measured against
                    result.rounds[K] = mem
                    k0 = dict(static, program=static["program"].with_draft_tokens(0))
                    log("compiling decode at K = 0 (target-only rounds, for the predicted speedup) ...")
                    result.rounds[0] = compile_program("decode_k0", gen.run_rounds, args, k0, hbm)
            elif name == "prefill":
                A = s.admit_rows or B
                args = (tg, ts, dg, ds, su.aux, state, _sds(mesh, (A,), jnp.int32, ("batch",)),
                        _sds(mesh, (A, s.prompt_len), jnp.int32, ("batch", None)),
                        _sds(mesh, (A,), jnp.int32, ("batch",)), sp)
                result.programs[name] = _compile_prefill(result, name, gen.admit_rows, args, static, log)
            else:
                result.programs[name] = _compile_prefill(result, name, gen.generate_loop,
                                                         (tg, ts, dg, ds, su.aux, prompt, rows, su.key, sp), static,
                                                         log)
        if s.train:
            result.train = plan_train(s, su.cfg, su.dcfg, su.aux_ids, mesh, (tg, ts), planned, compiled, log)
    return result
