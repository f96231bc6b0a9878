"""Helpers for the serve tests: prompt files, running serve in-process with already loaded models,
the expected records from target-only generation, and small tokenizers built from scratch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import eagle3_jax as e3
from eagle3_jax.serve import cli
from eagle3_jax.serve.settings import ServeSettings
from eagle3_jax.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent

# Shared by every serve test so the jitted programs compile once per session.
COMMON = {"max_new_tokens": 12, "max_len": 48, "batch_size": 3, "num_draft_tokens": 3, "dtype": "float32",
          "mesh": "none"}

# Under 16 bytes each: one padded prompt shape, one compile.
PROMPTS = ["hello world", "the quick fox", "abc", "jumps over", "x", "serve me", "count 1 2 3", "zz top",
           "eagle", "experts", "tau", "ok"]
# Every serve test's model directory has three stop ids, so all runs share one compiled program
# (the engine's programs are specialized on the number of stop ids).
BYTE_STOP_IDS = [1, 254, 255]


def write_jsonl(path, rows) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_rows(prompts=PROMPTS, prefix="p") -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": p} for i, p in enumerate(prompts)]


def argv(target_dir, inp, out, draft_dir=None, **overrides) -> list[str]:
    opts = dict(COMMON, **overrides)
    args = ["--target", str(target_dir), "--input", str(inp), "--output", str(out)]
    if draft_dir is not None:
        args += ["--draft", str(draft_dir)]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is not None and v is not False:
            args += [flag, str(v)]
    return args


class ModelCache:
    """``models`` callable for ``cli.run``: hands out already loaded models (no reload, no recompile)."""

    def __init__(self, target, drafts: dict):
        self.target = target
        self.drafts = drafts  # draft dir (str) -> LoadedDraft
        self.calls = 0

    def __call__(self, s: ServeSettings, dtype: str):
        self.calls += 1
        assert dtype == "float32" and s.mesh == "none", "serve tests run the fixture models unsharded in float32"
        return self.target, (self.drafts[str(s.draft)] if s.draft else None)


def serve(models, target_dir, inp, out, draft_dir=None, **overrides) -> int:
    """``python serve.py ...`` in-process, with the given loaded models."""
    return cli.main(argv(target_dir, inp, out, draft_dir, **overrides), models=models)


def expected_text_records(target, target_dir, rows, max_new_tokens=COMMON["max_new_tokens"],
                          max_len=COMMON["max_len"], tokens: dict | None = None) -> dict:
    """id -> (text, num_tokens, finish_reason) from target-only greedy generation, one prompt at a time
    (the generated ids go to ``tokens`` when given)."""
    tok = load_tokenizer(target_dir)
    gen = e3.Generator(target, None, max_len=max_len)
    out = {}
    for r in rows:
        ids = tok.encode(r["prompt"]) if "prompt" in r else tok.encode_chat(r["messages"])
        res = gen.generate([ids], max_new_tokens, eos_token_ids=tok.eos_token_ids)
        toks, reason = res.tokens[0], res.finish_reasons[0]
        if tokens is not None:
            tokens[r["id"]] = toks
        out[r["id"]] = (cli.generation_text(tok, toks, reason), len(toks), reason)
    return out


def byte_target_dir(tiny_target_dir, dst_dir, stop_ids=BYTE_STOP_IDS) -> Path:
    return model_dir_with_files(tiny_target_dir, dst_dir, {"generation_config.json": {"eos_token_id": stop_ids}})


def model_dir_with_files(src_dir, dst_dir, files: dict) -> Path:
    """A copy of a checkpoint directory (weights linked, config copied) plus extra files."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix == ".safetensors" or p.name.endswith(".index.json"):
            os.symlink(p.resolve(), dst / p.name)
        elif p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    for name, content in files.items():
        (dst / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return dst


# ---------------------------------------------------------------------- tokenizers built in tests
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def word_level_tokenizer_files(vocab_size=256, specials=("<s>", "</s>", "<|im_start|>", "<|im_end|>")) -> dict:
    """A WordLevel tokenizer.json of exactly ``vocab_size`` ids (fits the tiny target's vocab)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = list(specials) + ["[UNK]", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
                                  "chat_template": CHATML_TEMPLATE},
    }
