"""2 processes x 4 CPU devices (gloo collectives) generate the same tokens as 1 process x 8."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3_jax as e3

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7], [100, 101, 102, 103, 104, 105, 106]]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (2, 2, 2) splits the batch, the experts and the heads across the two processes.
@pytest.mark.parametrize("mesh", ["data=2,expert=2,tensor=2"])
def test_two_processes_match_one(tiny_target_dir, trained_draft_dir, tmp_path, mesh):
    target = e3.load_target(tiny_target_dir, mesh=e3.make_mesh(mesh))
    draft = e3.load_draft(trained_draft_dir, target)
    expected = e3.Generator(target, draft, num_draft_tokens=3, max_len=40).generate(PROMPTS, 16).tokens

    port, out = _free_port(), tmp_path / "out.json"
    env = dict(os.environ, EAGLE3_TEST_PROMPTS=json.dumps(PROMPTS), PYTHONPATH=str(Path(__file__).parent.parent))
    env.pop("XLA_FLAGS", None)
    worker = Path(__file__).with_name("multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(tiny_target_dir),
                               str(trained_draft_dir), mesh, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["spec"] == expected
    assert got["target_only"] == expected
