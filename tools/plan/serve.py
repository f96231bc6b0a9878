"""The serving memory plan: abstract models on a mesh, compiled serving programs, bytes per device.

The draft training step is planned in ``train.py`` and everything is printed by ``report.py``.

What is computed and what is measured:
  * parameter and cache bytes per device are exact: every array's global shape and dtype, and the
    shard each device holds under the NamedSharding that ``sharding.py``'s table gives it;
  * routed experts at 4 or 8 bits are computed from the shapes (packed weights plus the scales a
    quantized checkpoint stores); this runtime dequantizes them to the model dtype when loading,
    so those rows are the footprint of an INT4/FP8 expert kernel, not of this code today;
  * temporaries are measured: the programs are lowered with ``jax.ShapeDtypeStruct`` arguments that
    carry their shardings, compiled by XLA for fake CPU devices, and read from
    ``compiled.memory_analysis()`` (per device, after SPMD partitioning).

Why the compile runs in float32 by default: XLA:CPU computes bfloat16 dots and scatters through
float32 copies of their operands (and hoists the copies of weights out of the loop), so a bfloat16
program compiled for CPU reports float32 copies of the lm_head, of the experts and of the caches as
temporaries that no accelerator would allocate. Compiled in float32 there are no such copies. Its
temporaries are an upper estimate for the 2-byte program (activations that are bfloat16 on an
accelerator count double; softmax scores and logits are float32 either way); half of them is the
lower estimate. Both are printed and the verdict says which one the fit depends on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.checkpoint.quant_native import layout_from_config
from eagle3_jax.config import DraftConfig, MeshConfig, TargetConfig, resolve_dtype
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.draft import Draft
from eagle3_jax.models.quantized import QuantLayout
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import make_mesh, sharding_for, state_shardings
from eagle3_jax.speculative import generate as gen
from eagle3_jax.speculative.generate import LOOP_STATE_AXES

if TYPE_CHECKING:  # tools/plan/train.py imports this module
    from tools.plan.train import TrainMemory
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

# ---------------------------------------------------------------------- settings and results
@dataclass(frozen=True)
class PlanSettings:
    model: str
    mesh: str
    batch: int = 32
    max_len: int = 8192
    num_draft_tokens: int = 4
    prompt_len: int = 1024
    max_new_tokens: int | None = None         # default: max_len - prompt_len
    dtype: str = "bfloat16"
    compile_dtype: str = "float32"
    expert_bits: tuple[int, ...] = (16,)
    draft: str | None = None            # a draft config.json; default: a matching preset, else derived
    programs: tuple[str, ...] = ("decode", "prefill")
    moe_kernel: str = "blocked"
    train: bool = False
    # the draft training step (eagle3_jax.train.trainer.train_step), with TrainConfig's defaults
    train_batch: int = 8
    train_len: int = 2048
    train_accum: int = 1
    ttt_steps: int = 7
    train_dtype: str = "float32"        # the draft's weights and AdamW moments while training
    hidden_source: str = "online"       # online: the frozen target runs in the step; offline: states read from disk
    weights: str = "native"             # native: quantized weights as the checkpoint stores them (load_target's default)
    prefill_chunk: int | None = None    # prompt positions per target call in prefill; None: the whole block,
                                        # or with ``hbm`` the largest power-of-two split that fits
    hbm: int | None = None
    admit_rows: int | None = None       # rows one prefill call admits (the Engine's max_admit_rows); None: batch


@dataclass(frozen=True)
class Leaf:
    """One array: its global shape and the shard each device holds."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    spec: tuple
    shard_shape: tuple[int, ...]
    routed_expert: bool = False

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def device_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def shards(self) -> int:
        return math.prod(self.shape) // max(1, math.prod(self.shard_shape))

    @property
    def numel_device(self) -> int:
        return math.prod(self.shard_shape)


@dataclass
class ProgramMemory:
    name: str
    lower_s: float
    compile_s: float
    argument: int   # bytes per device, as compiled (compile dtype)
    output: int
    alias: int
    temp: int


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
        compiled = jnp.dtype(resolve_dtype(self.settings.compile_dtype)).itemsize
        return min(1.0, planned / compiled)


def quantized_bytes(numel: int, bits: int, scale_bytes: int, per_scale: int) -> int:
    return -(-numel * bits // 8) + -(-numel // per_scale) * scale_bytes


# ---------------------------------------------------------------------- building blocks
def parse_bytes(text: str) -> int:
    """'141GB' (10^9), '141GiB' (2^30), '80G', '1.5TB', or a plain number of bytes."""
    try:
        return int(float(text))
    except ValueError:
        pass
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"--hbm '{text}': expected a size such as 141GB, 96GiB or 80e9")
    value, unit, binary, _ = m.groups()
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(float(value) * (1024 if binary else 1000) ** power)


