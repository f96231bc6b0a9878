"""``python -m tools.convert inspect``: what a checkpoint holds (format, kind, wiring, quantization,
memory once loaded, tensors grouped by name pattern), from headers and configs only."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from eagle3_jax.checkpoint import quant, store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.hf_loader import check_keys
from tools.convert.core import hf_spec, jax_spec
from tools.convert.models import TARGET, ModelSpec


def _pattern(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _summarize(entries) -> list[str]:
    """(name, shape, dtype) rows grouped by name pattern (layer / expert indices as *)."""
    groups: dict = {}
    for name, shape, dt in entries:
        key = (_pattern(name), tuple(shape), str(dt))
        groups[key] = groups.get(key, 0) + 1
    width = max((len(k[0]) for k in groups), default=0)
    return [f"  {pat:<{width}}  {list(shape)!s:<20} {dt:<9} x{n}" for (pat, shape, dt), n in groups.items()]


def _wiring_lines(spec: ModelSpec, target_cfg=None) -> list[str]:
    cfg = spec.cfg
    if spec.kind == TARGET:
        q = "null" if cfg.q_lora_rank is None else cfg.q_lora_rank
        return [
            f"layers {cfg.num_hidden_layers} (first {cfg.first_k_dense_replace} dense), hidden {cfg.hidden_size}, "
            f"heads {cfg.num_attention_heads}, q_lora {q}, kv_lora {cfg.kv_lora_rank}, vocab {cfg.vocab_size}",
            f"experts {cfg.n_routed_experts} routed + {cfg.n_shared_experts} shared, top {cfg.num_experts_per_tok}, "
            f"groups {cfg.n_group} keep {cfg.topk_group}, rope {cfg.rope.rope_type}",
            f"default EAGLE-3 aux layer ids for a draft: {list(cfg.default_aux_layer_ids())}",
        ]
    n_aux = spec.wiring["n_aux"]
    ids = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None
    fc_in = n_aux * cfg.target_hidden_size
    lines = [
        f"aux layer ids: {ids if ids is not None else 'not in config (the target default [1, L//2-1, L-4] applies)'}",
        f"fc: [{fc_in} -> {cfg.hidden_size}] = {n_aux} aux states x target hidden {cfg.target_hidden_size}",
        f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}), "
        f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, draft vocab {cfg.draft_vocab_size}",
        f"vocab maps: {', '.join(spec.wiring['vocab_maps']) or 'none'}; "
        f"own embedding: {'yes' if spec.wiring['own_embedding'] else 'no (uses the target embedding)'}",
    ]
    if ids is not None and len(ids) != n_aux:
        lines.append(f"WARNING: config lists {len(ids)} aux layer ids but fc takes {n_aux} aux states")
    return lines


def _memory_lines(spec: ModelSpec) -> list[str]:
    """Bytes ``load_target`` allocates for each kind of weight (one copy, before any replication)."""
    if spec.kind != TARGET:
        return []
    from eagle3_jax.models.footprint import weight_bytes_by_kind
    from eagle3_jax.models.target import Target

    cfg, layout = spec.cfg, spec.quant
    by_kind = weight_bytes_by_kind(nnx.eval_shape(lambda: Target(cfg, jnp.bfloat16, None, quant=layout)))
    width = max(len(k) for k in by_kind)
    head = (f"in memory with weights=native, dtype=bfloat16 ({layout.name if layout else 'nothing quantized'}): "
            f"{sum(by_kind.values()) / 1e9:.3f} GB")
    return [head] + [f"  {k:<{width}}  {v / 1e9:10.3f} GB" for k, v in by_kind.items()]


def inspect(path) -> str:
    path = Path(path)
    out = [f"path: {path}"]
    if store.is_jax_checkpoint(path):
        meta = store.read_meta(path)
        spec = jax_spec(path, meta)
        params = meta["params"]
        n = sum(math.prod(e["shape"]) for e in params.values())
        nbytes = sum(math.prod(e["shape"]) * jnp.dtype(e["dtype"]).itemsize for e in params.values())
        out += [f"format: eagle3-jax checkpoint v{meta['format_version']} ({len(meta['parts'])} orbax part(s))",
                f"kind: {meta['kind']}   architecture: {meta['architecture']}   dtype: {meta['dtype']}"]
        out += _wiring_lines(spec)
        out.append(f"parameters: {n:,} values in {len(params)} arrays, {nbytes / 1e9:.3f} GB")
        out += _memory_lines(spec)
        deq = meta["hf"].get("dequantized") or {}
        if deq:
            out.append("dequantized from: " + ", ".join(f"{v} {k} tensors" for k, v in deq.items())
                       + " (to-hf writes them as bf16, not requantized)")
        dropped = meta["hf"].get("dropped") or []
        out.append(f"dropped on conversion (not used by the model): {len(dropped)} tensor(s)"
                   + (f", e.g. {dropped[:3]}" if dropped else ""))
        out.append("arrays:")
        out += _summarize((name, e["shape"], e["dtype"]) for name, e in params.items())
        return "\n".join(out)
    with CheckpointReader(path) as reader:
        spec = hf_spec(path, reader)
        scheme = quant.QuantScheme.from_hf_config(spec.hf_config)
        dropped = check_keys(reader.keys(), spec.rules, prefix=spec.prefix, ignore=spec.ignore, where=str(path))
        codes = Counter(reader.dtype_code(k) for k in reader.keys())
        n_model = sum(math.prod(v.value.shape) for v in spec.flat.values())
        out += [f"format: Hugging Face safetensors ({len(reader.files)} file(s), {reader.total_bytes() / 1e9:.3f} GB)",
                f"kind: {spec.kind}   architecture: {spec.architecture}"]
        out += _wiring_lines(spec)
        out.append(f"quantization: {scheme.method or 'none'}"
                   + (f" (block {scheme.fp8_block[0]}x{scheme.fp8_block[1]})" if scheme.method == "fp8" else "")
                   + (f" (INT4 group {scheme.int4_group})" if scheme.method == "compressed-tensors" else ""))
        out.append(f"tensors: {len(reader)} (" + ", ".join(f"{c} {n}" for c, n in codes.most_common()) + ")")
        out.append(f"parameters used by the model: {n_model:,}")
        out += _memory_lines(spec)
        out.append(f"not used (dropped by to-jax): {len(dropped)} tensor(s)" + (f", e.g. {dropped[:3]}" if dropped else ""))
        out.append("tensors:")
        out += _summarize((k, reader.shape(k), reader.dtype_code(k)) for k in reader.keys())
        return "\n".join(out)
