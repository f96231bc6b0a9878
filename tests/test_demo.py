"""The shipped demo (demo/, built by tools/make_demo.py) through the public loaders."""

import json
import os
import pathlib

import pytest

import eagle3_jax as e3
from eagle3_jax.errors import ConfigError
from eagle3_jax.serve import demo
from eagle3_jax.speculative.session import bucket_prompt_len
from eagle3_jax.tokenizer import load_tokenizer

DEMO = str(pathlib.Path(__file__).resolve().parents[1] / "demo")
# The demo's budget (bf16 weights, tokenizer, prompts): 60 MB held the target and the chain draft;
# the P-EAGLE draft (12.9 MB, 4.2 of them its own trained embedding) took it to 61.5 MB, and the
# DFlash draft (one layer; it reads the target's embedding and head) to 63.7 MB.
MAX_DEMO_BYTES = 64 * 10**6


def test_demo_is_shipped_and_small():
    assert demo.available(DEMO), f"{DEMO} lacks target/, draft/ or prompts.jsonl; run tools/make_demo.py"
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(DEMO) for f in fs)
    assert total <= MAX_DEMO_BYTES, f"demo/ is {total / 1e6:.1f} MB"
    s = demo.DemoSettings.load(DEMO)
    assert max(s.num_prompts) <= len(demo.read_prompts(os.path.join(DEMO, "prompts.jsonl")))


def test_demo_greedy_spec_equals_target_only():
    target = e3.load_target(os.path.join(DEMO, "target"), dtype="float32")
    draft = e3.load_draft(os.path.join(DEMO, "draft"), target)
    tok = load_tokenizer(os.path.join(DEMO, "target"))
    with open(os.path.join(DEMO, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:2]
    ids = [tok.encode(p) for p in prompts]
    eos = tuple(tok.eos_token_ids)
    # Both prompts padded to the longer one's bucket (their own buckets differ): one admission
    # program per mode instead of two, as the demo pins it (DemoPair.prompt_len).
    prompt_len = bucket_prompt_len(max(len(i) for i in ids), 256)

    def run(draft, k=0):
        # The README example's settings (one row, 256 slots, 32 new tokens, K = 4 for EAGLE-3): its
        # test (test_readme.py) then finds most of its programs in the persistent cache.
        gen = e3.Generator(target, draft, num_draft_tokens=k, max_len=256, batch_size=1)
        return gen.generate(ids, 32, eos_token_ids=eos, prompt_len=prompt_len)

    ref = run(None)
    spec = run(draft, 4)
    assert spec.tokens == ref.tokens
    assert all(len(t) > 0 for t in ref.tokens)
    # The shipped draft was trained for this target: far above the 1.0 of a draft that never hits.
    assert spec.stats.mean_accept_length > 2.0, spec.stats
    # So was the shipped P-EAGLE draft (all K guesses from one pass), at the K demo.yaml runs it with.
    k = demo.DemoSettings.load(DEMO).parallel_draft_tokens
    assert k >= 1, "demo.yaml runs no P-EAGLE draft"
    par = run(e3.load_draft(os.path.join(DEMO, "peagle"), target), k)
    assert par.tokens == ref.tokens
    assert par.stats.mean_accept_length > 1.5, par.stats
    # And the shipped DFlash draft (K guesses of one block from one pass), at its demo.yaml K.
    k = demo.DemoSettings.load(DEMO).dflash_draft_tokens
    assert k >= 1, "demo.yaml runs no DFlash draft"
    block = run(e3.load_draft(os.path.join(DEMO, "dflash"), target), k)
    assert block.tokens == ref.tokens
    assert block.stats.mean_accept_length > 1.5, block.stats


def test_demo_settings_reject_unknown_keys(tmp_path):
    (tmp_path / "demo.yaml").write_text("num_draft_token: 4\n")
    with pytest.raises(ConfigError, match="unknown key"):
        demo.DemoSettings.load(str(tmp_path))
    (tmp_path / "demo.yaml").write_text("num_draft_tokens: 4\nbatch_sizes: [2]\nnum_prompts: [4]\n")
    assert demo.DemoSettings.load(str(tmp_path)).num_draft_tokens == 4
    (tmp_path / "demo.yaml").write_text("num_draft_tokens: auto\n")
    assert demo.DemoSettings.load(str(tmp_path)).num_draft_tokens == "auto"
    (tmp_path / "demo.yaml").write_text("num_draft_tokens: fast\n")
    with pytest.raises(ConfigError, match="integer or 'auto'"):
        demo.DemoSettings.load(str(tmp_path))


def test_generation_stats_combine_sums_batches():
    from eagle3_jax.metrics import GenerationStats

    a = GenerationStats(rounds=10, tokens=31, round_tokens=30, seconds=1.0, accepted_per_position=[8, 5],
                        per_row_accept_length=[3.0])
    b = GenerationStats(rounds=30, tokens=41, round_tokens=40, seconds=3.0, accepted_per_position=[12, 3],
                        per_row_accept_length=[1.5, 1.0])
    c = GenerationStats.combine([a, b])
    assert (c.rounds, c.tokens, c.round_tokens, c.seconds) == (40, 72, 70, 4.0)
    assert c.accepted_per_position == [20, 8] and c.per_row_accept_length == [3.0, 1.5, 1.0]
    assert c.mean_accept_length == 70 / 40 and c.accept_rate_per_position == [0.5, 0.2]


def test_demo_settings_need_one_prompt_count_per_batch_size(tmp_path):
    (tmp_path / "demo.yaml").write_text("batch_sizes: [1, 8]\nnum_prompts: [4]\n")
    with pytest.raises(ConfigError, match=r"batch_sizes \[1, 8\] and num_prompts \[4\] must be lists of the same length"):
        demo.DemoSettings.load(str(tmp_path))
    (tmp_path / "demo.yaml").write_text("parallel_draft_tokens: -1\n")
    with pytest.raises(ConfigError, match="parallel_draft_tokens"):
        demo.DemoSettings.load(str(tmp_path))
    (tmp_path / "demo.yaml").write_text("dflash_draft_tokens: -2\n")
    with pytest.raises(ConfigError, match="dflash_draft_tokens must be >= 0"):
        demo.DemoSettings.load(str(tmp_path))
    (tmp_path / "demo.yaml").write_text("temperatures: [0, -1]\n")
    with pytest.raises(ConfigError, match=r"temperatures must be one or more values >= 0"):
        demo.DemoSettings.load(str(tmp_path))