def choose_draft(target: TargetConfig, path: str | None = None) -> tuple[DraftConfig, str]:
    """The draft to plan for: the given config.json, a published shape for this target, or one
    derived from the target's own widths."""
    if path:
        return DraftConfig.from_path(path), path
    for name in sorted(os.listdir(DRAFTS_DIR)):
        if not name.endswith(".json"):
            continue
        p = os.path.join(DRAFTS_DIR, name)
        cfg = DraftConfig.from_path(p)
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


def itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key is two uint32 words
    return jnp.dtype(dtype).itemsize


def _abstract_model(make, mesh):
    """(graphdef, state of ShapeDtypeStructs carrying their shardings, logical axes by path)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(state, mesh)
    abstract = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), state, shardings)
    axes = {".".join(map(str, path)): getattr(var, "axes", None) for path, var in nnx.to_flat_state(state)}
    return graphdef, abstract, axes


def _leaves(abstract_state, axes_by_path, prefix="") -> list[Leaf]:
    return [_leaf(prefix + ".".join(map(str, path)), var.value,
                  routed_expert="expert" in (axes_by_path.get(".".join(map(str, path))) or ()))
            for path, var in nnx.to_flat_state(abstract_state)]


def _leaf(path, sds, routed_expert=False) -> Leaf:
    is_key = jax.dtypes.issubdtype(sds.dtype, jax.dtypes.prng_key)
    return Leaf(path=path, shape=tuple(sds.shape), dtype="key" if is_key else str(jnp.dtype(sds.dtype)),
                itemsize=itemsize(sds.dtype), spec=tuple(sds.sharding.spec),
                shard_shape=tuple(sds.sharding.shard_shape(sds.shape)), routed_expert=routed_expert)


def _sds(mesh, shape, dtype, axes=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(mesh, axes, shape))


def abstract_state(mesh, batch: int, shapes: Any) -> Any:
    """The loop state's ShapeDtypeStructs with the shardings the table gives them."""

    def one(path, s):
        name = jax.tree_util.keystr(path).lstrip(".")
        axes = LOOP_STATE_AXES.get(name)
        if axes is None and s.ndim and s.shape[0] == batch:
            axes = ("batch",) + (None,) * (s.ndim - 1)
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
        return _sds(mesh, s.shape, s.dtype, axes)

    return jax.tree_util.tree_map_with_path(one, shapes)


def sampling_args(mesh) -> gen.Sampling:
    return gen.Sampling(_sds(mesh, (), jnp.float32), _sds(mesh, (), jnp.int32), _sds(mesh, (), jnp.float32),
                        _sds(mesh, (1,), jnp.int32, (None,)), _sds(mesh, (), jnp.bool_))


def _compile_prefill(result: Plan, name, fn, args, static, log) -> ProgramMemory:
    """Compiles a program that prefills, with the settings' chunk; with ``hbm`` and no chunk given,
    halves the chunk from the whole prompt block until the program's upper peak fits (or 16)."""
    s = result.settings
    chunk = s.prefill_chunk or s.prompt_len
    while True:
        log(f"compiling {name} ({PROGRAM_DOC[name]}), prefill chunk {chunk} ...")
        program = dataclasses.replace(static["program"], prefill_chunk=chunk)
        mem = compile_program(name, fn, args, dict(static, program=program))
        log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
        result.programs[name] = mem
        result.prefill_chunk = chunk
        if s.prefill_chunk or not s.hbm or chunk <= 16 or result.totals(name)[0] <= s.hbm:
            return mem
        chunk //= 2


def compile_program(name, fn, args, kwargs) -> ProgramMemory:
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("this XLA backend reports no memory analysis for compiled programs")
    return ProgramMemory(name, t1 - t0, t2 - t1, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                         int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))


def check_settings(s: PlanSettings, cfg: TargetConfig, mesh_cfg: MeshConfig) -> None:
    if mesh_cfg.size > len(jax.devices()):
        raise ConfigError(f"mesh {s.mesh} needs {mesh_cfg.size} devices but {len(jax.devices())} are visible; "
                          f"run with --devices {mesh_cfg.size} (python -m tools.plan sets them up before JAX starts)")
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
    unknown = [p for p in s.programs if p not in PROGRAMS]
    if unknown:
        raise ConfigError(f"unknown program(s) {unknown}; choose from {list(PROGRAMS)}")


