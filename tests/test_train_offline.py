"""Offline states stored compactly (bf16, fp8 e4m3 with a per-position scale) and a prepare that
resumes after kill -9 with the same store."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from eagle3_jax.train import TrainConfig, offline, run
from tests.hf_fixtures import REPO

N, T = 24, 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_data")
    rng = np.random.default_rng(3)
    path = root / "train.jsonl"
    with open(path, "w") as f:
        for _ in range(N):
            n = int(rng.integers(8, T + 1))
            f.write(json.dumps({"input_ids": rng.integers(2, 256, n).tolist(),
                                "loss_mask": [0] * 3 + [1] * (n - 3)}) + "\n")
    return path


def _cfg(target_dir, data, offline_dir, **over):
    d = {"target": str(target_dir), "data": str(data), "mode": "prepare", "offline_dir": str(offline_dir),
         "max_len": T, "batch_size": 4, "aux_layer_ids": [0, 1, 2], "draft_vocab_size": 128,
         "draft": {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
    d.update(over)
    return TrainConfig.from_dict(d)


def _rows(root):
    src = offline.OfflineSource(str(root))
    return [src[i] for i in range(len(src))]


@pytest.fixture(scope="module")
def stores(tiny_target_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name in ("float32", "bfloat16", "float8_e4m3fn"):
        run(_cfg(tiny_target_dir, data, root / name, offline_dtype=name), progress=False)
        out[name] = root / name
    return out


def test_compact_storage_roundtrips_within_its_precision(stores):
    exact = _rows(stores["float32"])
    # each row's length is stored (its mask is 3 zeros then ones to its end)
    assert [int(r["length"]) for r in exact] == [3 + int(r["loss_mask"].sum()) for r in exact] != [T] * N
    for name, tol in (("bfloat16", 2 ** -8), ("float8_e4m3fn", 2 ** -4)):
        meta = json.loads((stores[name] / "meta.json").read_text())
        assert meta["storage"] == name and meta["complete"]
        for a, b in zip(_rows(stores[name]), exact):
            np.testing.assert_array_equal(a["ids"], b["ids"])
            for k in ("aux", "hidden"):
                x, ref = np.asarray(a[k], np.float32), b[k]
                # relative to each position's largest magnitude: what a per-position scale bounds
                err = np.abs(x - ref).max(-1) / np.maximum(np.abs(ref).max(-1), 1e-30)
                assert err.max() <= tol, (name, k, err.max())
    fp8 = stores["float8_e4m3fn"]
    assert os.path.isdir(fp8 / "aux_scale") and not os.path.exists(stores["bfloat16"] / "aux_scale")


def test_prepare_reports_bytes_per_token(tiny_target_dir, data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eagle3_jax")
    run(_cfg(tiny_target_dir, data, tmp_path / "o", offline_dtype="float8_e4m3fn"), progress=False)
    D = 64
    per = 4 + 1 + 4 * D + 8   # id, mask, aux (3 x D) + final (D) in one byte each, two fp8 scales
    line = next(r.getMessage() for r in caplog.records if "bytes per token" in r.getMessage())
    assert f"{per} bytes per token" in line and f"{N} rows x {T}" in line
    assert f"{83_000 * 2048 * per / 1e9:.1f} GB" in line


KILLER = """
import os, signal, sys
from eagle3_jax.train import TrainConfig, offline, run
writes = []
real = offline.write_json_atomic
def write(path, obj):
    real(path, obj)
    if path.endswith("progress.json") and obj["rows"] >= 8:
        os.kill(os.getpid(), signal.SIGKILL)   # mid-run, after the batch ending at row 8 is recorded
offline.write_json_atomic = write
run(TrainConfig.from_dict(eval(sys.argv[1])), progress=False)
"""


def test_prepare_resumes_after_kill_9_to_the_same_store(tiny_target_dir, data, tmp_path, stores):
    cfg = _cfg(tiny_target_dir, data, tmp_path / "killed", offline_dtype="float8_e4m3fn")
    proc = subprocess.run([sys.executable, "-c", KILLER, repr(cfg.to_dict())], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    progress = json.loads((tmp_path / "killed.prepare" / "progress.json").read_text())
    assert 0 < progress["rows"] < N and not (tmp_path / "killed").exists()
    run(cfg, progress=False)
    assert not (tmp_path / "killed.prepare").exists()
    for a, b in zip(_rows(tmp_path / "killed"), _rows(stores["float8_e4m3fn"])):
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32))


def test_target_features_in_chunks_equal_one_call(tiny_target):
    """The frozen target run a chunk of positions at a time over its cache (a partial last chunk)
    gives the same aux and final states as one call over the row."""
    ids = np.random.default_rng(4).integers(2, 256, (2, T)).astype(np.int32)
    whole = offline.target_features(tiny_target.graphdef, tiny_target.state, ids, (0, 1, 2))
    chunked = offline.target_features(tiny_target.graphdef, tiny_target.state, ids, (0, 1, 2), chunk=5)
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
