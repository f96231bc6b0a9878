"""Training data: JSONL records -> token ids + loss mask -> grain batches, and the target's states.

Records (one JSON object a line):
  {"messages": [{"role": ..., "content": ...}, ...]}   chat template applied; loss on assistant turns
  {"text": "..."}                                       loss on every token
  {"input_ids": [...], "loss_mask": [...]}              already tokenized (loss_mask optional: all 1)

Rows are truncated to ``max_len`` and right-padded (id 0, mask 0); one conversation a row. Rows
are not packed: the target's attention has no document boundaries, so a packed row would let one
conversation's tokens shape another's hidden states.

The grain pipeline is ``source -> shuffle(seed) -> repeat -> batch``; shuffling is per epoch and
deterministic, and the iterator's state (a position) is saved with each checkpoint.

Hidden states: ``online`` runs the frozen target inside the training step; ``offline`` reads what
``mode=prepare`` wrote once into tensorstore zarr3 arrays: the aux states and the target's final
(normed) hidden states, plus its embedding and head, so that training needs no target weights and
computes the same loss (the head is applied to the stored states exactly as online).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint.staging import staged_dir, write_json_atomic
from eagle3_jax.errors import ConfigError

log = logging.getLogger("eagle3_jax")

OFFLINE_FORMAT = "eagle3-jax-offline-v1"


@dataclass
class Example:
    ids: np.ndarray        # int32 [n]
    loss_mask: np.ndarray  # bool [n]


# ---------------------------------------------------------------------- tokenizing records
def load_tokenizer(target_dir: str):
    from eagle3_jax.tokenizer import TokenizerError, load_tokenizer as _load

    try:
        return _load(target_dir)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_chat(tok, messages: list[dict]) -> Example:
    """The whole conversation through the template; loss on the tokens each assistant turn adds.

    An assistant turn's tokens are those between the rendering of the conversation before it
    (with the generation prompt) and the rendering through it. Templates that rewrite earlier
    turns (e.g. drop old reasoning) are handled by measuring against the full rendering's ids.
    """
    full = tok.encode(tok.render_chat(messages, add_generation_prompt=False), add_special_tokens=False)
    mask = np.zeros((len(full),), bool)
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.encode(tok.render_chat(messages[:k], add_generation_prompt=True), add_special_tokens=False)
        through = tok.encode(tok.render_chat(messages[:k + 1], add_generation_prompt=False), add_special_tokens=False)
        start, end = _common_prefix(before, full), _common_prefix(through, full)
        mask[start:end] = True
    return Example(np.asarray(full, np.int32), mask)


def prompt_ids(tok, record: dict, where: str) -> list[int]:
    """A generation prompt from a record: a conversation up to (not including) its last assistant turn,
    a text, or ``prompt_ids`` / ``input_ids``."""
    if "messages" in record:
        msgs = _check_messages(record["messages"], where)
        if msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        return tok.encode(tok.render_chat(msgs, add_generation_prompt=True), add_special_tokens=False)
    if "prompt" in record or "text" in record:
        text = record.get("prompt", record.get("text"))
        if not isinstance(text, str):
            raise ConfigError(f"{where}: 'prompt'/'text' must be a string")
        return tok.encode(text)
    for key in ("prompt_ids", "input_ids"):
        if key in record:
            return _int_list(record[key], where, key)
    raise ConfigError(f"{where}: expected 'messages', 'prompt', 'text', 'prompt_ids' or 'input_ids'")


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return messages


def _int_list(v, where: str, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{where}: '{key}' must be a list of integers")
    return v


def encode_record(tok, record: dict, where: str) -> Example:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {type(record).__name__}")
    if "messages" in record:
        return encode_chat(tok, _check_messages(record["messages"], where))
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ConfigError(f"{where}: 'text' must be a string")
        ids = tok.encode(record["text"])
        return Example(np.asarray(ids, np.int32), np.ones((len(ids),), bool))
    if "input_ids" in record:
        ids = _int_list(record["input_ids"], where, "input_ids")
        mask = record.get("loss_mask")
        if mask is None:
            mask = [1] * len(ids)
        elif not isinstance(mask, list) or len(mask) != len(ids):
            raise ConfigError(f"{where}: 'loss_mask' must be a list as long as 'input_ids' ({len(ids)})")
        return Example(np.asarray(ids, np.int32), np.asarray(mask, bool))
    raise ConfigError(f"{where}: a record needs 'messages', 'text' or 'input_ids'; found keys {sorted(record)}")


def iter_jsonl(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None


def read_examples(path: str, tok, max_len: int, vocab_size: int) -> list[Example]:
    """Every record of a JSONL file, tokenized and truncated to ``max_len``."""
    out, skipped = [], 0
    for where, record in iter_jsonl(path):
        ex = encode_record(tok, record, where)
        ex = Example(ex.ids[:max_len], ex.loss_mask[:max_len])
        if ex.ids.size and (ex.ids.min() < 0 or ex.ids.max() >= vocab_size):
            raise ConfigError(f"{where}: token id {int(ex.ids.max())} outside the target vocab [0, {vocab_size})")
        # The first prediction is of token 2 (from the target's state at 0 and token 1).
        if len(ex.ids) >= 3 and ex.loss_mask[2:].any():
            out.append(ex)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: %d record(s) skipped: no loss token at position >= 2 within max_len=%d", path, skipped, max_len)
    if not out:
        raise ConfigError(f"{path}: no usable records (each needs >= 3 tokens and a loss token after the first two)")
    return out


def read_prompts(path: str, tok) -> list[list[int]]:
    prompts = [prompt_ids(tok, record, where) for where, record in iter_jsonl(path)]
    if not prompts or not all(prompts):
        raise ConfigError(f"{path}: eval prompts must be a non-empty list of non-empty prompts")
    return prompts


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------- grain sources and pipeline
class TokenizedSource:
    """Padded rows from tokenized examples (random access, for grain)."""

    def __init__(self, examples: Sequence[Example], max_len: int):
        self.examples = examples
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        ids = np.zeros((self.max_len,), np.int32)
        mask = np.zeros((self.max_len,), bool)
        ids[:len(ex.ids)] = ex.ids
        mask[:len(ex.loss_mask)] = ex.loss_mask
        return {"index": np.int32(i), "ids": ids, "loss_mask": mask}

    def iter_tokens(self):
        for ex in self.examples:
            yield ex.ids, ex.loss_mask


def make_dataset(source, batch_size: int, seed: int, rows: tuple[int, int] | None = None) -> grain.MapDataset:
    """Deterministic per-epoch shuffle, endless epochs, fixed-size batches.

    The shuffle and batching run over row indices, so every process of a multi-process run walks the
    same global batches; ``rows=(lo, hi)`` then reads only rows ``lo:hi`` of each (this process's
    share of the ``data`` axis). The default reads whole batches.
    """
    if len(source) == 0:
        raise ConfigError("the training data is empty")
    lo, hi = rows if rows is not None else (0, batch_size)
    if not 0 <= lo < hi <= batch_size:
        raise ConfigError(f"rows {lo}:{hi} are not a slice of a {batch_size}-row batch")
    batches = grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(None).batch(batch_size,
                                                                                          drop_remainder=True)
    return batches.map(functools.partial(_read_rows, source, lo, hi))


def _read_rows(source, lo: int, hi: int, indices: np.ndarray) -> dict:
    rows = [source[int(i)] for i in indices[lo:hi]]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_iterator(dataset: grain.MapDataset, prefetch: int = 4):
    """An iterator with ``get_state()`` / ``set_state()`` (saved with checkpoints).

    A few batches are read ahead on a few threads (grain's default, 500 elements on 16 threads, would
    hold hundreds of batches of aux states in memory when they come from disk).
    """
    options = grain.ReadOptions(num_threads=min(4, prefetch), prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


# ---------------------------------------------------------------------- the target's side
def target_features(tgraph, tstate, ids_BT, aux_ids: tuple[int, ...]):
    """Runs the frozen target over ids [B, T] from position 0: (aux [B, T, X], final normed hidden [B, T, D])."""
    target = nnx.merge(tgraph, tstate)
    B, T = ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = target(ids_BT, positions_BT, target.init_cache(B, T), aux_ids)
    return jax.lax.stop_gradient(out.aux_BTX), jax.lax.stop_gradient(out.hidden_BTD)


def target_head(target_model) -> tuple[jax.Array, jax.Array]:
    """(embedding [V, D], head [D, V]) of a target; a tied head is the embedding transposed."""
    embed_VD = target_model.embed_tokens[...]
    lm_head_DV = target_model.lm_head[...] if target_model.lm_head is not None else embed_VD.T
    return embed_VD, lm_head_DV


# ---------------------------------------------------------------------- offline store (tensorstore zarr3)
def _ts_spec(root: str, name: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(root, name)}}


def _ts_dtype(dtype):
    import tensorstore as ts

    return {"float32": ts.float32, "bfloat16": ts.bfloat16, "float16": ts.float16, "int32": ts.int32,
            "bool": ts.bool}[np.dtype(dtype).name]


def _create(root: str, name: str, shape, dtype, chunk):
    import tensorstore as ts

    return ts.open(_ts_spec(root, name), create=True, delete_existing=True, dtype=_ts_dtype(dtype),
                   shape=list(shape), chunk_layout=ts.ChunkLayout(chunk_shape=list(chunk))).result()


def _open(root: str, name: str):
    import tensorstore as ts

    return ts.open(_ts_spec(root, name), open=True).result()


class OfflineSource:
    """Rows of a prepared offline directory: ids, loss mask, aux and final hidden states."""

    ARRAYS = ("ids", "loss_mask", "aux", "hidden")

    def __init__(self, root: str):
        self.root = root
        self.meta = read_offline_meta(root)
        self._arrays = {k: _open(root, k) for k in self.ARRAYS}

    def __len__(self) -> int:
        return int(self.meta["num_examples"])

    def __getitem__(self, i: int) -> dict:
        row = {k: self._arrays[k][int(i)].read().result() for k in self.ARRAYS}
        row["index"] = np.int32(i)
        return row

    def iter_tokens(self):
        ids = self._arrays["ids"].read().result()
        mask = self._arrays["loss_mask"].read().result()
        for r in range(len(self)):
            yield ids[r], mask[r]

    def head(self) -> tuple[np.ndarray, np.ndarray]:
        return _open(self.root, "embed").read().result(), _open(self.root, "lm_head").read().result()


def read_offline_meta(root: str) -> dict:
    path = os.path.join(root, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{root} holds no prepared hidden states (no meta.json); run with mode=prepare first")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != OFFLINE_FORMAT or not meta.get("complete"):
        raise ConfigError(f"{root}: incomplete or foreign offline data ({path}); rerun mode=prepare")
    return meta


def offline_meta_for(cfg, tcfg, data_digest: str) -> dict:
    """The facts a prepared directory must agree with to be reused by a run of ``cfg``."""
    return {"format": OFFLINE_FORMAT, "target_hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size,
            "num_hidden_layers": tcfg.num_hidden_layers, "aux_layer_ids": list(cfg.resolved_aux_ids(tcfg)),
            "max_len": cfg.max_len, "data_sha256": data_digest}


def check_offline_meta(meta: dict, cfg, tcfg, root: str) -> None:
    want = offline_meta_for(cfg, tcfg, meta.get("data_sha256", ""))
    for k, v in want.items():
        if k != "data_sha256" and meta.get(k) != v:
            raise ConfigError(
                f"{root} was prepared with {k}={meta.get(k)!r} but this run has {k}={v!r}; rerun mode=prepare "
                "with this config (into an empty offline_dir)")
    if cfg.data is not None and os.path.isfile(cfg.data) and file_digest(cfg.data) != meta["data_sha256"]:
        raise ConfigError(f"{root} was prepared from different data than {cfg.data}; rerun mode=prepare")


def prepare_offline(cfg, progress: bool = True) -> str:
    """``mode=prepare``: runs the target once over the data and writes what training needs."""
    from tqdm import tqdm

    import eagle3_jax as e3
    from eagle3_jax.sharding import mesh_context

    from eagle3_jax import distributed

    tcfg = cfg.validate()
    if distributed.is_multi_process():
        raise ConfigError("mode=prepare runs in a single process (it writes one offline directory); run it without "
                          "--coordinator / EAGLE3_COORDINATOR, then train with several processes from its output")
    root = cfg.offline_dir
    digest = file_digest(cfg.data)
    meta = offline_meta_for(cfg, tcfg, digest)
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
    target = e3.load_target(cfg.target, dtype=cfg.resolved_target_dtype, mesh=cfg.mesh)
    aux_ids = cfg.resolved_aux_ids(tcfg)
    N, T, D, V = len(examples), cfg.max_len, tcfg.hidden_size, tcfg.vocab_size
    X = len(aux_ids) * D
    dtype = np.dtype(jnp.dtype(target.dtype))
    # root is absent or empty (checked above), so replacing it loses nothing.
    with staged_dir(root, overwrite=True) as tmp:
        arrays = {
            "ids": _create(tmp, "ids", (N, T), np.int32, (1, T)),
            "loss_mask": _create(tmp, "loss_mask", (N, T), np.bool_, (1, T)),
            "aux": _create(tmp, "aux", (N, T, X), dtype, (1, T, X)),
            "hidden": _create(tmp, "hidden", (N, T, D), dtype, (1, T, D)),
        }
        embed_VD, lm_head_DV = target_head(target.model)
        _create(tmp, "embed", (V, D), dtype, (min(V, 4096), D)).write(np.asarray(jax.device_get(embed_VD))).result()
        _create(tmp, "lm_head", (D, V), dtype, (D, min(V, 4096))).write(np.asarray(jax.device_get(lm_head_DV))).result()

        features = jax.jit(target_features, static_argnums=(0, 3))
        source = TokenizedSource(examples, T)
        B = cfg.batch_size
        with mesh_context(target.mesh):
            for start in tqdm(range(0, N, B), desc="prepare", disable=not progress):
                rows = [source[i] for i in range(start, min(start + B, N))]
                ids = np.stack([r["ids"] for r in rows])
                mask = np.stack([r["loss_mask"] for r in rows])
                pad = B - len(rows)  # keep one compiled shape
                ids_in = np.concatenate([ids, np.zeros((pad, T), np.int32)]) if pad else ids
                aux, hidden = jax.device_get(features(target.graphdef, target.state, jnp.asarray(ids_in), aux_ids))
                stop = start + len(rows)
                arrays["ids"][start:stop].write(ids).result()
                arrays["loss_mask"][start:stop].write(mask).result()
                arrays["aux"][start:stop].write(np.asarray(aux[:len(rows)])).result()
                arrays["hidden"][start:stop].write(np.asarray(hidden[:len(rows)])).result()
        meta.update({"complete": True, "num_examples": N, "dtype": dtype.name, "target": os.path.abspath(cfg.target),
                     "data": os.path.abspath(cfg.data)})
        write_json_atomic(os.path.join(tmp, "meta.json"), meta)
    return root
