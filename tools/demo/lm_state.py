"""The demo target's resumable pre-training state on disk, and the lock that keeps one trainer on it.

Files are numpy archives with a JSON ``__meta__`` entry, written atomically
(``eagle3_jax.checkpoint.staging.atomic_file``): readers see the old file or the new one, never a
prefix. ``save_state`` / ``load_state`` hold every leaf of the training pytrees (parameters,
optimizer state, router bias); ``save_params`` / ``load_params`` the best parameters by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import numpy as np

from eagle3_jax.checkpoint.staging import atomic_file


def _json_bytes(meta: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(meta).encode(), np.uint8)


def flat_arrays(*states) -> dict:
    """nnx states -> {path tuple: numpy array}."""
    from flax import nnx

    out = {}
    for state in states:
        for path, var in nnx.to_flat_state(state):
            out[tuple(path)] = np.asarray(var.value if hasattr(var, "value") else var)
    return out


def save_params(path: str, flat: dict, meta: dict) -> None:
    with atomic_file(path, "wb") as f:
        np.savez(f, __meta__=_json_bytes(meta), **{"/".join(str(p) for p in k): v for k, v in flat.items()})


def load_params(path: str) -> tuple[dict, dict]:
    with np.load(path) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        flat = {tuple(int(p) if p.isdigit() else p for p in k.split("/")): z[k] for k in z.files if k != "__meta__"}
    return flat, meta


def stream_digest(*streams: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in streams:
        h.update(str(a.dtype).encode() + str(a.shape).encode() + np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def save_state(path: str, trees: dict, meta: dict) -> None:
    """The resumable state: every leaf of each pytree in ``trees`` plus ``meta`` (JSON), atomically."""
    import jax

    arrays = {f"{name}/{i:05d}": np.asarray(x) for name, tree in trees.items()
              for i, x in enumerate(jax.tree.leaves(tree))}
    with atomic_file(path, "wb") as f:
        np.savez(f, __meta__=_json_bytes(meta), **arrays)


def load_state(path: str, like: dict) -> tuple[dict, dict]:
    """Reads ``save_state``'s file into pytrees shaped like ``like`` (same structure, checked)."""
    import jax
    import jax.numpy as jnp

    out = {}
    with np.load(path) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        for name, tree in like.items():
            leaves, treedef = jax.tree.flatten(tree)
            keys = sorted(k for k in z.files if k.startswith(name + "/"))
            if len(keys) != len(leaves):
                raise SystemExit(f"error: {path} holds {len(keys)} '{name}' arrays, this model has {len(leaves)}; "
                                 "it was written by a different model: delete it to start over")
            new = []
            for k, ref in zip(keys, leaves):
                a = z[k]
                if a.shape != np.shape(ref):
                    raise SystemExit(f"error: {path}: {k} has shape {a.shape}, this model expects "
                                     f"{np.shape(ref)}; delete it to start over")
                new.append(jnp.asarray(a, dtype=jnp.asarray(ref).dtype))
            out[name] = jax.tree.unflatten(treedef, new)
    return out, meta


def check_resumable(path: str, meta: dict, expect: dict, may_change: tuple = ()) -> None:
    """Refuses to resume a state written with other settings, model or data (expected vs found)."""
    diffs = []
    for key in ("settings", "config", "data"):
        want, got = expect[key], meta.get(key, {})
        for k in sorted(set(want) | set(got)):
            if key == "settings" and k in may_change:
                continue
            if want.get(k) != got.get(k):
                diffs.append(f"{key}.{k}: checkpoint {got.get(k)!r}, now {want.get(k)!r}")
    if diffs:
        raise SystemExit(f"error: cannot resume from {path} (step {meta.get('step')}): it was written with "
                         "different settings:\n  " + "\n  ".join(diffs) + "\nrerun with the checkpoint's settings, "
                         f"or delete {path} to start over")


@contextlib.contextmanager
def training_lock(state_path: str):
    """Only one process trains into a state file: a second one (say, a later session that missed the
    first) would overwrite its checkpoints."""
    import fcntl

    f = open(state_path + ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SystemExit(f"error: another process (pid {holder}) is already training into {state_path}; "
                         "wait for it to finish, or stop it (SIGTERM saves its state) and rerun")
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()
