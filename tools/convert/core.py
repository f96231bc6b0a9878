"""Conversions between Hugging Face safetensors checkpoints and our JAX (orbax) checkpoints.

Both directions stream one parameter at a time through the rule tables in
``eagle3_jax.checkpoint.{target,draft}_map`` (the tables the loaders use), so peak host memory is
bounded by the orbax parts in flight (two, see store.DEFAULT_PART_BYTES) or, for big models, by
about three of the largest parameter (one layer's stacked experts), never by the model. Output is
written into ``DST.tmp-XXXX`` beside DST and renamed when complete (``staging.staged_dir``); a run
that fails or is killed leaves no directory at DST.

Byte-identical round trip: to-jax without ``--dtype`` keeps every parameter in its source dtype
and records the dtype of each on-disk tensor that differs from its parameter's (e.g. an fp32
router beside bf16 weights), so to-hf writes back the same names, dtypes, shapes and bytes.
Tensors the model does not use (DeepSeek-V3's MTP layer, Kimi-K2.5's vision tower, rotary
caches) are dropped and listed in eagle3_jax.json. FP8 / INT4 weights stay quantized by default
(their stored values and scales are copied, so to-hf writes back the same tensors and the same
quantization_config); ``--weights bfloat16`` dequantizes them instead (bf16 unless ``--dtype``
says otherwise), and then they are exported as bf16 without a quantization_config: there is no
requantization.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import drafts
from eagle3_jax.checkpoint import quant, quant_native, store
from eagle3_jax.checkpoint.hf_loader import check_keys
from eagle3_jax.checkpoint.staging import staged_dir, write_json_atomic
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.safetensors_format import DTYPES, INDEX_FILE_NAME, dtype_code, parse_size
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import CheckpointError, ConfigError
from eagle3_jax.models.quantized import QuantLayout
from eagle3_jax.sharding import make_mesh, sharding_for
from tools.convert.models import DRAFT, TARGET, ModelSpec, detect_kind, draft_spec, target_spec

log = logging.getLogger("tools.convert")

# Set to N to make to-jax / to-hf stop (sleep) after N parameters: lets a test kill a conversion
# part-way through and check that nothing complete-looking is left behind.
PAUSE_ENV = "EAGLE3_JAX_CONVERT_PAUSE_AFTER"

DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Files that make a directory a checkpoint; everything else at the top level (tokenizer,
# generation_config.json, chat template, remote code) is copied across unchanged.
_NOT_EXTRAS = {"config.json", store.META_FILE, INDEX_FILE_NAME}


# ---------------------------------------------------------------------- small helpers
def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no {Path(path).name} in {Path(path).parent}; point at a checkpoint directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _common_float(dtypes) -> np.dtype:
    """One dtype for a parameter built from several tensors: theirs if they agree, else float32."""
    dtypes = {np.dtype(d) for d in dtypes}
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)


def _copy_extras(src: Path, dst: Path) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in _NOT_EXTRAS and not p.name.endswith(".safetensors") \
                and not p.name.endswith(".safetensors.index.json"):
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


class _Lazy(Sequence):
    """The tensors of one rule, each read when the rule asks for it and not kept: a rule that
    transposes and stacks 384 experts then holds the transposed copies, not the originals too."""

    def __init__(self, keys, read):
        self._keys, self._read = list(keys), read

    def __len__(self):
        return len(self._keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._read(k) for k in self._keys[i]]
        return self._read(self._keys[i])


def _pause_hook(done: int) -> None:
    n = os.environ.get(PAUSE_ENV)
    if n is not None and done == int(n):
        print(f"[convert] paused after {done} parameters ({PAUSE_ENV})", file=sys.stderr, flush=True)
        time.sleep(3600)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, mininterval=0.5,
                file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------- reading an HF directory
def hf_spec(src: Path, reader: CheckpointReader, dtype=jnp.float32, weights: str = "native") -> ModelSpec:
    """``weights="native"``: a quantized target's INT4 / FP8 tensors are kept as stored."""
    hf = read_json(src / "config.json")
    where = str(src / "config.json")
    kind, arch = detect_kind(hf, where)
    if kind == TARGET:
        layout = None
        if weights == "native":
            layout = quant_native.detect_layout(reader, TargetConfig.from_hf_dict(hf, where), where=str(src))
        return target_spec(hf, arch, dtype, where, quant=layout)
    cfg = drafts.read_config(hf, where)
    return draft_spec(hf, arch, drafts.of_config(cfg).wiring(src, reader, cfg), dtype, where)


