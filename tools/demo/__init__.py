"""Stages of ``tools/make_demo.py``: corpus, tokenizer, target pre-training, draft data and training, export."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
