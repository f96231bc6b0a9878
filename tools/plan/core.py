"""The memory plan: abstract models on a mesh, compiled serving programs, bytes per device.

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

import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.config import resolve_dtype
from eagle3_jax.config import DraftConfig, MeshConfig, TargetConfig
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.draft import Draft
from eagle3_jax.models.target import Target
from eagle3_jax.sharding import make_mesh, sharding_for, state_shardings
from eagle3_jax.speculative import generate as gen

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafts")
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The draft vocabulary SpecForge-trained drafts use; a derived draft takes it (or the whole vocab if smaller).
DEFAULT_DRAFT_VOCAB = 32000
PROGRAMS = ("decode", "prefill", "generate")
PROGRAM_DOC = {
    "decode": "run_rounds: the steady-state speculative loop (draft K, verify K+1, accept), state donated",
    "prefill": "admit_rows: prefill of a [batch, prompt_len] block into the running state, state donated",
    "generate": "generate_loop: prefill + rounds in one program (Generator.generate)",
}
# Scale layouts of quantized expert weights: (bits, scale bytes, weights per scale) as the public
# checkpoints store them. Kimi-K2.5: compressed-tensors pack-quantized INT4, one bf16 scale per
# group of 32 inputs. DeepSeek-V3: FP8 e4m3 with one float32 scale per 128x128 block.
QUANT_DEFAULTS = {4: (2, 32), 8: (4, 128 * 128)}

# Logical axes of the loop state's arrays, as the spec loop lays them out (the cache constraint
# in speculative/generate.py, the draft cache following its K/V projections). Fields not listed are
# per-row vectors or matrices (batch first) or replicated scalars.
STATE_AXES = {
    "tcache.latent_LBSC": (None, "batch", "cache_seq", "kv_lora"),
    "tcache.rope_LBSP": (None, "batch", "cache_seq", None),
    "dcache.k_BGSH": ("batch", "heads", "cache_seq", "head_dim"),
    "dcache.v_BGSH": ("batch", "heads", "cache_seq", "head_dim"),
    "dhidden_BD": ("batch", "embed"),
    "dlogits_BW": ("batch", "draft_vocab"),
}


# ---------------------------------------------------------------------- settings and results
@dataclass(frozen=True)
class PlanSettings:
    model: str
    mesh: str
    batch: int = 32
    max_len: int = 8192
    num_draft: int = 4
    prompt_len: int = 1024
    max_new: int | None = None          # default: max_len - prompt_len
    dtype: str = "bfloat16"
    compile_dtype: str = "float32"
    expert_bits: tuple[int, ...] = (16,)
    draft: str | None = None            # a draft config.json; default: a matching preset, else derived
    programs: tuple[str, ...] = ("decode", "prefill")
    greedy: bool = True
    moe_kernel: str = "blocked"
    train: bool = False
    # the draft training step (eagle3_jax.train.trainer.train_step), with TrainConfig's defaults
    train_batch: int = 8
    train_len: int = 2048
    train_accum: int = 1
    ttt_steps: int = 7
    train_dtype: str = "float32"        # the draft's weights and AdamW moments while training
    hidden_source: str = "online"       # online: the frozen target runs in the step; offline: states read from disk


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


def _itemsize(dtype) -> int:
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
                itemsize=_itemsize(sds.dtype), spec=tuple(sds.sharding.spec),
                shard_shape=tuple(sds.sharding.shard_shape(sds.shape)), routed_expert=routed_expert)


def _sds(mesh, shape, dtype, axes=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(mesh, axes, shape))


def abstract_state(mesh, batch: int, shapes: Any) -> Any:
    """The loop state's ShapeDtypeStructs with the shardings the table gives them."""

    def one(path, s):
        name = jax.tree_util.keystr(path).lstrip(".")
        axes = STATE_AXES.get(name)
        if axes is None and s.ndim and s.shape[0] == batch:
            axes = ("batch",) + (None,) * (s.ndim - 1)
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
        return _sds(mesh, s.shape, s.dtype, axes)

    return jax.tree_util.tree_map_with_path(one, shapes)


def sampling_args(mesh) -> gen.Sampling:
    return gen.Sampling(_sds(mesh, (), jnp.float32), _sds(mesh, (), jnp.int32), _sds(mesh, (), jnp.float32),
                        _sds(mesh, (1,), jnp.int32, (None,)))


