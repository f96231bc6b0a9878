"""Checkpoint conversion (python -m tools.convert): byte-identical round trips, logits of converted
targets, FP8 / INT4 dequantization against quantizers written here from the formats' public
descriptions, every failure mode, and crash safety."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.checkpoint import quant, store
from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
from eagle3_jax.errors import CheckpointError
from tools.convert import core
from tools.convert.inspect import inspect as inspect_checkpoint
from tools.convert.__main__ import main as cli_main

REPO = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------- helpers
def read_all(path) -> dict:
    with CheckpointReader(path) as r:
        return {k: r.read(k) for k in r.keys()}


def write_checkpoint(path: Path, tensors: dict, config: dict, max_shard="5GB") -> Path:
    path.mkdir(parents=True)
    with CheckpointWriter(path, max_shard_bytes=max_shard) as w:
        for k, v in tensors.items():
            w.add(k, v)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def variant(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """A copy of checkpoint ``src`` with tensors and/or config edited in place by the callbacks."""
    tensors = read_all(src)
    config = json.loads((src / "config.json").read_text())
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    return write_checkpoint(dst, tensors, config)


def assert_same_tensors(a, b, allow_missing=()):
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert set(ra.keys()) - set(allow_missing) == set(rb.keys())
    for k in rb.keys():
        assert (ra.dtype_code(k), ra.shape(k)) == (rb.dtype_code(k), rb.shape(k)), k
        assert ra.read(k).tobytes() == rb.read(k).tobytes(), k


def to_jax(src, dst, **kw):
    return core.to_jax(src, dst, progress=False, **kw)


def to_hf(src, dst, **kw):
    return core.to_hf(src, dst, progress=False, **kw)


def flat_params(loaded) -> dict:
    return {tuple(p): np.asarray(v.value) for p, v in nnx.to_flat_state(loaded.state)}


def no_leftovers(dst: Path):
    return not dst.exists() and not list(dst.parent.glob(dst.name + ".tmp-*"))


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(0).integers(0, 256, size=(2, 9))


@pytest.fixture(scope="module")
def converted(hf_target_dirs, tmp_path_factory):
    """name -> (hf dir, jax dir, exported hf dir) for a target with q_lora set and one with q_lora null."""
    out = {}
    root = tmp_path_factory.mktemp("converted")
    for name in ("qlora_groups_yarn", "noqlora_plain_rope"):
        src = hf_target_dirs[name][0]
        to_jax(src, root / f"{name}.jax")
        to_hf(root / f"{name}.jax", root / f"{name}.hf", max_shard_size="300KB")
        out[name] = (src, root / f"{name}.jax", root / f"{name}.hf")
    return out


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", ["qlora_groups_yarn", "noqlora_plain_rope"])
def test_round_trip_is_byte_identical(converted, name):
    src, jax_dir, back = converted[name]
    assert_same_tensors(src, back)
    assert (back / "model.safetensors.index.json").is_file()  # sharded at 300KB
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (back / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    meta = store.read_meta(jax_dir)
    assert meta["kind"] == "target" and meta["dtype"] == "source" and meta["hf"]["dropped"] == []


def test_round_trip_bf16_with_mixed_dtypes(hf_target_dirs, tmp_path):
    """bf16 weights beside an fp32 router bias, and one expert stack mixing bf16 and fp32 tensors."""
    odd = "model.layers.2.mlp.experts.3.up_proj.weight"

    def to_bf16(t):
        for k in t:
            if not k.endswith("e_score_correction_bias") and k != odd:
                t[k] = t[k].astype(BF16)

    src = variant(hf_target_dirs["qlora_groups_yarn"][0], tmp_path / "bf16", to_bf16)
    meta = to_jax(src, tmp_path / "jax")
    params = meta["params"]
    assert params["layers.1.self_attn.q_a_proj"]["dtype"] == "bfloat16"
    assert params["layers.1.mlp.e_score_correction_bias"]["dtype"] == "float32"
    assert params["layers.2.mlp.w_up"]["dtype"] == "float32"  # widened to hold its fp32 member
    assert meta["hf"]["dtypes"]["model.layers.2.mlp.experts.0.up_proj.weight"] == "BF16"
    to_hf(tmp_path / "jax", tmp_path / "back")
    assert_same_tensors(src, tmp_path / "back")
    # loading casts each stored dtype to the requested one, exactly as loading the HF dir does
    got, ref = (flat_params(e3.load_target(d, dtype="bfloat16")) for d in (tmp_path / "jax", src))
    for path in ref:
        np.testing.assert_array_equal(got[path], ref[path], err_msg=str(path))


def test_dtype_flag_casts_and_export_restores_source_dtypes(hf_target_dirs, tmp_path):
    src = hf_target_dirs["noqlora_plain_rope"][0]
    meta = to_jax(src, tmp_path / "jax", dtype="bfloat16")
    assert meta["params"]["lm_head"]["dtype"] == "bfloat16"
    assert meta["params"]["layers.2.mlp.gate"]["dtype"] == "float32"  # routers stay float32
    to_hf(tmp_path / "jax", tmp_path / "back")
    a, b = read_all(src), read_all(tmp_path / "back")
    for k in a:
        assert b[k].dtype == a[k].dtype, k
        router = k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias")
        np.testing.assert_array_equal(b[k], a[k] if router else a[k].astype(BF16).astype(a[k].dtype), err_msg=k)


# ---------------------------------------------------------------------- logits
@pytest.mark.parametrize("name", ["qlora_groups_yarn", "noqlora_plain_rope"])
def test_converted_target_gives_the_same_logits(converted, prompt_ids, name):
    src, jax_dir, _ = converted[name]
    ref = np.asarray(e3.load_target(src).forward(prompt_ids).logits)
    out = np.asarray(e3.load_target(jax_dir).forward(prompt_ids).logits)
    np.testing.assert_array_equal(out, ref)


def test_restore_onto_expert_mesh(hf_target_dirs, tmp_path, prompt_ids):
    """Saved in many small orbax parts with an 8-way expert layout, restored straight into shards."""
    src = hf_target_dirs["qlora_groups_yarn"][0]
    meta = to_jax(src, tmp_path / "jax", mesh="data=1,expert=8,tensor=1", part_size="40KB")
    assert len(meta["parts"]) > 3
    mesh = e3.make_mesh("data=1,expert=8,tensor=1")
    target = e3.load_target(tmp_path / "jax", mesh=mesh)
    w = target.model.layers[1].mlp.w_gate.value
    assert w.sharding.spec[0] == "expert" and len({str(s.index) for s in w.addressable_shards}) == 8
    ref = np.asarray(e3.load_target(src).forward(prompt_ids).logits)
    np.testing.assert_allclose(np.asarray(target.forward(prompt_ids).logits), ref, rtol=1e-5, atol=1e-5)


def test_kimi_k25_layout_drops_the_vision_tower(hf_target_dirs, tmp_path):
    """Kimi-K2.5: nested text_config, language_model.* weights beside vision tensors we do not serve."""
    src = hf_target_dirs["noqlora_plain_rope"][0]
    tensors = {"language_model." + k: v for k, v in read_all(src).items()}
    tensors["vision_tower.patch_embed.weight"] = np.ones((4, 4), BF16)
    tensors["mm_projector.proj.weight"] = np.ones((2, 4), BF16)
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": {"hidden_size": 4}}
    kimi = write_checkpoint(tmp_path / "kimi", tensors, config)
    meta = to_jax(kimi, tmp_path / "jax")
    assert meta["architecture"] == "KimiK25ForConditionalGeneration"
    assert meta["hf"]["dropped"] == ["mm_projector.proj.weight", "vision_tower.patch_embed.weight"]
    assert "dropped on conversion (not used by the model): 2 tensor(s)" in inspect_checkpoint(tmp_path / "jax")
    to_hf(tmp_path / "jax", tmp_path / "back")
    assert_same_tensors(kimi, tmp_path / "back", allow_missing=meta["hf"]["dropped"])
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config


# ---------------------------------------------------------------------- FP8 / INT4: the math
def fp8_quantize(w: np.ndarray, block):
    """Reference block quantizer: scale = amax / 448 per tile, q = w / scale rounded to e4m3."""
    bo, bi = block
    R, C = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = np.ones((R, C), np.float32)
    q = np.empty(w.shape, FP8)
    for r in range(R):
        for c in range(C):
            tile = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = max(float(np.abs(tile).max()), 1e-12) / 448.0
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (tile / scale[r, c]).astype(FP8)
    return q, scale


def fp8_reference(q, scale, block):
    full = np.kron(scale, np.ones(block, np.float32))[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


def int4_pack(q: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized, from its description: value + 8 as a nibble, eight per
    32-bit word along the input dim, column c at bits 4*(c % 8) of word c // 8, zero padding."""
    rows, cols = q.shape
    u = np.zeros((rows, -(-cols // 8) * 8), np.uint32)
    u[:, :cols] = (q.astype(np.int32) + 8).astype(np.uint32)
    words = np.zeros((rows, u.shape[1] // 8), np.uint32)
    for j in range(8):
        words |= u[:, j::8] << np.uint32(4 * j)
    return words.view(np.int32)


def test_fp8_dequant_partial_edge_blocks():
    w = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)
    q, s = fp8_quantize(w, (128, 128))
    assert s.shape == (3, 2)
    out = quant.dequant_fp8_block(q, s, (128, 128))
    np.testing.assert_array_equal(out, fp8_reference(q, s, (128, 128)))
    # within e4m3's rounding: 3 mantissa bits (relative 2^-4), subnormal step 2^-9 x scale
    tol = np.abs(w) * 2.0 ** -4 + np.kron(s, np.ones((128, 128)))[:300, :200] * 2.0 ** -9
    assert np.all(np.abs(out - w) <= tol)
    with pytest.raises(CheckpointError, match="scale_inv"):
        quant.dequant_fp8_block(q, s[:, :1], (128, 128), "x.weight")


def test_int4_layout_matches_the_published_description():
    # signed 0..7 are stored as nibbles 8..15, least significant first: 0xFEDCBA98 as int32
    word = np.array([[0xFEDCBA98]], np.uint32).view(np.int32)
    np.testing.assert_array_equal(quant.unpack_int4(word, 8), [[0, 1, 2, 3, 4, 5, 6, 7]])
    # -8 is nibble 0, -1 is nibble 7: word 0x70000000 + 0x0 -> [-8] * 7 + [-1]
    word = np.array([[0x70000000]], np.uint32).view(np.int32)
    np.testing.assert_array_equal(quant.unpack_int4(word, 8), [[-8] * 7 + [-1]])


def test_int4_dequant_is_exact_with_padding_and_groups():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, size=(6, 44))                        # 44 columns: last word half padding
    scale = rng.uniform(0.01, 0.1, size=(6, 2)).astype(BF16)    # ceil(44 / 32) groups
    packed = int4_pack(q)
    assert packed.shape == (6, 6)
    out = quant.dequant_int4(packed, scale, (6, 44), 32)
    expected = q.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=1)[:, :44]
    np.testing.assert_array_equal(out, expected)


# ---------------------------------------------------------------------- FP8 / INT4 checkpoints
def is_fp8_target(key):
    return key.endswith("_proj.weight") or key.endswith("_proj_with_mqa.weight")


def is_routed_expert(key):
    return ".mlp.experts." in key


def quantized_pair(src: Path, root: Path, kind: str):
    """(quantized dir, float32 reference dir holding exactly the dequantized weights)."""
    tensors = read_all(src)
    config = json.loads((src / "config.json").read_text())
    qt, ref = {}, {}
    rng = np.random.default_rng(7)
    for k, w in tensors.items():
        if kind == "fp8" and is_fp8_target(k):
            q, s = fp8_quantize(w, (16, 16))
            qt[k], qt[k + "_scale_inv"] = q, s
            ref[k] = fp8_reference(q, s, (16, 16))
        elif kind == "int4" and is_routed_expert(k):
            q = rng.integers(-8, 8, size=w.shape)
            s = (np.abs(w).reshape(w.shape[0], -1, 32).max(-1) / 7 + 1e-3).astype(BF16)
            qt[k + "_packed"], qt[k + "_scale"] = int4_pack(q), s
            qt[k + "_shape"] = np.array(w.shape, np.int64)
            ref[k] = q.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=1)
        else:
            qt[k] = ref[k] = w
    qconfig = dict(config)
    if kind == "fp8":
        qconfig["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [16, 16]}
    else:
        qconfig["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
    return (write_checkpoint(root / f"{kind}", qt, qconfig),
            write_checkpoint(root / f"{kind}-ref", ref, config))


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_checkpoint_loads_and_converts(hf_target_dirs, tmp_path, kind):
    src = hf_target_dirs["qlora_groups_yarn"][0]
    qdir, ref_dir = quantized_pair(src, tmp_path, kind)
    # loads directly as a target: every parameter equals the independently dequantized reference
    got, ref = flat_params(e3.load_target(qdir, weights="bfloat16")), flat_params(e3.load_target(ref_dir))
    for path in ref:
        np.testing.assert_array_equal(got[path], ref[path], err_msg=str(path))
    # to-jax dequantizes to bf16; to-hf writes bf16 weights and drops quantization_config
    meta = to_jax(qdir, tmp_path / "jax", weights="bfloat16")
    n_quantized = sum(1 for k in read_all(ref_dir) if (is_fp8_target(k) if kind == "fp8" else is_routed_expert(k)))
    assert meta["hf"]["dequantized"] == {kind: n_quantized}
    assert meta["params"]["layers.1.mlp.w_up"]["dtype"] == "bfloat16"
    to_hf(tmp_path / "jax", tmp_path / "back")
    back, reference = read_all(tmp_path / "back"), read_all(ref_dir)
    assert set(back) == set(reference)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    k = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert back[k].dtype == BF16
    np.testing.assert_array_equal(back[k], reference[k].astype(BF16))


def test_unsupported_quantization_config_is_refused(hf_target_dirs, tmp_path):
    def asym(c):
        c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"g": {"weights": {"num_bits": 4, "symmetric": False}}}}
    src = variant(hf_target_dirs["qlora_groups_yarn"][0], tmp_path / "asym", config_edit=asym)
    with pytest.raises(CheckpointError, match="symmetric"):
        e3.load_target(src)


# ---------------------------------------------------------------------- failures
def _drop(key):
    return lambda t: t.pop(key)


def _truncate(path: Path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _lie_about_offsets(path: Path):
    f = path / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


FAILURES = {
    "missing": (dict(edit=_drop("model.layers.2.mlp.experts.5.up_proj.weight")),
                None, "model.layers.2.mlp.experts.5.up_proj.weight"),
    "unexpected": (dict(edit=lambda t: t.update({"model.layers.1.self_attn.extra_proj.weight": np.zeros(3, np.float32)})),
                   None, "model.layers.1.self_attn.extra_proj.weight"),
    "shape_vs_config": (dict(config_edit=lambda c: c.update(q_lora_rank=24)),
                        None, "model.layers.0.self_attn.q_a_proj.weight"),
    "dtype": (dict(edit=lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int16)})),
              None, "model.norm.weight"),
    "fp8_without_scale": (dict(edit=lambda t: t.update({"lm_head.weight": t["lm_head.weight"].astype(FP8)})),
                          None, "lm_head.weight"),
    "truncated": ({}, _truncate, "'"),
    "lying_header": ({}, _lie_about_offsets, "model.norm.weight"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_bad_checkpoints_raise_checkpoint_error_naming_the_tensor(hf_target_dirs, tmp_path, failure):
    edits, damage, name = FAILURES[failure]
    src = variant(hf_target_dirs["qlora_groups_yarn"][0], tmp_path / "bad", **edits)
    if damage:
        damage(src)
    with pytest.raises(CheckpointError) as err:
        to_jax(src, tmp_path / "out")
    assert name in str(err.value)
    if failure == "truncated":  # names the tensor whose bytes are cut off
        assert any(f"'{k}'" in str(err.value) for k in read_all(hf_target_dirs["qlora_groups_yarn"][0]))
    assert no_leftovers(tmp_path / "out")
    if failure in ("missing", "dtype"):
        with pytest.raises(CheckpointError, match=name):
            e3.load_target(src)


def test_jax_checkpoint_that_disagrees_with_its_config(converted, tmp_path):
    jax_dir = tmp_path / "jax"
    shutil.copytree(converted["qlora_groups_yarn"][1], jax_dir)
    config = json.loads((jax_dir / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (jax_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.w_gate: stored \(8, 64, 32\)"):
        e3.load_target(jax_dir)


def test_failed_export_leaves_nothing(converted, tmp_path, monkeypatch):
    real = store.iter_params

    def failing(directory):
        for i, item in enumerate(real(directory)):
            if i == 5:
                raise OSError("disk full")
            yield item

    monkeypatch.setattr(store, "iter_params", failing)
    with pytest.raises(OSError, match="disk full"):
        to_hf(converted["qlora_groups_yarn"][1], tmp_path / "out")
    assert no_leftovers(tmp_path / "out")


def test_existing_destination_needs_overwrite(hf_target_dirs, tmp_path, capsys):
    src = hf_target_dirs["noqlora_plain_rope"][0]
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        to_jax(src, dst)
    assert (dst / "keep.txt").read_text() == "mine"
    assert cli_main(["to-jax", str(src), str(dst), "--no-progress"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["to-jax", str(src), str(dst), "--no-progress", "--overwrite"]) == 0
    assert store.is_jax_checkpoint(dst) and not (dst / "keep.txt").exists()
    assert not list(tmp_path.glob("dst.*"))


def test_interrupted_conversion_leaves_nothing_complete(hf_target_dirs, tmp_path):
    src = hf_target_dirs["qlora_groups_yarn"][0]
    dst = tmp_path / "killed"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{core.PAUSE_ENV: "30"})
    proc = subprocess.Popen([sys.executable, "-m", "tools.convert", "to-jax", str(src), str(dst), "--no-progress",
                             "--part-size", "20KB"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        for line in proc.stderr:
            if "paused after 30 parameters" in line or time.time() > deadline:
                break
        assert proc.poll() is None, "the converter exited instead of pausing"
        staged = list(tmp_path.glob("killed.tmp-*"))
        assert len(staged) == 1 and list((staged[0] / "params").iterdir())  # parts were written
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not dst.exists()
    assert not store.is_jax_checkpoint(staged[0]) and not (staged[0] / "config.json").exists()
    with pytest.raises((CheckpointError, e3.ConfigError)):
        e3.load_target(staged[0])
    to_jax(src, dst)  # a fresh run is unaffected by the debris
    assert store.is_jax_checkpoint(dst)


# ---------------------------------------------------------------------- inspect / CLI
def test_inspect_both_formats(converted, capsys):
    src, jax_dir, _ = converted["noqlora_plain_rope"]
    assert cli_main(["inspect", str(jax_dir)]) == 0
    text = capsys.readouterr().out
    assert "kind: target" in text and "DeepseekV3ForCausalLM" in text and "q_lora null" in text
    assert "layers.*.mlp.w_gate" in text and "[8, 64, 32]" in text
    hf_text = inspect_checkpoint(src)
    assert "Hugging Face safetensors" in hf_text and "model.layers.*.mlp.experts.*.gate_proj.weight" in hf_text
    n = sum(v.size for v in read_all(src).values())
    assert f"parameters used by the model: {n:,}" in hf_text


# ---------------------------------------------------------------------- drafts
def bf16_specforge_draft(src: Path, dst: Path) -> Path:
    """A SpecForge-style bf16 draft with its own embedding and no t2d (SGLang reads only d2t)."""
    def edit(t):
        for k in t:
            if t[k].dtype == np.float32:
                t[k] = t[k].astype(BF16)
        t["embed_tokens.weight"] = np.random.default_rng(0).normal(size=(256, 64)).astype(BF16)
        del t["t2d"]
    return variant(src, dst, edit)


def test_draft_round_trip_is_byte_identical_and_loads(random_draft_dir, tiny_target, tmp_path, capsys):
    ids = np.random.default_rng(4).integers(0, 256, size=(2, 5))
    aux = np.random.default_rng(5).normal(size=(2, 5, 3 * 64)).astype(np.float32)
    for name, src in (("fixture", random_draft_dir), ("bf16", bf16_specforge_draft(random_draft_dir, tmp_path / "d"))):
        meta = to_jax(src, tmp_path / f"{name}.jax")
        assert meta["kind"] == "draft" and meta["params"]["d2t"]["dtype"] == "int32"
        to_hf(tmp_path / f"{name}.jax", tmp_path / f"{name}.back")
        assert_same_tensors(src, tmp_path / f"{name}.back")
        assert CheckpointReader(tmp_path / f"{name}.back").dtype_code("d2t") == "I64"
        # the converted draft loads, wires and computes exactly like the original
        a, b = e3.load_draft(src, tiny_target), e3.load_draft(tmp_path / f"{name}.jax", tiny_target)
        assert a.aux_layer_ids == b.aux_layer_ids
        np.testing.assert_array_equal(np.asarray(a.model.t2d[...]), np.asarray(b.model.t2d[...]))
        np.testing.assert_array_equal(np.asarray(a.forward(ids, aux).logits), np.asarray(b.forward(ids, aux).logits))
    assert "t2d" not in CheckpointReader(tmp_path / "bf16.back")
    assert cli_main(["inspect", str(tmp_path / "bf16.jax")]) == 0
    text = capsys.readouterr().out
    assert "kind: draft" in text and "aux layer ids: [0, 1, 2]" in text
    assert "fc: [192 -> 64] = 3 aux states x target hidden 64" in text and "own embedding: yes" in text