def jax_spec(src: Path, meta: dict, dtype=jnp.float32) -> ModelSpec:
    hf = read_json(src / "config.json")
    where = str(src / "config.json")
    if meta.get("kind") == TARGET:
        return target_spec(hf, meta.get("architecture", ""), dtype, where, quant=QuantLayout.from_json(meta.get("quant")))
    if meta.get("kind") == DRAFT:
        return draft_spec(hf, meta.get("architecture", ""), meta["wiring"], dtype, where)
    raise CheckpointError(f"{src}: {store.META_FILE} has kind {meta.get('kind')!r}, expected target or draft")


def _source_kind(reader, key: str, var) -> str:
    """PLAIN / FP8 / INT4 for float parameters; integer and bool parameters (vocab maps) are read as is."""
    if _is_float(var.value.dtype):
        return quant.classify(reader, key)
    code = reader.dtype_code(key)
    ok = ("BOOL",) if var.value.dtype == jnp.bool_ else quant.INT_CODES
    if code not in ok:
        raise CheckpointError(f"{key}: dtype {code} is not supported here; expected one of {', '.join(ok)}")
    return quant.PLAIN


def preflight(reader: CheckpointReader, spec: ModelSpec, where: str) -> dict:
    """Everything that can be checked from headers, before a byte of data is converted:
    missing / unexpected tensors, unsupported dtypes, element counts against config.json."""
    dropped = check_keys(reader.keys(), spec.rules, prefix=spec.prefix, ignore=spec.ignore, where=where)
    problems, kinds = [], {}
    for rule in spec.rules:
        var = spec.flat[rule.path]
        count, readable = 0, True
        if isinstance(rule, quant_native.NativeRule):
            # Quantized values / scales are copied as stored; their shapes are checked on conversion.
            kinds.update((spec.prefix + k, quant.PLAIN) for k in rule.hf_keys)
            continue
        for k in rule.hf_keys:
            key = spec.prefix + k
            try:
                kinds[key] = _source_kind(reader, key, var)
                count += math.prod(quant.logical_shape(reader, key) if kinds[key] != quant.PLAIN
                                   else reader.shape(key))
            except CheckpointError as e:
                problems.append(str(e))
                readable = False
        if readable and count != math.prod(var.value.shape):
            key = spec.prefix + rule.hf_keys[0]
            shapes = [quant.logical_shape(reader, spec.prefix + k) for k in rule.hf_keys[:2]]
            problems.append(
                f"{key}: shape {shapes[0]}" + (f" (and {len(rule.hf_keys) - 1} more like it)" if len(shapes) > 1 else "")
                + f" holds {count} values in all, but config.json implies {store.param_name(rule.path)} of "
                  f"shape {tuple(var.value.shape)} ({math.prod(var.value.shape)} values)")
    if problems:
        raise CheckpointError(f"{where}: {len(problems)} problem(s): " + "; ".join(problems[:5]) +
                              ". Use the config.json that belongs to these weights, or re-export them")
    skip = set(dropped)
    used_bytes = sum(reader.nbytes(k) for k in reader.keys() if k not in skip)
    return {"dropped": dropped, "kinds": kinds, "bytes": used_bytes}


# ---------------------------------------------------------------------- to-jax
def _on_disk(reader, key: str) -> list[str]:
    """The stored tensors behind one logical weight (itself, or its quantized pieces)."""
    return [x for x in (key, key + "_scale_inv", key + "_packed", key + "_scale", key + "_shape") if x in reader]


