"""Prompt JSONL: one object per line, ``{"id": ..., "messages": [...]}`` or ``{"id": ..., "prompt": "..."}``.

``id`` (a string or an integer) is optional. A line without one gets ``"sha256:"`` + the first 16
hex digits of the SHA-256 of the canonical JSON (sorted keys, no spaces) of ``{"prompt": ...}`` or
``{"messages": [...]}`` (the prompt turns): an id that survives inserted or reordered lines, so a
resumed run finds its finished prompts. The k-th repeat (k >= 2) of such content gets ``-k``
appended. Blank lines are ignored. A trailing assistant turn in ``messages`` is what gets
regenerated: the prompt is everything before it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from eagle3_jax.errors import Eagle3Error


class InputError(Eagle3Error, ValueError):
    """The prompt file has lines that are not valid prompts."""


@dataclass
class PromptRecord:
    id: str | int
    line: int
    messages: list[dict] | None = None   # the prompt turns (a trailing assistant turn removed)
    prompt: str | None = None
    id_derived: bool = False             # True: the line had no 'id'; ``id`` comes from the content

    @property
    def key(self) -> str:
        """The id as the output file records it (so 7 and "7" stay different prompts)."""
        return id_key(self.id)

    def prompt_messages(self) -> list[dict]:
        """The prompt as chat messages (a plain prompt is one user turn)."""
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt}]


def id_key(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def content_id(rec: PromptRecord) -> str:
    """The id of a line without one: a hash of the prompt it generates from (see the module docstring)."""
    body = {"prompt": rec.prompt} if rec.messages is None else {"messages": rec.messages}
    canonical = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _check_messages(msgs) -> str | None:
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{i}] is {type(m).__name__}, expected an object with 'role' and 'content'"
        if not isinstance(m.get("role"), str):
            return f"messages[{i}] has no string 'role'"
        if not isinstance(m.get("content"), (str, list)):
            return f"messages[{i}] has no 'content' (a string, or a list of content parts)"
    return None


def _parse_line(text: str, line: int) -> tuple[PromptRecord | None, str | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg}: column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, found {type(obj).__name__}"
    has_msgs, has_prompt = "messages" in obj, "prompt" in obj
    if has_msgs == has_prompt:
        return None, "needs exactly one of 'messages' (a chat) or 'prompt' (plain text)"
    ident = obj.get("id")
    if "id" in obj and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        return None, f"'id' must be a string or an integer, found {json.dumps(ident)}"
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            return None, f"'prompt' must be a string, found {type(obj['prompt']).__name__}"
        return PromptRecord(ident, line, prompt=obj["prompt"], id_derived="id" not in obj), None
    msgs = obj["messages"]
    problem = _check_messages(msgs)
    if problem:
        return None, problem
    if msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
        if not msgs:
            return None, "'messages' has only an assistant turn; there is nothing to prompt with"
    return PromptRecord(ident, line, messages=msgs, id_derived="id" not in obj), None


def read_prompts(path: str) -> tuple[list[PromptRecord], list[str]]:
    """All valid records, and one message per bad line (``line N: why``); a repeated explicit id is a
    bad line (a repeated content id cannot happen: repeats are numbered)."""
    records: list[PromptRecord] = []
    errors: list[str] = []
    seen: dict[str, PromptRecord] = {}   # key -> the line that used it first
    repeats: dict[str, int] = {}   # content id -> how many lines without an id have had that content
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read --input {path}: {e.strerror}") from e
    with f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(f"line {line_no}: not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text.strip():
                continue
            rec, problem = _parse_line(text, line_no)
            if problem is None and rec.id_derived:
                base = content_id(rec)
                repeats[base] = repeats.get(base, 0) + 1
                rec.id = base if repeats[base] == 1 else f"{base}-{repeats[base]}"
            if problem is None and rec.key in seen:
                first = seen[rec.key]
                if rec.id_derived:
                    problem = (f"the id derived from this line's content, {rec.key}, is the explicit id of line "
                               f"{first.line}; give this line an 'id'")
                elif first.id_derived:
                    problem = (f"id {rec.key} is the id derived from the content of line {first.line} (which "
                               "has no 'id'); choose another id")
                else:
                    problem = f"id {rec.key} was already used on line {first.line}"
            if problem is not None:
                errors.append(f"line {line_no}: {problem}")
                continue
            seen[rec.key] = rec
            records.append(rec)
    return records, errors