def _compile(name, fn, args, kwargs) -> ProgramMemory:
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
    if not 1 <= s.prompt_len < s.max_len:
        raise ConfigError(f"prompt_len {s.prompt_len} must lie in [1, max_len={s.max_len})")
    if s.num_draft < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, found {s.num_draft}")
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
    B, S, K = s.batch, s.max_len, s.num_draft
    max_new = s.max_new if s.max_new is not None else S - s.prompt_len
    static = dict(num_draft=K, max_new=max_new, capacity=S, aux_ids=aux_ids, greedy=s.greedy)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
    sp = sampling_args(mesh)

    def models(dtype):
        t = _abstract_model(lambda: Target(cfg, dtype, None, mesh=mesh, moe_kernel=s.moe_kernel), mesh)
        d = _abstract_model(lambda: Draft(dcfg, len(aux_ids), dtype, None), mesh)
        return t, d

    def loop_state(t, d, dtype):
        t0 = time.perf_counter()
        shapes = gen.blank_state.eval_shape(t[0], t[1], d[0], d[1], B, key, sp, **static)
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
                             for p, x in jax.tree_util.tree_leaves_with_path(state)])
        if compiled != planned and (s.programs or s.train):
            (tg, ts, _), (dg, ds, _) = models(compiled)
            if s.programs:
                state = loop_state((tg, ts), (dg, ds), compiled)
        prompt = _sds(mesh, (B, s.prompt_len), jnp.int32, ("batch", None))
        rows = _sds(mesh, (B,), jnp.int32, ("batch",))
        for name in s.programs:
            if name == "decode":
                fn, args = gen.run_rounds, (tg, ts, dg, ds, state, _sds(mesh, (), jnp.int32), sp)
            elif name == "prefill":
                fn, args = gen.admit_rows, (tg, ts, dg, ds, state, _sds(mesh, (B,), jnp.bool_, ("batch",)),
                                            prompt, rows, sp)
            else:
                fn, args = gen.generate_loop, (tg, ts, dg, ds, prompt, rows, key, sp)
            log(f"compiling {name} ({PROGRAM_DOC[name]}) ...")
            mem = _compile(name, fn, args, static)
            log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
            result.programs[name] = mem
        if s.train:
            result.train = plan_train(s, cfg, dcfg, aux_ids, mesh, (tg, ts), planned, compiled, log)
    return result


@dataclass
class TrainMemory:
    """Bytes per device of one draft training step (planned dtypes), and the compiled step's memory."""

    frozen_target: int      # online: the target's parameters (the step runs it); offline: 0
    head: int               # offline: the target's embedding and lm_head, passed separately
    draft_params: int
    optimizer: int
    batch: int
    program: ProgramMemory

    def totals(self, temp_ratio: float) -> tuple[int, int]:
        resident = self.frozen_target + self.head + self.draft_params + self.optimizer + self.batch
        extra = max(0, self.program.output - self.program.alias)
        return resident + extra + self.program.temp, resident + extra + int(self.program.temp * temp_ratio)


def _pure_abstract(state, mesh):
    """An nnx.State of abstract values -> a plain dict of ShapeDtypeStructs with the table's shardings."""
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
    return jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                        nnx.to_pure_dict(state), shardings)


def _device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * _itemsize(x.dtype) for x in jax.tree.leaves(tree))


