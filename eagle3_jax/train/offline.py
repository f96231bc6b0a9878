"""The target's hidden states: computed inside the step (``online``), or once by ``mode=prepare``
into tensorstore zarr3 arrays (``offline``): the aux states and the target's final (normed) hidden
states, plus its embedding and head, so that training needs no target weights and computes the
same loss (the head is applied to the stored states exactly as online).

Storage (``offline_dtype``): the target's dtype, or narrower: float8_e4m3fn with one float32 scale
per position (its largest magnitude maps to e4m3's 448); rows are read back as float32.

``mode=prepare`` writes into ``OFFLINE_DIR.prepare``, records the rows written after each batch's
writes complete (``progress.json``), so a killed run resumes from the last recorded batch, and
renames the directory to ``offline_dir`` when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.errors import ConfigError
from eagle3_jax.models.chunks import positions, scan_chunks
from eagle3_jax.train.data import file_digest, load_tokenizer, read_examples
from eagle3_jax.train.pipeline import TokenizedSource
from eagle3_jax.train.progress import info as _info

log = logging.getLogger("eagle3_jax")

OFFLINE_FORMAT = "eagle3-jax-offline-v1"
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
FP8_MAX = 448.0            # the largest finite float8_e4m3fn magnitude
SCALED = ("aux", "hidden")  # the arrays stored with a per-position scale when narrowed to fp8


# ---------------------------------------------------------------------- the target's side
def target_features(tgraph, tstate, ids_BT, aux_ids: tuple[int, ...], chunk: int | None = None):
    """Runs the frozen target over ids [B, T] from position 0: (aux [B, T, X], final normed hidden [B, T, D]).
    ``chunk``: positions per target call, each attending over the cache the earlier ones filled (as
    chunked prefill does): the target's attention scores are [chunk, T] per head instead of [T, T]."""
    target = nnx.merge(tgraph, tstate)
    B, T = ids_BT.shape
    chunk = min(chunk or T, T)

    def step(cache, start, ids_BC):
        out = target(ids_BC, positions(start, B, chunk), cache, aux_ids)
        return out.cache, (out.aux_BTX, out.hidden_BTD)

    # padded positions lie past every real one: causal masking keeps them out of real rows' states
    _, states = scan_chunks(step, target.init_cache(B, -(-T // chunk) * chunk), ids_BT, chunk)
    return jax.lax.stop_gradient(states)


def target_head(target_model) -> tuple[jax.Array, jax.Array]:
    """(embedding [V, D], head [D, V]) of a target (a tied head: the embedding transposed)."""
    embed_VD = target_model.embed_tokens[...]
    lm_head_DV = target_model.lm_head[...] if target_model.lm_head is not None else embed_VD.T
    return embed_VD, lm_head_DV


# ---------------------------------------------------------------------- offline store (tensorstore zarr3)
def _ts_spec(root: str, name: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(root, name)}}


def _ts_dtype(dtype):
    import tensorstore as ts

    return {"float32": ts.float32, "bfloat16": ts.bfloat16, "float16": ts.float16, "int32": ts.int32,
            "bool": ts.bool, "float8_e4m3fn": ts.float8_e4m3fn}[np.dtype(dtype).name]


def _create(root: str, name: str, shape, dtype, chunk, reuse: bool = False):
    """A new zarr3 array (or, with ``reuse``, the one a killed prepare left, if it has this shape and dtype)."""
    import tensorstore as ts

    if reuse and os.path.isfile(os.path.join(root, name, "zarr.json")):
        arr = _open(root, name)
        if list(arr.shape) == list(shape) and arr.dtype == _ts_dtype(dtype):
            return arr
    return ts.open(_ts_spec(root, name), create=True, delete_existing=True, dtype=_ts_dtype(dtype),
                   shape=list(shape), chunk_layout=ts.ChunkLayout(chunk_shape=list(chunk))).result()


def storage_dtype(cfg) -> np.dtype:
    """How the states are stored: ``offline_dtype``, else the target's dtype."""
    from eagle3_jax.config import resolve_dtype

    return np.dtype(cfg.offline_dtype or jnp.dtype(resolve_dtype(cfg.resolved_target_dtype)))


def bytes_per_position(X: int, D: int, dtype: np.dtype) -> int:
    """Stored bytes per (padded) position: id, mask, aux and final states, and their fp8 scales."""
    scales = 4 * len(SCALED) if dtype.name == "float8_e4m3fn" else 0
    return 4 + 1 + (X + D) * dtype.itemsize + scales


def encode(x_BTF: np.ndarray, dtype: np.dtype):
    """float states -> (stored values, per-position float32 scales or None)."""
    if dtype.name != "float8_e4m3fn":
        return x_BTF.astype(dtype), None
    x = np.asarray(x_BTF, np.float32)
    amax = np.max(np.abs(x), axis=-1)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    return (x / scale[..., None]).astype(dtype), scale


def decode(values: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    x = np.asarray(values, np.float32)
    return x if scale is None else x * scale[..., None]


def _open(root: str, name: str):
    import tensorstore as ts

    return ts.open(_ts_spec(root, name), open=True).result()


class OfflineSource:
    """Rows of a prepared offline directory: ids, loss mask, aux and final hidden states, length."""

    ARRAYS = ("ids", "loss_mask", "aux", "hidden")

    def __init__(self, root: str):
        self.root = root
        self.meta = read_offline_meta(root)
        self._arrays = {k: _open(root, k) for k in self.ARRAYS}
        # stores prepared before lengths were kept: every row counts as full (check_offline_meta
        # refuses them where the length matters, loss_convention=specforge)
        self._length = _open(root, "length") if has_lengths(root) else None
        self._scales = ({k: _open(root, k + "_scale") for k in SCALED}
                        if self.meta.get("storage") == "float8_e4m3fn" else {})

    def __len__(self) -> int:
        return int(self.meta["num_examples"])

    def __getitem__(self, i: int) -> dict:
        row = {k: self._arrays[k][int(i)].read().result() for k in self.ARRAYS}
        row["length"] = np.int32(self._length[int(i)].read().result() if self._length is not None
                                 else row["ids"].shape[0])
        if self._scales:
            for k in SCALED:
                row[k] = decode(row[k], self._scales[k][int(i)].read().result())
        row["index"] = np.int32(i)
        return row

    def iter_tokens(self):
        ids = self._arrays["ids"].read().result()
        mask = self._arrays["loss_mask"].read().result()
        for r in range(len(self)):
            yield ids[r], mask[r]

    def head(self) -> tuple[np.ndarray, np.ndarray]:
        return _open(self.root, "embed").read().result(), _open(self.root, "lm_head").read().result()


def has_lengths(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "length", "zarr.json"))


def read_offline_meta(root: str) -> dict:
    path = os.path.join(root, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{root} holds no prepared hidden states (no meta.json); run with mode=prepare first")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != OFFLINE_FORMAT or not meta.get("complete"):
        raise ConfigError(f"{root}: incomplete or foreign offline data ({path}); rerun mode=prepare")
    return meta


def offline_meta_for(plan, data_digest: str) -> dict:
    """The facts a prepared directory must agree with to be reused by a run (a ``TrainPlan``)."""
    cfg, tcfg = plan.settings, plan.target
    return {"format": OFFLINE_FORMAT, "target_hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size,
            "num_hidden_layers": tcfg.num_hidden_layers, "aux_layer_ids": list(plan.aux_ids),
            "max_len": cfg.max_len, "data_sha256": data_digest, "storage": storage_dtype(cfg).name}


def check_offline_meta(meta: dict, plan, root: str) -> None:
    cfg = plan.settings
    want = offline_meta_for(plan, meta.get("data_sha256", ""))
    for k, v in want.items():
        if k not in ("data_sha256", "storage") and meta.get(k) != v:
            raise ConfigError(
                f"{root} was prepared with {k}={meta.get(k)!r} but this run has {k}={v!r}; rerun mode=prepare "
                "with this config (into an empty offline_dir)")
    if cfg.loss_convention == "specforge" and not has_lengths(root):
        raise ConfigError(f"{root} was prepared without the rows' lengths, which loss_convention=specforge divides "
                          "by; rerun mode=prepare into an empty offline_dir, or train with loss_convention=ours")
    if cfg.data is not None and os.path.isfile(cfg.data) and file_digest(cfg.data) != meta["data_sha256"]:
        raise ConfigError(f"{root} was prepared from different data than {cfg.data}; rerun mode=prepare")


def prepare_offline(cfg, progress: bool = True, plan=None) -> str:
    """``mode=prepare``: runs the target once over the data and writes what training needs
    (``plan``: the run's ``TrainPlan`` when the caller resolved it already)."""
    from tqdm import tqdm

    from eagle3_jax import distributed
    from eagle3_jax.loading import load_target
    from eagle3_jax.sharding import mesh_context

    plan = plan if plan is not None else cfg.resolve()
    tcfg = plan.target
    if distributed.is_multi_process():
        raise ConfigError("mode=prepare runs in a single process (it writes one offline directory); run it without "
                          "--coordinator / EAGLE3_COORDINATOR, then train with several processes from its output")
    root = cfg.offline_dir
    digest = file_digest(cfg.data)
    meta = offline_meta_for(plan, digest)
    if os.path.isfile(os.path.join(root, "meta.json")):
        try:
            existing = read_offline_meta(root)
        except ConfigError:
            existing = None
        if existing is not None and all(existing.get(k) == v for k, v in meta.items()):
            log.info("%s already holds these hidden states; nothing to do", root)
            return root
    if os.path.isdir(root) and os.listdir(root):
        raise ConfigError(f"offline_dir {root} is not empty; give an empty or new directory to prepare into")
    tok = load_tokenizer(cfg.target)
    examples = read_examples(cfg.data, tok, cfg.max_len, tcfg.vocab_size)
    target = load_target(cfg.target, dtype=cfg.resolved_target_dtype, mesh=cfg.mesh, config=tcfg)
    aux_ids = plan.aux_ids
    N, T, D, V = len(examples), cfg.max_len, tcfg.hidden_size, tcfg.vocab_size
    X = len(aux_ids) * D
    dtype = np.dtype(jnp.dtype(target.dtype))
    store = storage_dtype(cfg)
    per_pos = bytes_per_position(X, D, store)
    _info("offline states in %s: %d bytes per token (aux %d x %s + final %d%s); this data: %d rows x %d = %s; "
          "83k rows x 2k tokens at this width: %s", store.name, per_pos, X, store.name, D,
          " + fp8 scales" if store.name == "float8_e4m3fn" else "", N, T, _size(N * T * per_pos),
          _size(83_000 * 2048 * per_pos))
    work = root.rstrip("/") + ".prepare"
    meta.update({"num_examples": N, "dtype": dtype.name})
    progress_path = os.path.join(work, "progress.json")
    done = 0
    if os.path.isfile(progress_path):
        with open(progress_path) as f:
            progress = json.load(f)
        if progress.get("meta") == meta:
            done = int(progress["rows"])
            _info("resuming mode=prepare in %s at row %d of %d", work, done, N)
    if done == 0 and os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    resume = done > 0
    layout = {"ids": ((N, T), np.int32), "loss_mask": ((N, T), np.bool_), "aux": ((N, T, X), store),
              "hidden": ((N, T, D), store)}
    if store.name == "float8_e4m3fn":
        layout.update({k + "_scale": ((N, T), np.float32) for k in SCALED})
    arrays = {k: _create(work, k, shape, dtype, (1,) + shape[1:], resume) for k, (shape, dtype) in layout.items()}
    # known before the target runs: written whole on every (re)start
    _create(work, "length", (N,), np.int32, (N,)).write(np.asarray([len(ex.ids) for ex in examples], np.int32)).result()
    if not resume:
        embed_VD, lm_head_DV = target_head(target.model)
        _create(work, "embed", (V, D), dtype, (min(V, 4096), D)).write(np.asarray(jax.device_get(embed_VD))).result()
        _create(work, "lm_head", (D, V), dtype, (D, min(V, 4096))).write(
            np.asarray(jax.device_get(lm_head_DV))).result()
        write_json_atomic(progress_path, {"meta": meta, "rows": 0})

    features = jax.jit(target_features, static_argnums=(0, 3))
    source = TokenizedSource(examples, T)
    B = cfg.batch_size
    with mesh_context(target.mesh):
        for start in tqdm(range(done, N, B), desc="prepare", disable=not progress):
            rows = [source[i] for i in range(start, min(start + B, N))]
            ids = np.stack([r["ids"] for r in rows])
            mask = np.stack([r["loss_mask"] for r in rows])
            pad = B - len(rows)  # keep one compiled shape
            ids_in = np.concatenate([ids, np.zeros((pad, T), np.int32)]) if pad else ids
            aux, hidden = jax.device_get(features(target.graphdef, target.state, jnp.asarray(ids_in), aux_ids))
            stop = start + len(rows)
            writes = [arrays["ids"][start:stop].write(ids), arrays["loss_mask"][start:stop].write(mask)]
            for name, x in (("aux", aux), ("hidden", hidden)):
                values, scale = encode(np.asarray(x[:len(rows)]), store)
                writes.append(arrays[name][start:stop].write(values))
                if scale is not None:
                    writes.append(arrays[name + "_scale"][start:stop].write(scale))
            for w in writes:
                w.result()
            # recorded only once the batch is on disk: a kill before this line redoes the batch
            write_json_atomic(progress_path, {"meta": meta, "rows": stop})
    meta.update({"complete": True, "target": os.path.abspath(cfg.target), "data": os.path.abspath(cfg.data)})
    write_json_atomic(os.path.join(work, "meta.json"), meta)
    os.remove(progress_path)
    if os.path.isdir(root):
        os.rmdir(root)  # empty (checked above)
    os.rename(work, root)
    return root


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}"
        n /= 1000
