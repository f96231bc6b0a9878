"""Tests for the streaming safetensors reader/writer (eagle3_jax.checkpoint.safetensors_{format,writer}, checkpoint_reader)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_np

from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader, SafetensorsFile
from eagle3_jax.checkpoint.safetensors_format import DTYPES, INDEX_FILE_NAME, SINGLE_FILE_NAME, dtype_code, parse_size
from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
from eagle3_jax.errors import CheckpointError


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    # floats, including ml_dtypes bf16 / f8 (keep f8 values within range)
    return (rng.standard_normal(shape) * 4).astype(np.float32).astype(dt)


ALL_CODES = list(DTYPES)
# dtypes numpy (and hence safetensors.numpy) handles natively.
NATIVE_CODES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64"]


def _assert_same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def _write_raw(path: Path, header: dict, data: bytes, pad: bool = True) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# --------------------------------------------------------------------- round trip


def test_round_trip_all_dtypes(tmp_path):
    tensors = {f"t.{code}": _sample(DTYPES[code], (3, 5), seed=i) for i, code in enumerate(ALL_CODES)}
    tensors["scalar"] = np.array(3.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    tensors["noncontig"] = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    tensors["bigendian"] = np.arange(6, dtype=">f4").reshape(2, 3)
    with CheckpointWriter(tmp_path / "ckpt") as w:
        for k, v in tensors.items():
            w.add(k, v)
    assert w.files == [tmp_path / "ckpt" / SINGLE_FILE_NAME]
    assert not (tmp_path / "ckpt" / INDEX_FILE_NAME).exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [SINGLE_FILE_NAME]  # no temp files left

    with SafetensorsFile(tmp_path / "ckpt" / SINGLE_FILE_NAME) as f:
        assert f.keys() == list(tensors)  # file order == add order
        assert f.metadata == {"format": "pt"}
        for k, v in tensors.items():
            expected = np.asarray(v, order="C").astype(v.dtype.newbyteorder("<"))
            assert f.shape(k) == v.shape
            assert f.dtype(k) == expected.dtype
            assert f.nbytes(k) == expected.nbytes
            got = f.read(k)
            _assert_same(got, expected)
            assert got.flags.writeable and not isinstance(got, np.memmap)
        assert f.dtype("t.BF16") == np.dtype(ml_dtypes.bfloat16)
        assert f.dtype("t.F8_E4M3") == np.dtype(ml_dtypes.float8_e4m3fn)
        assert f.dtype("t.F8_E5M2") == np.dtype(ml_dtypes.float8_e5m2)
        assert f.dtype_code("t.F8_E4M3") == "F8_E4M3"
    assert f._fh is None

    r = CheckpointReader(tmp_path / "ckpt")
    assert r.keys() == sorted(tensors)
    assert "t.BF16" in r and "nope" not in r
    _assert_same(r.read("t.BF16"), tensors["t.BF16"])
    with pytest.raises(KeyError, match="did you mean"):
        r.read("t.BF1")
    r.close()


def test_read_returns_owned_array(tmp_path):
    path = tmp_path / "x.safetensors"
    st_np.save_file({"a": np.arange(10, dtype=np.float32)}, str(path))
    f = SafetensorsFile(path)
    a = f.read("a")
    f.close()
    assert not isinstance(a, np.memmap)
    a += 1  # writable, independent of the file
    np.testing.assert_array_equal(f.read("a"), np.arange(10, dtype=np.float32))
    f.close()


# --------------------------------------------------------------------- interop


def test_official_reads_ours(tmp_path):
    tensors = {f"w{i}": _sample(DTYPES[c], (2, 3), seed=i) for i, c in enumerate(NATIVE_CODES)}
    tensors["bf16"] = _sample(ml_dtypes.bfloat16, (4,))
    with CheckpointWriter(tmp_path, metadata={"format": "pt", "note": "hi"}) as w:
        for k, v in tensors.items():
            w.add(k, v)
    path = str(tmp_path / SINGLE_FILE_NAME)
    loaded = st_np.load_file(path)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        _assert_same(loaded[k], v)
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "note": "hi"}
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            _assert_same(f.get_tensor(k), v)


def test_official_reads_our_shards(tmp_path):
    tensors = {f"layer.{i}.w": _sample(np.float32, (8, 8), seed=i) for i in range(5)}
    with CheckpointWriter(tmp_path, max_shard_bytes=600) as w:
        for k, v in tensors.items():
            w.add(k, v)
    index = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    seen = {}
    for fname in sorted(set(index["weight_map"].values())):
        seen.update(st_np.load_file(str(tmp_path / fname)))
    assert set(seen) == set(tensors)
    for k, v in tensors.items():
        _assert_same(seen[k], v)


def test_we_read_official(tmp_path):
    tensors = {f"x.{c}": _sample(DTYPES[c], (3, 2), seed=i) for i, c in enumerate(NATIVE_CODES)}
    tensors["bf16"] = _sample(ml_dtypes.bfloat16, (5,))
    tensors["é unicode"] = np.arange(3, dtype=np.int16)
    tensors["scalar"] = np.array(7, np.int64)
    path = tmp_path / "official.safetensors"
    st_np.save_file(tensors, str(path), metadata={"format": "pt", "k": "v"})
    with SafetensorsFile(path) as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata == {"format": "pt", "k": "v"}
        for k, v in tensors.items():
            _assert_same(f.read(k), v)


def test_byte_identical_rewrite_of_official_file(tmp_path):
    tensors = {
        "b.small": np.arange(3, dtype=np.int8),
        "a.weight": _sample(np.float32, (4, 4)),
        "c.double": _sample(np.float64, (2,)),
        "d.half": _sample(np.float16, (3, 1)),
        "e.flag": np.array(True),
        "f.bf16": _sample(ml_dtypes.bfloat16, (2, 2)),
        "g.long": np.arange(4, dtype=np.int64),
    }
    src = tmp_path / "official.safetensors"
    st_np.save_file(tensors, str(src), metadata={"format": "pt"})
    out = tmp_path / "ours"
    with SafetensorsFile(src) as f, CheckpointWriter(out, metadata=f.metadata) as w:
        for k in f.keys():  # file order == the official writer's order
            w.add(k, f.read(k))
    assert (out / SINGLE_FILE_NAME).read_bytes() == src.read_bytes()

    # Same without any metadata.
    st_np.save_file(tensors, str(src))
    out2 = tmp_path / "ours2"
    with SafetensorsFile(src) as f, CheckpointWriter(out2, metadata={}) as w:
        assert f.metadata == {}
        for k in f.keys():
            w.add(k, f.read(k))
    assert (out2 / SINGLE_FILE_NAME).read_bytes() == src.read_bytes()


def test_byte_identical_to_the_official_writer_with_fp8(tmp_path):
    """The official numpy writer handles ml_dtypes F8 too; ours must match it byte for byte."""
    tensors = {
        "w.fp8": _sample(ml_dtypes.float8_e4m3fn, (4, 8)),
        "w.e5m2": _sample(ml_dtypes.float8_e5m2, (3,)),
        "w.scale_inv": _sample(np.float32, (1, 2)),
        "w.bf16": _sample(ml_dtypes.bfloat16, (2, 3)),
    }
    src = tmp_path / "official.safetensors"
    st_np.save_file(tensors, str(src), metadata={"format": "pt"})
    out = tmp_path / "ours"
    with SafetensorsFile(src) as f, CheckpointWriter(out, metadata=f.metadata) as w:
        assert {k: f.dtype_code(k) for k in f.keys()} == {
            "w.scale_inv": "F32", "w.bf16": "BF16", "w.e5m2": "F8_E5M2", "w.fp8": "F8_E4M3"}
        for k in f.keys():
            w.add(k, f.read(k))
    assert (out / SINGLE_FILE_NAME).read_bytes() == src.read_bytes()


def test_header_is_8_byte_aligned(tmp_path):
    with CheckpointWriter(tmp_path) as w:
        w.add("a", np.zeros(3, np.int8))
    raw = (tmp_path / SINGLE_FILE_NAME).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    assert raw[8 : 8 + n].rstrip(b" ").endswith(b"}")


# --------------------------------------------------------------------- sharding


def test_sharding_and_reader(tmp_path):
    tensors = {
        "a": _sample(np.float32, (10,)),  # 40 B
        "b": _sample(np.float32, (10,)),  # 40 B -> 80, fits in 100
        "c": _sample(np.float32, (10,)),  # would be 120 -> new shard
        "big": _sample(np.float64, (30,)),  # 240 B > limit -> own shard
        "d": _sample(ml_dtypes.bfloat16, (4,)),  # new shard after the big one
        "e": _sample(ml_dtypes.float8_e4m3fn, (4,)),
    }
    with CheckpointWriter(tmp_path, max_shard_bytes="100B") as w:
        for k, v in tensors.items():
            w.add(k, v)
    names = [p.name for p in w.files]
    assert names == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
        INDEX_FILE_NAME,
    ]
    index = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    assert index["weight_map"] == {
        "a": names[0], "b": names[0], "c": names[1], "big": names[2], "d": names[3], "e": names[3],
    }
    assert not list(tmp_path.glob(".eagle3-tmp*"))

    with CheckpointReader(tmp_path, max_open_files=2) as r:
        assert r.keys() == sorted(tensors)
        assert r.files == [tmp_path / n for n in names[:4]]
        assert r.metadata["total_size"] == index["metadata"]["total_size"]
        for k, v in tensors.items():
            assert r.shape(k) == v.shape
            assert r.dtype(k) == v.dtype
            assert r.nbytes(k) == v.nbytes
            _assert_same(r.read(k), v)
        assert sum(f._fh is not None for f in r._files.values()) <= 2
        streamed = dict(r.iter_tensors())
        assert list(streamed) == ["a", "b", "c", "big", "d", "e"]  # disk order
        for k, v in tensors.items():
            _assert_same(streamed[k], v)
    assert not any(f._fh is not None for f in r._files.values())


def test_writer_refuses_existing_checkpoint(tmp_path):
    with CheckpointWriter(tmp_path) as w:
        w.add("a", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match="overwrite=True"):
        CheckpointWriter(tmp_path)
    with CheckpointWriter(tmp_path, overwrite=True, max_shard_bytes=8) as w:
        w.add("a", np.ones(2, np.float32))
        w.add("b", np.ones(2, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE_NAME,
    ]
    np.testing.assert_array_equal(CheckpointReader(tmp_path).read("a"), np.ones(2, np.float32))


def test_writer_aborts_on_exception(tmp_path):
    with pytest.raises(RuntimeError):
        with CheckpointWriter(tmp_path, max_shard_bytes=8) as w:
            w.add("a", np.ones(2, np.float32))
            w.add("b", np.ones(2, np.float32))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------- errors


def _good_file(tmp_path) -> Path:
    with CheckpointWriter(tmp_path / "good") as w:
        w.add("first", np.arange(16, dtype=np.float32))
        w.add("second.weight", np.arange(16, dtype=np.float32))
    return tmp_path / "good" / SINGLE_FILE_NAME


def test_truncated_file(tmp_path):
    path = _good_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=r"'second\.weight'.*truncated or corrupt"):
        SafetensorsFile(path)
    with pytest.raises(CheckpointError, match="second.weight"):
        CheckpointReader(path.parent)
    # Truncated inside the header.
    path.write_bytes(raw[:20])
    with pytest.raises(CheckpointError, match="header claims"):
        SafetensorsFile(path)
    path.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="at least 8 bytes"):
        SafetensorsFile(path)


def test_offsets_past_eof(tmp_path):
    path = tmp_path / "x.safetensors"
    _write_raw(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [100, 116]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"'w'.*\[100, 116\).*16 data bytes"):
        SafetensorsFile(path)


def test_size_disagrees_with_shape(tmp_path):
    path = tmp_path / "x.safetensors"
    _write_raw(path, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"'w'.*needs 24 bytes.*span 16 bytes"):
        SafetensorsFile(path)


def test_overlapping_and_holey_offsets(tmp_path):
    path = tmp_path / "x.safetensors"
    _write_raw(path, {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }, bytes(24))
    with pytest.raises(CheckpointError, match=r"'b'.*overlapping tensor 'a'"):
        SafetensorsFile(path)
    _write_raw(path, {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]},
    }, bytes(36))
    with pytest.raises(CheckpointError, match=r"'b'.*hole"):
        SafetensorsFile(path)
    _write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(20))
    with pytest.raises(CheckpointError, match="trailing bytes"):
        SafetensorsFile(path)


def test_bad_json_header(tmp_path):
    path = tmp_path / "x.safetensors"
    raw = b'{"w": {"dtype": "F32", "shape": [1], '
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(path)
    raw = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(CheckpointError, match="more than once"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 4) + b"[1] " + bytes(4))
    with pytest.raises(CheckpointError, match="JSON object"):
        SafetensorsFile(path)


def test_unknown_dtype(tmp_path):
    path = tmp_path / "x.safetensors"
    _write_raw(path, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1))
    with pytest.raises(CheckpointError, match=r"'w' has dtype 'F4'"):
        SafetensorsFile(path)
    with pytest.raises(CheckpointError, match="no safetensors equivalent"):
        dtype_code(np.float128 if hasattr(np, "float128") else np.dtype("O"))
    with CheckpointWriter(tmp_path / "w") as w:
        with pytest.raises(CheckpointError, match="'obj'"):
            w.add("obj", np.array(["a"], dtype=object))
        w.add("ok", np.zeros(1, np.float32))


def test_index_missing_file(tmp_path):
    with CheckpointWriter(tmp_path, max_shard_bytes=8) as w:
        w.add("a", np.ones(2, np.float32))
        w.add("b", np.ones(2, np.float32))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*missing shards"):
        CheckpointReader(tmp_path)


def test_index_key_not_in_file(tmp_path):
    with CheckpointWriter(tmp_path, max_shard_bytes=8) as w:
        w.add("a", np.ones(2, np.float32))
        w.add("b", np.ones(2, np.float32))
    index_path = tmp_path / INDEX_FILE_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\).*'b'.*'ghost'|2 tensor\(s\).*'ghost'.*'b'"):
        CheckpointReader(tmp_path)
    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        CheckpointReader(tmp_path)


def test_directory_layouts(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        CheckpointReader(tmp_path)
    st_np.save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "weights.safetensors"))
    r = CheckpointReader(tmp_path)  # exactly one file, any name, no index
    assert r.keys() == ["x"] and r.files == [tmp_path / "weights.safetensors"]
    st_np.save_file({"y": np.ones(2, np.float32)}, str(tmp_path / "more.safetensors"))
    with pytest.raises(CheckpointError, match=r"2 \.safetensors files.*no model\.safetensors\.index\.json"):
        CheckpointReader(tmp_path)


def test_duplicate_add(tmp_path):
    with CheckpointWriter(tmp_path) as w:
        w.add("a", np.zeros(2, np.float32))
        with pytest.raises(CheckpointError, match="'a' was already added"):
            w.add("a", np.zeros(2, np.float32))
        with pytest.raises(CheckpointError, match="reserved"):
            w.add("__metadata__", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match="after close"):
        w.add("b", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match="str to str"):
        CheckpointWriter(tmp_path / "m", metadata={"n": 1})


def test_file_changed_after_open(tmp_path):
    path = _good_file(tmp_path)
    f = SafetensorsFile(path)
    path.write_bytes(path.read_bytes() + b"xx")
    with pytest.raises(CheckpointError, match="changed on disk"):
        f.read("first")


# --------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("5 GiB", 5 * 2**30),
        ("512MiB", 512 * 2**20),
        ("10KB", 10_000),
        ("3KiB", 3072),
        ("7MB", 7_000_000),
        ("1.5GB", 1_500_000_000),
        ("100B", 100),
        ("100", 100),
        ("2gib", 2 * 2**30),
        (1234, 1234),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "5XB", "five GB", "-1GB", "1.5B", "5 G B", True, 2.5, -3])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)