def plan_train(s: PlanSettings, cfg: TargetConfig, dcfg: DraftConfig, aux_ids, mesh, target_models, planned,
               compiled, log) -> TrainMemory:
    """Lowers and compiles eagle3_jax.train.trainer.train_step on abstract arguments laid out as the
    Trainer lays them out (rows on ``data``, the draft by the table, the head replicated offline)."""
    import optax

    from eagle3_jax.train import trainer
    from eagle3_jax.train.config import TrainConfig

    if s.hidden_source not in ("online", "offline"):
        raise ConfigError(f"hidden_source must be online or offline, found {s.hidden_source!r}")
    data = mesh.shape["data"]
    if s.train_batch % data:
        raise ConfigError(f"train batch {s.train_batch} does not split over data={data}; use a multiple of it")
    dtype = jnp.dtype(resolve_dtype(s.train_dtype))
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Draft(dcfg, len(aux_ids), dtype, None)), nnx.Param, ...)
    params, rest = _pure_abstract(params, mesh), _pure_abstract(rest, mesh)
    defaults = TrainConfig(target=s.model)
    opt_spec = trainer.OptimizerSpec.from_config(defaults)
    opt = opt_spec.build()
    shapes = jax.eval_shape(opt.init, params)
    replicated = NamedSharding(mesh, P())
    opt_state = optax.tree_map_params(
        opt, lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding), shapes, params,
        transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated))

    tgraph, tstate = target_models
    V, D, T, A, R = cfg.vocab_size, cfg.hidden_size, s.train_len, s.train_accum, s.train_batch
    rows = NamedSharding(mesh, P(None, "data"))
    batch = {"ids": jax.ShapeDtypeStruct((A, R, T), jnp.int32, sharding=rows),
             "loss_mask": jax.ShapeDtypeStruct((A, R, T), jnp.bool_, sharding=rows)}
    tdtype = tstate["embed_tokens"].value.dtype
    if s.hidden_source == "online":
        embed = tstate["embed_tokens"].value
        if "lm_head" not in tstate:
            raise ConfigError("planning the training step of a target with a tied embedding is not supported")
        head = tstate["lm_head"].value
        frozen, head_bytes = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * planned.itemsize if x.dtype == compiled else
            _device_bytes(x) for x in jax.tree.leaves(tstate)), 0
    else:
        embed = jax.ShapeDtypeStruct((V, D), tdtype, sharding=replicated)
        head = jax.ShapeDtypeStruct((D, V), tdtype, sharding=replicated)
        X = len(aux_ids) * D
        batch["aux"] = jax.ShapeDtypeStruct((A, R, T, X), tdtype, sharding=rows)
        batch["hidden"] = jax.ShapeDtypeStruct((A, R, T, D), tdtype, sharding=rows)
        tgraph, tstate = None, None
        frozen, head_bytes = 0, 2 * V * D * planned.itemsize
    batch_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * (planned.itemsize if x.dtype == compiled
                      else _itemsize(x.dtype)) for x in batch.values())
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    # The Trainer's own jitted step: new params and moments pinned to the shardings they came in with.
    leaves, tree = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, (params, opt_state)))
    step = trainer.compiled_step(graphdef, tgraph, opt_spec, tuple(aux_ids), s.ttt_steps, defaults.loss_decay,
                                 tuple(leaves), tree)
    log(f"compiling train ({s.hidden_source} draft training step: {s.train_accum} x {s.train_batch} rows x "
        f"{s.train_len} tokens, TTT {s.ttt_steps} steps) ...")
    mem = _compile("train", step, (params, opt_state, rest, embed, head, tstate, batch, lr), {})
    log(f"  lowered in {mem.lower_s:.1f} s, compiled in {mem.compile_s:.1f} s")
    return TrainMemory(frozen_target=frozen, head=head_bytes, draft_params=_device_bytes(params) + _device_bytes(rest),
                       optimizer=_device_bytes(opt_state), batch=batch_bytes, program=mem)


# ---------------------------------------------------------------------- report
UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1))


def _unit(n: float) -> tuple[str, float]:
    return next((u for u in UNITS if n >= u[1]), UNITS[-1])


def _count(n: float) -> str:
    for name, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {name}"
    return str(int(n))


def describe_target(cfg: TargetConfig) -> str:
    return (f"{cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), {cfg.n_routed_experts} experts "
            f"top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads, MLA latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, "
            f"vocab {cfg.vocab_size}")


def describe_draft(d: DraftConfig) -> str:
    return (f"hidden {d.hidden_size}, intermediate {d.intermediate_size}, {d.num_attention_heads} heads / "
            f"{d.num_key_value_heads} kv x {d.head_dim}, draft vocab {d.draft_vocab_size}")


def bits_label(plan: Plan, bits: int | None) -> str:
    if bits is None or bits >= 16:
        return plan.settings.dtype
    per, n = plan.scale_layout(bits)
    kind = {4: "int4", 8: "fp8"}.get(bits, f"{bits}-bit")
    return f"{kind} experts (+{'bf16' if per == 2 else 'f32'} scale / {n})"


def _scale(plan: Plan):
    unit, scale = _unit(plan.param_bytes())
    return unit, (lambda n: f"{n / scale:,.1f}")


def format_header(plan: Plan) -> list[str]:
    """What is planned: the model, the draft, the workload (the same for every mesh of a run)."""
    s = plan.settings
    total_params = sum(leaf.total_bytes for leaf in plan.target_params)
    return [
        f"# plan  model: {s.model}: {describe_target(plan.target)}",
        f"#   target: {_count(sum(math.prod(leaf.shape) for leaf in plan.target_params))} parameters, "
        f"{_count(total_params)}B in {s.dtype}; draft: "
        f"{_count(sum(math.prod(leaf.shape) for leaf in plan.draft_params))} parameters",
        f"# draft: {plan.draft_source}: {describe_draft(plan.draft)}, aux layers {list(plan.aux_ids)}",
        f"# batch {s.batch}, max_len {s.max_len}, K={s.num_draft} draft tokens, prompt block {s.prompt_len}, "
        f"{'greedy' if s.greedy else 'sampled'}; weights {s.dtype}; compiled in {s.compile_dtype} on "
        f"{jax.devices()[0].platform.upper()}, moe kernel '{s.moe_kernel}'",
    ] + [f"#   {name}: {PROGRAM_DOC[name]}" for name in plan.programs]