def _convert_rule(reader, spec: ModelSpec, rule, kinds: dict, scheme, keep_source: bool):
    """One parameter in our layout, and {hf key: on-disk dtype code} for the tensors whose code
    differs from the parameter's (what to-hf needs to write them back as they were)."""
    var = spec.flat[rule.path]
    keys = [spec.prefix + k for k in rule.hf_keys]
    if isinstance(rule, quant_native.NativeRule):  # INT4 words, FP8 values, scales: as stored
        want = np.dtype(var.value.dtype)
        arrays = _Lazy(keys, reader.read)
    elif _is_float(var.value.dtype):
        want = _common_float(quant.source_dtype(reader, k) for k in keys) if keep_source else np.dtype(var.value.dtype)
        arrays = _Lazy(keys, lambda k: quant.read_dequantized(reader, k, want, scheme))
    else:  # vocab maps: integers / bools, converted by the rule itself
        want = np.dtype(var.value.dtype)
        arrays = _Lazy(keys, reader.read)
    name, shape = store.param_name(rule.path), tuple(var.value.shape)
    try:
        value = np.asarray(rule.to_ours(arrays))
    except ValueError as e:
        raise CheckpointError(f"{keys[0]}: shape {quant.logical_shape(reader, keys[0])} cannot form {name} {shape} "
                              f"({e}); use the config.json of these weights") from None
    if value.shape != shape:
        raise CheckpointError(f"{keys[0]}: found shape {quant.logical_shape(reader, keys[0])}, config.json implies "
                              f"{name} {shape} in our layout; use the config.json of these weights")
    if value.dtype != want:
        value = value.astype(want)
    code = dtype_code(want)
    # Dequantized weights go back out as bf16 (no requantization).
    disk = {k: reader.dtype_code(k) if kinds[k] == quant.PLAIN else "BF16" for k in keys}
    return value, {k: c for k, c in disk.items() if c != code}


def to_jax(src, dst, dtype: str | None = None, mesh: str | None = None, overwrite: bool = False,
           part_size=store.DEFAULT_PART_BYTES, progress: bool = True, weights: str = "native") -> dict:
    """HF safetensors directory -> our JAX checkpoint directory. Returns the written metadata.

    ``weights="native"`` keeps INT4 / FP8 weights quantized (values and scales as stored);
    ``"bfloat16"`` dequantizes them (to ``dtype``, bf16 by default)."""
    if weights not in quant_native.WEIGHTS_CHOICES:
        raise ConfigError(f"--weights {weights!r} is not supported; use one of {quant_native.WEIGHTS_CHOICES}")
    src, dst = Path(src), Path(dst)
    if store.is_jax_checkpoint(src):
        raise CheckpointError(f"{src} is already an eagle3-jax checkpoint; use to-hf to export it")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
    part_bytes = parse_size(part_size)
    the_mesh = make_mesh(mesh) if mesh else None
    with staged_dir(dst, overwrite) as tmp, CheckpointReader(src) as reader:
        spec = hf_spec(src, reader, DTYPE_NAMES[dtype] if dtype else jnp.float32, weights)
        scheme = quant.QuantScheme.from_hf_config(spec.hf_config, str(src / "config.json"))
        plan = preflight(reader, spec, str(src))
        if plan["dropped"]:
            log.warning("%s: dropping %d tensor(s) the model does not use (e.g. %s); they are listed in %s",
                        src, len(plan["dropped"]), plan["dropped"][:3], store.META_FILE)
        writer = store.StoreWriter(tmp, part_bytes)
        try:
            hf_dtypes: dict[str, str] = {}
            dequantized: Counter = Counter()
            n_values = 0
            bar = _progress(plan["bytes"], f"to-jax {src.name}") if progress else None
            for done, rule in enumerate(spec.rules, start=1):
                var = spec.flat[rule.path]
                value, codes = _convert_rule(reader, spec, rule, plan["kinds"], scheme, keep_source=dtype is None)
                hf_dtypes.update(codes)
                dequantized.update(plan["kinds"][spec.prefix + k] for k in rule.hf_keys
                                   if plan["kinds"][spec.prefix + k] != quant.PLAIN)
                n_values += value.size
                nbytes = sum(reader.nbytes(x) for k in rule.hf_keys for x in _on_disk(reader, spec.prefix + k))
                if the_mesh is not None:
                    value = jax.device_put(value, sharding_for(the_mesh, getattr(var, "axes", None), value.shape))
                writer.add(rule.path, value)
                del value
                if bar is not None:
                    bar.update(nbytes)
                _pause_hook(done)
            meta = {
                "kind": spec.kind,
                "architecture": spec.architecture,
                "dtype": dtype or "source",
                "num_values": int(n_values),
                "wiring": spec.wiring,
                "saved_with_mesh": mesh,
                "quant": spec.quant.to_json() if spec.quant else None,
                "hf": {
                    "weight_prefix": spec.prefix,
                    # on-disk dtype of each tensor whose dtype differs from its parameter's
                    "dtypes": dict(sorted(hf_dtypes.items())),
                    "dropped": plan["dropped"],
                    "dequantized": dict(dequantized),
                    "quantization_config": (spec.hf_config.get("quantization_config")
                                            or (spec.hf_config.get("text_config") or {}).get("quantization_config")),
                    "source_bytes": plan["bytes"],
                },
            }
            # The file itself, not a re-serialization: to-hf hands it back byte for byte.
            shutil.copyfile(src / "config.json", tmp / "config.json")
            meta["extras"] = _copy_extras(src, tmp)
            if bar is not None:
                bar.close()
            full = writer.close(meta)
        except BaseException:
            writer.abort()
            raise
    return full


