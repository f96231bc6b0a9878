"""Quantized twins of a float checkpoint: INT4 routed experts written by the compressed-tensors
package itself (Kimi-K2.5 style) and block-scaled FP8 (DeepSeek-V3 style), each with a float
reference checkpoint holding exactly the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter

FP8 = ml_dtypes.float8_e4m3fn


def read_all(path) -> dict:
    with CheckpointReader(path) as r:
        return {k: r.read(k) for k in r.keys()}


def write_checkpoint(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True)
    with CheckpointWriter(path) as w:
        for k, v in tensors.items():
            w.add(k, v)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def is_routed_expert(key: str) -> bool:
    return ".mlp.experts." in key and key.endswith("_proj.weight")


def is_fp8_linear(key: str) -> bool:
    return key.endswith("_proj.weight") or key.endswith("_proj_with_mqa.weight")


def int4_config(group_size: int = 32, **weights) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}
    args.update(weights)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}


def int4_pair(src: Path, root: Path, group_size: int = 32):
    """(INT4 dir, reference dir): routed experts quantized and packed by compressed-tensors'
    ``PackedQuantizationCompressor``; the reference holds the library's own dequantization."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = json.loads((src / "config.json").read_text())
    qt, ref = {}, {}
    for k, w in read_all(src).items():
        if not is_routed_expert(k):
            qt[k] = ref[k] = w
            continue
        wt = torch.from_numpy(np.asarray(w, np.float32))
        groups = wt.reshape(wt.shape[0], -1, group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": wt, "weight_scale": scale,
                                                        "weight_zero_point": zero}, scheme)
        base = k[: -len(".weight")]
        for name, t in packed.items():
            qt[f"{base}.{name}"] = t.numpy()
        ref[k] = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"].numpy()
    qconfig = dict(config, quantization_config=int4_config(group_size))
    return write_checkpoint(root / "int4", qt, qconfig), write_checkpoint(root / "int4-ref", ref, config)


def fp8_quantize(w: np.ndarray, block):
    """Per-tile absmax scaling into float8_e4m3fn (448 = its largest finite value)."""
    bo, bi = block
    rows, cols = w.shape
    scale = np.zeros((-(-rows // bo), -(-cols // bi)), np.float32)
    q = np.empty(w.shape, FP8)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].astype(np.float32)
            scale[r, c] = max(float(np.abs(tile).max()), 1e-8) / 448.0
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (tile / scale[r, c]).astype(FP8)
    return q, scale


def fp8_pair(src: Path, root: Path, block=(16, 16)):
    """(FP8 dir, reference dir): every projection (attention, dense MLP, shared and routed experts)
    block-scaled FP8 as DeepSeek-V3 ships them; the reference holds fp8 * scale in float32."""
    config = json.loads((src / "config.json").read_text())
    qt, ref = {}, {}
    for k, w in read_all(src).items():
        if is_fp8_linear(k):
            q, s = fp8_quantize(w, block)
            qt[k], qt[k + "_scale_inv"] = q, s
            full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
            ref[k] = q.astype(np.float32) * full
        else:
            qt[k] = ref[k] = w
    qconfig = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": list(block)})
    return write_checkpoint(root / "fp8", qt, qconfig), write_checkpoint(root / "fp8-ref", ref, config)
