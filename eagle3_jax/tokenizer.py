"""Tokenizers for serving: Hugging Face ``tokenizer.json``, Kimi's tiktoken file, or raw bytes.

``load_tokenizer(model_dir)`` takes ``tokenizer.json`` (the ``tokenizers`` library), else
``tiktoken.model`` (``tiktoken`` with Kimi's split pattern and special tokens), else bytes (token
id = UTF-8 byte: models without tokenizer files, e.g. the tiny test targets). The chat template
(``tokenizer_config.json``'s ``chat_template`` or a ``chat_template.jinja`` file) is rendered with
jinja2 the way Hugging Face does it. Stop ids: every ``eos_token_id`` in generation_config.json and
config.json (also under ``text_config``) and the id of tokenizer_config.json's ``eos_token``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

from eagle3_jax.errors import Eagle3Error

log = logging.getLogger("eagle3_jax")

# Kimi's pre-tokenizer split: runs of Han characters alone; words (case-aware, with English
# contractions); digits in groups of at most three; punctuation runs; newlines; other whitespace.
KIMI_SPLIT_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Kimi reserves this many ids after the BPE ranks for special tokens; the unnamed ones are
# "<|reserved_token_{id}|>" so that every id the model can emit decodes to something.
KIMI_NUM_RESERVED_SPECIAL = 256

# Used only by the byte-level fallback, which has no tokenizer_config.json to carry a template.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class TokenizerError(Eagle3Error, ValueError):
    """Tokenizer files are missing, malformed, or disagree with the model."""


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(d).__name__}")
    return d


def _token_content(tok: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end a generation. A backend gives
    ``vocab_size``, ``encode(text, add_special_tokens)``, ``decode(ids)`` and ``token_to_id(token)``."""

    kind = "base"

    def __init__(self, source: str, config: dict | None = None):
        self.source = source
        self.config = config or {}
        self.chat_template: str | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._compiled_template = None

    def template_variables(self) -> dict:
        """Special tokens by name (bos_token, eos_token, ...) as chat templates expect them."""
        contents = {k: _token_content(v) for k, v in self.config.items() if k.endswith("_token")}
        return {k: c for k, c in contents.items() if c is not None}

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.source}: no chat template (tokenizer_config.json has no 'chat_template' and there is no "
                "chat_template.jinja); give plain {\"prompt\": ...} inputs or add a template")
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
            **self.template_variables())

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The rendered template already carries BOS and role markers; adding special tokens
        # again would double the BOS.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def describe(self) -> str:
        return f"{self.kind} tokenizer from {self.source} (vocab {self.vocab_size}, stop ids {list(self.eos_token_ids)})"


def _jinja_env():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# ===================================================================== backends
class HFTokenizer(Tokenizer):
    kind = "tokenizer.json"

    def __init__(self, path: str, config: dict | None):
        super().__init__(path, config)
        from tokenizers import Tokenizer as _Backend

        try:
            self._tok = _Backend.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"{path}: cannot be read by the 'tokenizers' library ({e})") from e

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class TiktokenTokenizer(Tokenizer):
    """Kimi's tokenizer: BPE ranks in ``tiktoken.model``, special tokens in tokenizer_config.json."""

    kind = "tiktoken"

    def __init__(self, path: str, config: dict | None):
        super().__init__(path, config)
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise TokenizerError(
                f"{path}: this checkpoint ships a tiktoken tokenizer (Kimi); install the 'tiktoken' package "
                "(pip install tiktoken) to use it") from e
        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as e:  # malformed base64 / rank lines
            raise TokenizerError(f"{path}: not a tiktoken BPE file (lines of 'base64-token rank'): {e}") from e
        n_base = len(ranks)
        special: dict[str, int] = {}
        for sid, entry in (self.config.get("added_tokens_decoder") or {}).items():
            content = _token_content(entry)
            if content is not None and content.encode() not in ranks:
                special[content] = int(sid)
        taken = set(special.values())
        for i in range(n_base, n_base + KIMI_NUM_RESERVED_SPECIAL):
            if i not in taken:
                special[f"<|reserved_token_{i}|>"] = i
        self._enc = tiktoken.Encoding(name="kimi-tiktoken",
                                      pat_str=KIMI_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special)
        self._special = special
        self._ranks = ranks

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special-token text in prompts and templates is meant as the special token (Kimi's own
        # tokenizer encodes with every special allowed).
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([i for i in ids if 0 <= i < self._enc.n_vocab])

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        return self._ranks.get(token.encode())


class ByteTokenizer(Tokenizer):
    """Token id = UTF-8 byte. For models that ship no tokenizer (tiny test targets, vocab >= 256)."""

    kind = "byte-level fallback"

    def __init__(self, source: str, config: dict | None):
        super().__init__(source, config)
        self.chat_template = BYTE_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past 255 (a model vocab larger than a byte) have no text: shown as U+FFFD.
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                out.append(run.decode("utf-8", errors="replace") + "\ufffd")
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        b = token.encode("utf-8")
        return b[0] if len(b) == 1 else None


# ===================================================================== loading
def _chat_template(model_dir: str, config: dict) -> str | None:
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tmpl, str):
        return tmpl
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    extra = _read_json(os.path.join(model_dir, "chat_template.json"))
    if extra and isinstance(extra.get("chat_template"), str):
        return extra["chat_template"]
    return None


def _stop_ids(model_dir: str, tok: Tokenizer) -> tuple[int, ...]:
    gen = _read_json(os.path.join(model_dir, "generation_config.json")) or {}
    cfg = _read_json(os.path.join(model_dir, "config.json")) or {}
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else {}
    ids = [i for d in (gen, cfg, text) for i in _as_id_list(d.get("eos_token_id"))]
    eos_text = _token_content(tok.config.get("eos_token"))
    eos_id = tok.token_to_id(eos_text) if eos_text is not None else None
    return tuple(dict.fromkeys(ids + ([eos_id] if eos_id is not None else [])))


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer shipped with a checkpoint directory (see the module docstring for the order)."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise TokenizerError(f"{model_dir} is not a directory; point at the model checkpoint directory")
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json")) or {}
    hf_path = os.path.join(model_dir, "tokenizer.json")
    tt_path = os.path.join(model_dir, "tiktoken.model")
    if os.path.isfile(hf_path):
        tok: Tokenizer = HFTokenizer(hf_path, config)
    elif os.path.isfile(tt_path):
        tok = TiktokenTokenizer(tt_path, config)
    else:
        log.info("%s has no tokenizer.json or tiktoken.model: using the byte-level fallback tokenizer "
                 "(token id = UTF-8 byte)", model_dir)
        tok = ByteTokenizer(model_dir, config)
    template = _chat_template(model_dir, config)
    if template is not None:
        tok.chat_template = template
    tok.eos_token_ids = _stop_ids(model_dir, tok)
    return tok


def check_vocab(tok: Tokenizer, model_vocab_size: int, where: str) -> None:
    """A tokenizer that can produce ids past the model's embedding table is the wrong tokenizer."""
    if tok.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"{where}: the {tok.kind} tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab_size}; the tokenizer files belong to a different model")
    bad = [i for i in tok.eos_token_ids if not 0 <= i < model_vocab_size]
    if bad:
        raise TokenizerError(f"{where}: stop token ids {bad} are outside the model vocab (size {model_vocab_size})")
