"""Staged directories and atomic files (eagle3_jax.checkpoint.staging), and what the draft writer and
the converter get from them: ordinary permissions, no debris after a failure, byte-stable config.json."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint import staging
from eagle3_jax.drafts.eagle3 import layout as draft_io
from tests import spec_fixtures
from tools.convert import core


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def assert_ordinary_modes(root: Path):
    """Directories 0755 and files 0644, as mkdir / open give under umask 022."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    found.update({str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")})
    bad = {name: oct(m) for name, m in found.items() if m != (0o755 if (root / name).is_dir() else 0o644)}
    assert not bad, f"expected directories 0755 and files 0644 under umask 022, found {bad}"


def no_debris(dst: Path) -> bool:
    return not dst.exists() and not list(dst.parent.glob(dst.name + ".tmp-*"))


@pytest.fixture
def draft(tiny_target):
    return e3.build_draft(spec_fixtures.tiny_draft_config(tiny_target.config), tiny_target, seed=1)


def test_saved_draft_and_converted_draft_have_ordinary_permissions(draft, tmp_path, umask_022):
    e3.save_draft(draft, tmp_path / "hf")
    assert_ordinary_modes(tmp_path / "hf")
    core.to_jax(tmp_path / "hf", tmp_path / "jax", progress=False)
    assert_ordinary_modes(tmp_path / "jax")
    core.to_hf(tmp_path / "jax", tmp_path / "back", progress=False)
    assert_ordinary_modes(tmp_path / "back")


def test_failed_save_draft_leaves_nothing(draft, tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        yield "fc.weight", draft_io.np.zeros((2, 2), "float32")
        raise OSError("disk full")

    monkeypatch.setattr(draft_io, "iter_draft_tensors", failing)
    with pytest.raises(OSError, match="disk full"):
        e3.save_draft(draft, tmp_path / "d")
    assert no_debris(tmp_path / "d")


def test_failed_conversion_leaves_nothing(draft, tmp_path, monkeypatch):
    e3.save_draft(draft, tmp_path / "hf")
    monkeypatch.setattr(core.shutil, "copyfile", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        core.to_jax(tmp_path / "hf", tmp_path / "jax", progress=False)
    assert no_debris(tmp_path / "jax")


def test_draft_config_json_survives_the_round_trip_byte_for_byte(draft, tmp_path):
    e3.save_draft(draft, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").read_bytes().endswith(b"}\n")
    # also a config formatted unlike ours (4-space indent, no trailing newline): returned as it was
    odd = tmp_path / "odd"
    odd.mkdir()
    for p in (tmp_path / "hf").iterdir():
        (odd / p.name).write_bytes(p.read_bytes())
    (odd / "config.json").write_text(json.dumps(json.loads((tmp_path / "hf" / "config.json").read_text()), indent=4))
    for src in (tmp_path / "hf", odd):
        core.to_jax(src, tmp_path / f"{src.name}.jax", progress=False)
        core.to_hf(tmp_path / f"{src.name}.jax", tmp_path / f"{src.name}.back", progress=False)
        assert (tmp_path / f"{src.name}.back" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_staged_dir_renames_on_success_and_cleans_up_on_failure(tmp_path, umask_022):
    dst = tmp_path / "sub" / "out"
    with pytest.raises(RuntimeError):
        with staging.staged_dir(dst) as tmp:
            (tmp / "a.txt").write_text("x")
            raise RuntimeError("boom")
    assert no_debris(dst)
    with staging.staged_dir(dst) as tmp:
        assert tmp.parent == dst.parent and tmp.name.startswith("out.tmp-") and not dst.exists()
        (tmp / "a.txt").write_text("x")
    assert (dst / "a.txt").read_text() == "x" and no_debris(tmp_path / "sub" / "other")
    assert_ordinary_modes(dst)
    with pytest.raises(e3.CheckpointError, match="already exists"):
        with staging.staged_dir(dst):
            pass
    with staging.staged_dir(dst, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("y")
    assert sorted(p.name for p in dst.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in dst.parent.iterdir()) == ["out"]


def test_atomic_writes_keep_the_old_file_on_failure(tmp_path, umask_022):
    path = tmp_path / "m.json"
    staging.write_json_atomic(path, {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n' and stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(TypeError):
        staging.write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
    with pytest.raises(ValueError, match="mode"):
        with staging.atomic_file(path, "a"):
            pass
