"""What ``num_draft_tokens="auto"`` learned about a target/draft pair on this machine, kept for the
next job: per program shape the costs it measured (``autodraft.Costs``) and the K it ended on, and
per sampling setting the acceptance counts. The next job starts from these instead of probing.
Nothing here changes a token: a stale figure only costs speed, and a job's own runs replace it.

One JSON file per pair and machine in ``compile_cache.calibration_dir()``, written atomically when
a job ends (and every ``autodraft.UPDATE_SECONDS`` before).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform

from eagle3_jax.checkpoint.staging import write_json_atomic

# 2: a batch-1 probe measures the largest K too; a version-1 file, without it, is probed afresh.
VERSION = 2


def machine() -> str:
    """The processor the programs run on: the accelerator's kind, or the host CPU's model."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}:{jax.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu:{model}:{os.cpu_count()}"


def _file_identity(path: str) -> list:
    """A checkpoint directory's weight files by name, size and modification time."""
    out = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")):
            st = os.stat(os.path.join(path, name))
            out.append([name, st.st_size, int(st.st_mtime)])
    return out


class CalibrationStore:
    """One pair's calibration file (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self.data = {"version": VERSION, "shapes": {}, "acceptance": {}}
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("version") == VERSION:
                self.data = data
        except (OSError, ValueError):
            pass   # none yet, or unreadable: start afresh (it only ever costs speed)

    @classmethod
    def for_pair(cls, directory: str, target_dir: str, draft_dir: str, dtype: str, mesh: str) -> "CalibrationStore":
        """The file of this pair (paths and weight files), compute dtype, mesh and machine."""
        ident = {"target": [os.path.abspath(target_dir), _file_identity(target_dir)],
                 "draft": [os.path.abspath(draft_dir), _file_identity(draft_dir)],
                 "dtype": dtype, "mesh": mesh, "machine": machine()}
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
        return cls(os.path.join(directory, f"{key}.json"))

    @staticmethod
    def shape_key(program, greedy: bool) -> str:
        return (f"B{program.batch_size}-len{program.max_len}-kmax{program.max_draft_tokens}"
                f"-chunk{program.prefill_chunk}-{'greedy' if greedy else 'sampled'}")

    @staticmethod
    def setting_key(sampling) -> str:
        return f"T{sampling.temperature:g}-p{sampling.top_p:g}-k{sampling.top_k}"

    def costs(self, shape: str) -> dict | None:
        return self.data["shapes"].get(shape)

    def acceptance(self, setting: str) -> dict | None:
        return self.data["acceptance"].get(setting)

    def update(self, shape: str, setting: str, policy) -> None:
        """Records what ``policy`` (an ``autodraft.AutoDraft``) knows now and writes the file."""
        record = policy.costs.to_record()
        record.update(k=policy.current, updated=datetime.datetime.now().isoformat(timespec="seconds"))
        self.data["shapes"][shape] = record
        acc = policy.acceptance
        self.data["acceptance"][setting] = {"accepted": acc.accepted.tolist(), "offered": acc.offered.tolist()}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        write_json_atomic(self.path, self.data, fsync=False)   # a cache: a lost write only costs a probe
