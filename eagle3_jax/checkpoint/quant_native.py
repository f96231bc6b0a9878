"""Loading quantized checkpoints *as stored*: which weights stay quantized, and the rule table for them.

``detect_layout`` reads headers only and answers with a ``QuantLayout`` (routed experts INT4 or
FP8, dense linears FP8, or nothing quantized). ``native_rules`` rewrites ``target_map``'s rules
so that every quantized weight maps its on-disk tensors one to one onto the values / scales of
its container in ``models.quantized``: no dequantization, no transpose, the same words. The same
rules run backwards for export, which is why a round trip is byte-identical.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from eagle3_jax.checkpoint import quant
from eagle3_jax.checkpoint.target_map import Rule, target_rules
from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.quant_format import NATIVE_INT4_GROUP, QuantLayout

EXPERT_PATHS = ("w_gate", "w_up", "w_down")
WEIGHTS_CHOICES = ("native", "bfloat16")


def role(rule: Rule) -> str | None:
    """"experts" for routed expert stacks, "linears" for dense projections, None otherwise
    (embeddings, norms, router, lm_head stay as stored in every published checkpoint)."""
    if rule.path[-1] in EXPERT_PATHS:
        return "experts"
    if rule.hf_keys[0].endswith(("_proj.weight", "_proj_with_mqa.weight")):
        return "linears"
    return None


def check_native_config(hf_config: Mapping[str, Any] | None, where: str) -> None:
    """Refuses a quantization_config whose weights cannot be held natively, naming the field: what
    dequantizes fine (``quant.QuantScheme`` refuses the rest) but has no native kernel."""
    q = quant.quantization_config(hf_config)
    if not q or q.get("quant_method") != "compressed-tensors":
        return
    for name, g in (q.get("config_groups") or {}).items():
        size = ((g or {}).get("weights") or {}).get("group_size")
        if size is not None and int(size) != NATIVE_INT4_GROUP:
            raise ConfigError(
                f"{where}: quantization_config.config_groups.{name}.weights.group_size is {size}; weights "
                f"are held natively only for INT4 group size {NATIVE_INT4_GROUP} (Kimi-K2.5). Load with "
                "weights='bfloat16' (or convert with --weights bfloat16) to dequantize them instead")


def detect_layout(reader, cfg: TargetConfig, where: str = "") -> QuantLayout | None:
    """What the checkpoint quantizes, from its headers; None when nothing is."""
    scheme = quant.QuantScheme.from_hf_config(cfg.hf_config, where or "config.json")
    kinds: dict[str, set] = {"experts": set(), "linears": set()}
    first: dict[str, str] = {}
    prefix = cfg.weight_prefix
    for rule in target_rules(cfg):
        r = role(rule)
        if r is None:
            continue
        for k in rule.hf_keys:
            kind = quant.classify(reader, prefix + k)
            kinds[r].add(kind)
            if kind != quant.PLAIN:
                first.setdefault(kind, prefix + k)
    for r, found in kinds.items():
        if len(found) > 1:
            raise ConfigError(
                f"{where}: the {r} mix storage kinds {sorted(found)}; weights are held natively only when "
                f"all {r} are stored alike. Load with weights='bfloat16' to dequantize them")
    experts, linears = (next(iter(kinds[r]), quant.PLAIN) for r in ("experts", "linears"))
    if linears == quant.INT4:
        raise ConfigError(
            f"{where}: dense projections are INT4 (e.g. {first[quant.INT4]}); INT4 is held natively only "
            "for routed experts. Load with weights='bfloat16' to dequantize them")
    if experts == linears == quant.PLAIN:
        return None
    fields: dict[str, Any] = {"experts": None if experts == quant.PLAIN else experts,
                              "linears": None if linears == quant.PLAIN else linears}
    if quant.INT4 in first:
        check_native_config(cfg.hf_config, where or "config.json")
        k = first[quant.INT4]
        fields.update(int4_group=scheme.int4_group, int4_scale_dtype=np.dtype(reader.dtype(k + "_scale")).name,
                      int4_shape_dtype=np.dtype(reader.dtype(k + "_shape")).name)
    if quant.FP8 in first:
        fields.update(fp8_block=tuple(scheme.fp8_block),
                      fp8_scale_dtype=np.dtype(reader.dtype(first[quant.FP8] + "_scale_inv")).name)
    return QuantLayout(**fields)


class NativeRule(Rule):
    """A rule whose on-disk tensors are read and written as stored (quantized values or scales)."""


def _int4_rules(rule: Rule, out: int, cols: int, shape_dtype: str) -> list[Rule]:
    keys = rule.hf_keys
    E = len(keys)

    def scale_to_ours(a):
        bad = [keys[i] for i in range(E) if tuple(int(x) for x in a[E + i].reshape(-1)) != (out, cols)]
        if bad:
            raise ValueError(f"weight_shape of {bad[0]} is {a[E].reshape(-1).tolist()}, config implies {[out, cols]}")
        return np.stack(a[:E])

    def scale_to_hf(w):
        return list(w) + [np.array([out, cols], np.dtype(shape_dtype)) for _ in range(E)]

    return [NativeRule(rule.path + ("packed",), tuple(k + "_packed" for k in keys), np.stack, list),
            NativeRule(rule.path + ("scale",), tuple(k + "_scale" for k in keys) + tuple(k + "_shape" for k in keys),
                 scale_to_ours, scale_to_hf)]


def _fp8_rules(rule: Rule, stacked: bool) -> list[Rule]:
    keys = rule.hf_keys
    if stacked:
        to_ours, to_hf = np.stack, list
    else:
        to_ours, to_hf = (lambda a: a[0]), (lambda w: [w])
    return [NativeRule(rule.path + ("weight",), keys, to_ours, to_hf),
            NativeRule(rule.path + ("scale_inv",), tuple(k + "_scale_inv" for k in keys), to_ours, to_hf)]


def native_rules(cfg: TargetConfig, layout: QuantLayout | None) -> list[Rule]:
    """``target_rules`` with every quantized weight mapped onto its container's arrays."""
    rules = target_rules(cfg)
    if layout is None:
        return rules
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    out = []
    for rule in rules:
        r = role(rule)
        if r == "experts" and layout.experts == "int4":
            o, i = (D, F) if rule.path[-1] == "w_down" else (F, D)
            out += _int4_rules(rule, o, i, layout.int4_shape_dtype)
        elif r == "experts" and layout.experts == "fp8":
            out += _fp8_rules(rule, stacked=True)
        elif r == "linears" and layout.linears == "fp8":
            out += _fp8_rules(rule, stacked=False)
        else:
            out.append(rule)
    return out


