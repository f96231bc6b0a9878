"""Stage 2: a byte-level BPE tokenizer trained on the train split, saved in Hugging Face layout.

``tokenizer.json`` prepends <|bos|> when asked to add special tokens (as the corpus documents start
with it); <|eos|> ends each document. The chat template is a plain concatenation of the messages'
contents after <|bos|>: the target is a code model, not a chat model, so a {"messages": [user:
prompt, assistant: continuation]} record means exactly the text prompt + continuation. That lets
``serve.py --emit training`` output be read back as draft training data with the right loss mask.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np

BOS, EOS = "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS]  # ids 0 and 1
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def save(tok, directory: str, model_max_length: int) -> None:
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def load(directory: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """<|bos|> document <|eos|> for each text, concatenated into one uint16 stream."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts):  # the post-processor adds <|bos|>
        parts.append(np.asarray(enc.ids + [eos], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)
