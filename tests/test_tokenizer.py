"""Tokenizer loading: tokenizer.json, Kimi's tiktoken file, the byte fallback; chat templates; stop ids.

Every tokenizer here is built by the test itself."""

import base64
import json
import logging
import sys

import pytest

from eagle3_jax.tokenizer import (ByteTokenizer, HFTokenizer, TiktokenTokenizer, TokenizerError, check_vocab,
                                  load_tokenizer)
from tests.serve_fixtures import CHATML_TEMPLATE, word_level_tokenizer_files

CORPUS = ["hello world, hello tokenizer", "the quick brown fox jumps over the lazy dog",
          "speculative decoding with a draft model", "héllo wörld 你好 123456"] * 4
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def write_files(path, files: dict):
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


@pytest.fixture
def bpe_dir(tmp_path):
    """A byte-level BPE trained on a few sentences, with ChatML-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return write_files(tmp_path / "bpe", {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
                                  "chat_template": CHATML_TEMPLATE},
        "generation_config.json": {"eos_token_id": [3]},   # <|im_end|>: the end of an assistant turn
        "config.json": {"eos_token_id": 1},
    })


def test_hf_tokenizer_roundtrip_chat_template_and_stop_ids(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer)
    text = "hello world, héllo 你好"
    assert tok.decode(tok.encode(text)) == text
    # generation_config first, then config.json, then tokenizer_config's eos_token; no repeats
    assert tok.eos_token_ids == (3, 1)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    rendered = tok.render_chat(msgs)
    assert rendered == ("<s><|im_start|>system be brief<|im_end|><|im_start|>user hello world<|im_end|>"
                        "<|im_start|>assistant ")
    ids = tok.encode_chat(msgs)
    assert ids[0] == tok.token_to_id("<s>") == 0          # BOS from the template, once
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(3) == 2   # specials are single ids
    assert tok.decode(ids) == rendered


def test_template_forms_and_hf_rendering_rules(bpe_dir):
    cfg = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    # a list of named templates: "default" is used
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "{% for m in messages %}\n  {{ m.content | tojson }}"
                                                            "{% endfor %}"}]
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(bpe_dir).render_chat([{"role": "user", "content": "héllo"}]) == '  "héllo"'  # trim_blocks
    # no template in the config: chat_template.jinja is read
    del cfg["chat_template"]
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bpe_dir / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}{% endif %}"
        "U:{{ messages[0]['content'] }}")
    tok = load_tokenizer(bpe_dir)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "U:hi"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="first turn must be the user"):
        tok.render_chat([{"role": "assistant", "content": "hi"}])


def test_missing_template_and_vocab_mismatch(bpe_dir):
    cfg = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(bpe_dir)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    check_vocab(tok, tok.vocab_size, "model")
    with pytest.raises(TokenizerError, match=f"{tok.vocab_size} tokens but the model's vocab_size is 256"):
        check_vocab(tok, 256, "model")


def test_byte_fallback_only_without_tokenizer_files(tmp_path, caplog):
    d = write_files(tmp_path / "m", {"config.json": {"eos_token_id": [1, 2]}})
    with caplog.at_level(logging.INFO, logger="eagle3_jax"):
        tok = load_tokenizer(d)
    assert isinstance(tok, ByteTokenizer)
    assert "byte-level fallback" in caplog.text
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    assert tok.decode([104, 300, 105]) == "h\ufffdi"
    assert tok.eos_token_ids == (1, 2)
    assert tok.encode_chat([{"role": "user", "content": "a"}]) == list(b"<|user|>a\n<|assistant|>")
    # a tokenizer.json next to the config wins
    (d / "tokenizer.json").write_text(word_level_tokenizer_files()["tokenizer.json"])
    assert isinstance(load_tokenizer(d), HFTokenizer)


def test_word_level_fixture_fits_the_tiny_vocab(tmp_path):
    tok = load_tokenizer(write_files(tmp_path / "w", word_level_tokenizer_files()))
    assert tok.vocab_size == 256
    assert tok.encode_chat([{"role": "user", "content": "w10 w11"}]) == [0, 2, 5, 10, 11, 3, 2, 6]
    assert tok.eos_token_ids == (1,)


# ---------------------------------------------------------------------- tiktoken (Kimi)
MERGES = [b"he", b"ll", b"hell", b"hello", b"34"]


@pytest.fixture
def tiktoken_dir(tmp_path):
    ranks = [bytes([b]) for b in range(256)] + MERGES
    n = len(ranks)
    specials = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>", n + 4: "<|im_assistant|>",
                n + 5: "<|im_middle|>"}
    template = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
                "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
                "{% endif %}")
    d = write_files(tmp_path / "kimi", {
        "tokenizer_config.json": {
            "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in specials.items()},
            "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": template},
        "generation_config.json": {"eos_token_id": n + 2},
        "config.json": {"text_config": {"eos_token_id": n + 1}},
    })
    (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return d, n


def test_tiktoken_tokenizer(tiktoken_dir):
    pytest.importorskip("tiktoken")
    d, n = tiktoken_dir
    tok = load_tokenizer(d)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == n + 256   # Kimi reserves 256 special ids after the ranks
    assert tok.encode("hello") == [259]
    assert tok.encode("34") == [260]
    assert tok.encode("1234") == [49, 50, 51, 52]  # Kimi's split keeps digits in groups of <= 3: "123" "4"
    text = "héllo 你好 hello"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (n + 2, n + 1)       # generation_config, then the nested text_config / eos_token
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids == ([n + 3] + tok.encode("user") + [n + 5, 259, n + 2, n + 4] + tok.encode("assistant") + [n + 5])
    assert tok.decode([n + 100]) == f"<|reserved_token_{n + 100}|>"
    assert tok.token_to_id("<|im_end|>") == n + 2 and tok.token_to_id("hello") == 259


def test_tiktoken_missing_package_says_what_to_install(tiktoken_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(TokenizerError, match="pip install tiktoken"):
        load_tokenizer(tiktoken_dir[0])


def test_malformed_tokenizer_files(tmp_path):
    d = write_files(tmp_path / "bad", {"tokenizer.json": "{not json", "tokenizer_config.json": "{}"})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(d)
    d = write_files(tmp_path / "bad2", {"tokenizer_config.json": "[1, 2]"})
    with pytest.raises(TokenizerError, match="expected a JSON object"):
        load_tokenizer(d)
