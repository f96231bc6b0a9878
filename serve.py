"""Batch generation CLI (target + EAGLE-3 draft).

The crash-safe JSONL batch job is not built yet; until it is, this prints how to generate from
Python with the same engine.
"""

import sys

USAGE = """\
serve.py: the batch job (JSONL in/out, tokenizer, crash-safe resume) is not built yet, and the
embedded demo models are not shipped yet.

Generate from Python with the same engine:

    import eagle3_jax as e3
    target = e3.load_target("HF_TARGET_DIR", dtype="bfloat16", mesh="data=1,expert=8,tensor=1")
    draft = e3.load_draft("EAGLE3_DRAFT_DIR", target=target)
    gen = e3.Generator(target, draft=draft, num_draft_tokens=4, max_len=4096)
    res = gen.generate([[token ids ...]], max_new_tokens=256)
    print(res.tokens, res.stats.mean_accept_length)
"""


def main(argv=None) -> int:
    print(USAGE)
    return 2 if (argv if argv is not None else sys.argv[1:]) else 0


if __name__ == "__main__":
    sys.exit(main())