def format_mesh(plan: Plan, hbm: int | None = None) -> list[str]:
    """One mesh: its line and the table (one row per expert width), then the training step if planned."""
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    unit, _gb = _scale(plan)
    times = ", ".join(f"{n} {m.lower_s:.0f}+{m.compile_s:.0f} s" for n, m in plan.programs.items())
    lines = [f"# mesh {mesh} ({plan.devices} devices): bytes per device in {unit}"
             + (f", HBM {_gb(hbm)} {unit}" if hbm else "") + (f"; lower+compile {times}" if times else "")]
    progs = list(plan.programs)
    head = ["experts", "params", "of which experts", "target cache", "draft cache", "other state"]
    for name in progs:
        head += [f"{name} temp (f32 / x{plan.temp_ratio:g})" if plan.temp_ratio < 1 else f"{name} temp",
                 f"{name} peak"]
    if hbm:
        head.append("fits")
    rows = []
    for bits in plan.settings.expert_bits:
        b = None if bits >= 16 else bits
        row = [bits_label(plan, b), _gb(plan.param_bytes(b)), _gb(plan.routed_expert_bytes(b)),
               _gb(plan.state_bytes("tcache")), _gb(plan.state_bytes("dcache")),
               _gb(plan.state_bytes() - plan.state_bytes("tcache") - plan.state_bytes("dcache"))]
        verdicts = []
        for name in progs:
            mem = plan.programs[name]
            hi, lo = plan.totals(name, b)
            if plan.temp_ratio < 1:
                row += [f"{_gb(mem.temp)} / {_gb(mem.temp * plan.temp_ratio)}", f"{_gb(hi)} / {_gb(lo)}"]
            else:
                row += [_gb(mem.temp), _gb(hi)]
            if hbm:
                verdicts.append(f"{name} " + ("yes" if hi <= hbm else "if bf16 temps" if lo <= hbm else "no"))
        if hbm and not progs:  # accounting only: what stays resident, before any program runs
            verdicts.append("params+state " + ("yes" if plan.param_bytes(b) + plan.state_bytes() <= hbm else "no"))
        if hbm:
            row.append(", ".join(verdicts))
        rows.append(row)
    lines += _table(head, rows)
    if plan.train is not None:
        lines += [""] + format_train(plan, hbm)
    return lines


def format_notes(plan: Plan) -> list[str]:
    notes = []
    if any(b < 16 for b in plan.settings.expert_bits):
        notes.append("quantized expert rows are computed from the shapes (packed weights + scales, as the public "
                     "checkpoints store them); this runtime dequantizes experts to the model dtype when loading, so "
                     "today's footprint is the model-dtype row")
    if plan.temp_ratio < 1:
        notes.append("temp and peak: upper / lower estimate (float32 compile, and that scaled to the 2-byte dtype)")
    notes.append("peak = params + loop state (caches, tokens) + temporaries; runtime reserves, collective "
                 "buffers and fragmentation are not included")
    return [f"# {n}" for n in notes]


def format_plan(plan: Plan, hbm: int | None = None) -> str:
    return "\n".join(format_header(plan) + [""] + format_mesh(plan, hbm) + [""] + format_notes(plan))


def format_train(plan: Plan, hbm: int | None) -> list[str]:
    s, t = plan.settings, plan.train
    # The draft trains in train_dtype: with float32 weights its TTT activations are float32 too,
    # so only a narrower train dtype makes the float32 compile an overestimate.
    size = lambda name: jnp.dtype(resolve_dtype(name)).itemsize  # noqa: E731
    ratio = min(1.0, size(s.train_dtype) / size(s.compile_dtype))
    hi, lo = t.totals(ratio)
    unit, scale = _unit(hi)
    _gb = lambda n: f"{n / scale:,.1f}"  # noqa: E731
    lines = [f"# train: eagle3_jax.train.trainer.train_step, hidden states {s.hidden_source}, {s.train_accum} x "
             f"{s.train_batch} rows x {s.train_len} tokens, TTT {s.ttt_steps} steps, draft + AdamW in "
             f"{s.train_dtype}; lowered {t.program.lower_s:.0f} s, compiled {t.program.compile_s:.0f} s; {unit}"]
    head = ["frozen target", "target head", "draft params", "AdamW state", "batch", "temp", "peak"]
    row = [_gb(t.frozen_target), _gb(t.head), _gb(t.draft_params), _gb(t.optimizer), _gb(t.batch)]
    if ratio < 1:
        row += [f"{_gb(t.program.temp)} / {_gb(t.program.temp * ratio)}", f"{_gb(hi)} / {_gb(lo)}"]
    else:
        row += [_gb(t.program.temp), _gb(hi)]
    if hbm:
        head.append("fits")
        row.append("yes" if hi <= hbm else "if bf16 temps" if lo <= hbm else "no")
    return lines + _table(head, [row])


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [fmt(r) for r in rows]
