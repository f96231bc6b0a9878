"""Training records (config.DATA_FORMATS): JSONL lines -> validated records -> token ids + loss mask,
truncated to ``max_len`` (pipeline.py pads them)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from eagle3_jax.errors import ConfigError

log = logging.getLogger("eagle3_jax")


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
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def encode_chat(tok, messages: list[dict]) -> Example:
    """The whole conversation through the template; loss on the tokens each assistant turn adds.
    An assistant turn's tokens are those between the rendering of the conversation before it
    (with the generation prompt) and the rendering through it. Templates that rewrite earlier
    turns (e.g. drop old reasoning) are handled by measuring against the full rendering's ids."""
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


# Keys of serve.py's plain (--emit text) result lines, which no training record has.
SERVE_RESULT_KEYS = ("finish_reason", "num_tokens", "accept_length")


def encode_record(tok, record: dict, where: str) -> Example:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {type(record).__name__}")
    serve_keys = [k for k in SERVE_RESULT_KEYS if k in record]
    if "text" in record and serve_keys:
        # Its "text" is the answer alone: training on it would teach the draft answers without prompts.
        raise ConfigError(
            f"{where}: this is a serve.py result line (it has 'text' and {serve_keys}), not a training record; "
            "its text is the answer without the prompt. Write training data with `python serve.py ... "
            "--emit training`, which writes {\"messages\": [prompt turns..., answer]} lines")
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
                raise ConfigError(f"{where}: not valid JSON ({e.msg}: column {e.colno})") from None


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
