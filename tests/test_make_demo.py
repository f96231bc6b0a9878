"""tools/make_demo.py's building blocks: the corpus split and the resumable target pre-training."""

import json
import os
import signal

import numpy as np
import pytest

from tools.demo import corpus, lm, lm_state


# ---------------------------------------------------------------------- corpus
def test_module_of_groups_packages_and_their_tests():
    assert corpus.module_of("email/mime/text.py") == "email"
    assert corpus.module_of("json.py") == "json"
    assert corpus.module_of("test/test_json/test_dump.py") == "json"
    assert corpus.module_of("test/test_os.py") == "os"
    assert corpus.module_of("test/support/__init__.py") == "test"
    assert corpus.module_of("idlelib/idle_test/test_x.py") == "idlelib"
    assert corpus.is_test_path("ctypes/test/foo.py") and corpus.is_test_path("test_x.py")
    assert not corpus.is_test_path("unittest/case.py")


def test_dedupe_drops_exact_and_whitespace_copies_keeping_the_first():
    S = corpus.SourceFile
    files = [S("a.py", "x = 1\n"), S("b.py", "x = 1\n"), S("c.py", "x  =  1   \n\n"), S("d.py", "x = 2\n")]
    kept, counts = corpus.dedupe(files)
    assert [f.rel for f in kept] == ["a.py", "d.py"]
    assert counts == {"exact_duplicates": 1, "near_duplicates": 1}


def test_split_holds_out_whole_modules_and_leaves_their_tests_out():
    S = corpus.SourceFile
    files = []
    for m in range(100):
        files += [S(f"mod{m}/__init__.py", f"a = {m}\n" * 10), S(f"mod{m}/core.py", f"b = {m}\n" * 10),
                  S(f"test/test_mod{m}.py", f"t = {m}\n" * 10, is_test=True)]
    train, heldout, left_out = corpus.split(files)
    held = {f.module for f in heldout}
    lib_bytes = sum(len(f.text) for f in files if not f.is_test)
    assert 0 < len(held) and corpus.HELDOUT_TARGET * lib_bytes <= sum(len(f.text) for f in heldout) \
        <= corpus.HELDOUT_MAX * lib_bytes
    assert not held & {f.module for f in train}
    assert all(not f.is_test for f in heldout)
    assert {f.rel for f in left_out} == {f"test/test_{m}.py" for m in held}
    assert len(train) + len(heldout) + len(left_out) == len(files)


# ---------------------------------------------------------------------- resumable training
# One MoE layer (with its router bias): compiling the training step is most of this test's time.
TINY = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 1,
        "first_k_dense_replace": 0,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


def tiny_run(tmp, **over):
    hf = {**lm.target_hf_config(64, 0, 1, max_positions=16), **TINY}
    rng = np.random.default_rng(0)
    train_stream = rng.integers(0, 64, 4000).astype(np.uint16)
    heldout_stream = rng.integers(0, 64, 400).astype(np.uint16)
    s = lm.TrainSettings(**{"seq_len": 16, "batch_size": 2, "max_steps": 6, "warmup_steps": 2,
                            "eval_every_steps": 3, "eval_windows": 2, **over})
    paths = [os.path.join(tmp, n) for n in ("log.jsonl", "best.npz", "state.npz")]
    return lambda say=lambda m: None: lm.train(hf, train_stream, heldout_stream, s, *paths, say=say)


def state_arrays(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k != "__meta__"}


def log_rows(tmp):
    drop = ("elapsed_s", "cpu_s")
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in open(os.path.join(tmp, "log.jsonl"))]


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    done = tiny_run(str(whole))()
    assert done["stop_reason"] == "max_steps" and done["steps"] == 6

    def stop_after_first_eval(msg):  # a SIGTERM arriving mid-run, as when a machine is taken away
        if msg.startswith("  step     3"):
            os.kill(os.getpid(), signal.SIGTERM)

    first = tiny_run(str(parts))(stop_after_first_eval)
    assert first["stop_reason"] == "interrupted" and first["steps"] == 3
    second = tiny_run(str(parts))()
    assert second["steps"] == 6 and second["sessions"] == 2
    a, b = state_arrays(whole / "state.npz"), state_arrays(parts / "state.npz")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert log_rows(whole) == log_rows(parts)
    assert second["best_heldout_loss"] == done["best_heldout_loss"]

    with pytest.raises(SystemExit, match=r"settings\.peak_lr: checkpoint 0\.003, now 0\.001"):
        tiny_run(str(parts), peak_lr=1e-3)()


def test_a_second_trainer_on_the_same_state_is_refused(tmp_path):
    state = str(tmp_path / "state.npz")
    with lm_state.training_lock(state):
        with pytest.raises(SystemExit, match=rf"another process \(pid {os.getpid()}\) is already training"):
            with lm_state.training_lock(state):
                pass
    with lm_state.training_lock(state):  # released again
        pass


def test_rebuilt_readme_keeps_the_hand_measured_block():
    """Stage 6 rewrites demo/README.md from its summary; a block between the kept markers (results
    measured outside make_demo) is carried over verbatim, and nothing is invented without one."""
    from tools.demo import readme

    summary = {"draft_heldout": {"num_draft_tokens": 6, "prompts": 2, "max_new_tokens": 8,
                                 "by_temperature": {"0": {"tau": 3.0, "accept_rate_per_position": [0.5]}}}}
    first = readme.render(summary, out="demo", demo_bytes=0)
    assert readme.KEPT_START not in first
    block = f"{readme.KEPT_START}\n| draft | tau |\n| x | 1.23 |\n{readme.KEPT_END}"
    again = readme.render(summary, out="demo", demo_bytes=0, old_text=first + "\n" + block + "\n")
    assert block in again and again.count(readme.KEPT_START) == 1
    assert again.index("## Acceptance on the held-out prompts") < again.index(block)