# ---------------------------------------------------------------------- the plan
def plan(s: PlanSettings, log=None) -> Plan:
    """Builds everything abstractly, compiles the requested programs, returns the numbers."""
    log = log or (lambda msg: None)
    cfg = TargetConfig.from_path(s.model)
    mesh_cfg = MeshConfig.parse(s.mesh)
    check_settings(s, cfg, mesh_cfg)
    mesh = make_mesh(mesh_cfg)
    dcfg, draft_source = choose_draft(cfg, s.draft)
    aux_ids = resolve_aux_ids(dcfg, cfg)
    check_pairing(dcfg, cfg, len(aux_ids) * cfg.hidden_size, len(aux_ids), None, None)
    planned = jnp.dtype(resolve_dtype(s.dtype))
    compiled = jnp.dtype(resolve_dtype(s.compile_dtype))
    B, S, K = s.batch, s.max_len, s.num_draft_tokens
    max_new_tokens = s.max_new_tokens if s.max_new_tokens is not None else S - s.prompt_len
    static = dict(program=gen.DecodeProgram(batch_size=B, max_len=S, max_new_tokens=max_new_tokens,
                                            num_draft_tokens=K, aux_layer_ids=aux_ids))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
    sp = sampling_args(mesh)

    layout = layout_from_config(cfg) if s.weights == "native" else None

    def models(dtype):
        # The float32 compile holds INT4 scales in float32 too: a bf16 -> float32 convert of every
        # scale stack is one of the CPU-only copies the float32 compile exists to avoid.
        held = layout if dtype == planned or layout is None else dataclasses.replace(
            layout, int4_scale_dtype=jnp.dtype(dtype).name)
        t = _abstract_model(lambda: Target(cfg, dtype, None, mesh=mesh, moe_kernel=s.moe_kernel, quant=held), mesh)
        d = _abstract_model(lambda: Draft(dcfg, len(aux_ids), dtype, None), mesh)
        return t, d

    def loop_state(t, d, dtype):
        t0 = time.perf_counter()
        shapes = gen.blank_state.eval_shape(t[0], t[1], d[0], d[1], key, sp, **static)
        log(f"traced the loop state ({dtype}) in {time.perf_counter() - t0:.1f} s")
        return abstract_state(mesh, B, shapes)

    with jax.set_mesh(mesh):
        # Bytes are counted on models built in the planned dtype; the programs are compiled on models
        # built in the compile dtype (float32 parts such as the router stay float32 in both).
        (tg, ts, taxes), (dg, ds, daxes) = models(planned)
        state = loop_state((tg, ts), (dg, ds), planned)
        result = Plan(settings=s, target=cfg, draft=dcfg, draft_source=draft_source, aux_ids=aux_ids,
                      mesh_shape=dict(zip(mesh.axis_names, mesh.devices.shape)),
                      target_params=_leaves(ts, taxes, "target."), draft_params=_leaves(ds, daxes, "draft."),
                      state=[_leaf(jax.tree_util.keystr(p).lstrip("."), x)
                             for p, x in jax.tree_util.tree_leaves_with_path(state)], quant=layout)
        if compiled != planned and (s.programs or s.train):
            (tg, ts, _), (dg, ds, _) = models(compiled)
            if s.programs:
                state = loop_state((tg, ts), (dg, ds), compiled)
        prompt = _sds(mesh, (B, s.prompt_len), jnp.int32, ("batch", None))
        rows = _sds(mesh, (B,), jnp.int32, ("batch",))
        for name in s.programs:
            if name == "decode":
                fn, args = gen.run_rounds, (tg, ts, dg, ds, state, _sds(mesh, (), jnp.int32), _sds(mesh, (), jnp.int32), sp)
            elif name == "prefill":
                A = s.admit_rows or B
                fn, args = gen.admit_rows, (tg, ts, dg, ds, state, _sds(mesh, (A,), jnp.int32, ("batch",)),
                                            _sds(mesh, (A, s.prompt_len), jnp.int32, ("batch", None)),
                                            _sds(mesh, (A,), jnp.int32, ("batch",)), sp)
            else:
                fn, args = gen.generate_loop, (tg, ts, dg, ds, prompt, rows, key, sp)
            if name == "decode":
                log(f"compiling {name} ({PROGRAM_DOC[name]}) ...")
                mem = compile_program(name, fn, args, static)
                log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
            else:
                mem = _compile_prefill(result, name, fn, args, static, log)
            result.programs[name] = mem
        if s.train:
            from tools.plan.train import plan_train  # train.py builds on this module

            result.train = plan_train(s, cfg, dcfg, aux_ids, mesh, (tg, ts), planned, compiled, log)
    return result