def native_reader(cfg: TargetConfig, rules, dtype=None, where: str = "") -> Callable[[Any, str], np.ndarray]:
    """``read=`` hook: tensors a native rule names are read as stored (words, fp8, scales);
    everything else through the dequantizing reader, exactly as a bf16 load reads it."""
    raw = {cfg.weight_prefix + k for rule in rules if isinstance(rule, NativeRule) for k in rule.hf_keys}
    dequant = quant.dequantizing_reader(cfg.hf_config, dtype, where=where or "config.json")

    def read(reader, key):
        return reader.read(key) if key in raw else dequant(reader, key)

    return read


def layout_from_config(cfg: TargetConfig) -> QuantLayout | None:
    """The layout ``load_target`` will hold for a checkpoint of this config.json, without its
    tensors (for planning): compressed-tensors INT4 -> INT4 routed experts with bf16 scales (as
    Kimi-K2.5 ships them); block FP8 -> FP8 experts and linears with float32 scales (DeepSeek-V3)."""
    scheme = quant.QuantScheme.from_hf_config(cfg.hf_config)
    if scheme.method == "compressed-tensors":
        check_native_config(cfg.hf_config, "config.json")
        return QuantLayout(experts="int4", int4_group=scheme.int4_group)
    if scheme.method == "fp8":
        return QuantLayout(experts="fp8", linears="fp8", fp8_block=tuple(scheme.fp8_block))
    return None