# ---------------------------------------------------------------------- to-hf
def _export_config(src: Path, dst: Path, meta: dict) -> None:
    """Writes the config.json to export: the stored file unchanged (so a round trip is byte-identical),
    except that a dequantized checkpoint no longer has a quantization_config."""
    if not meta["hf"].get("dequantized"):
        shutil.copyfile(src, dst)
        return
    hf = read_json(src)
    for d in (hf, hf.get("text_config") or {}):
        d.pop("quantization_config", None)
        for key in ("torch_dtype", "dtype"):
            if key in d:
                d[key] = "bfloat16"
    write_json_atomic(dst, hf, fsync=False)


def to_hf(src, dst, max_shard_size="5GB", overwrite: bool = False, progress: bool = True) -> list[Path]:
    """Our JAX checkpoint directory -> HF safetensors (original names, dtypes, per-expert layout)."""
    src, dst = Path(src), Path(dst)
    meta = store.read_meta(src)
    spec = jax_spec(src, meta)
    rules = {store.param_name(r.path): r for r in spec.rules}
    stored = meta["params"]
    if set(rules) != set(stored):
        raise CheckpointError(
            f"{src}: stored parameters and config.json disagree: missing {sorted(set(rules) - set(stored))[:5]}, "
            f"unexpected {sorted(set(stored) - set(rules))[:5]}; convert the original checkpoint again")
    prefix = meta["hf"]["weight_prefix"]
    hf_dtypes = meta["hf"]["dtypes"]
    total = sum(math.prod(e["shape"]) * jnp.dtype(e["dtype"]).itemsize for e in stored.values())
    with staged_dir(dst, overwrite) as tmp:
        bar = _progress(total, f"to-hf {src.name}") if progress else None
        done = 0
        with CheckpointWriter(tmp, max_shard_bytes=parse_size(max_shard_size)) as writer:
            for name, value in store.iter_params(src):
                rule = rules[name]
                for key, arr in zip(rule.hf_keys, rule.to_hf(value)):
                    key = prefix + key
                    code = hf_dtypes.get(key)
                    if code is not None and dtype_code(arr.dtype) != code:
                        arr = arr.astype(DTYPES[code])
                    writer.add(key, arr)
                if bar is not None:
                    bar.update(value.nbytes)
                del value
                done += 1
                _pause_hook(done)
        _export_config(src / "config.json", tmp / "config.json", meta)
        for name in meta.get("extras", []):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        if bar is not None:
            bar.close()
        written = [dst / p.name for p in writer.files]
    if meta["hf"]["dropped"]:
        log.warning("%s: %d tensor(s) of the original checkpoint were dropped on to-jax and are not in %s "
                    "(e.g. %s)", src, len(meta["hf"]["dropped"]), dst, meta["hf"]["dropped"][:3])
    return written
