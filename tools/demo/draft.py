"""Stages 4 and 5: the draft's training data and the draft, through the product's own CLIs.

Stage 4 runs ``serve.py --emit training`` with the demo target on prompts cut from the *train*
files, so the draft learns to predict what this target actually generates. Stage 5 runs
``train.py --config configs/train/demo.yaml`` on that output. Both only call the CLIs; when a CLI
does not offer what a stage needs yet, the stage stops and says what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tools.demo import REPO


class StageUnavailable(RuntimeError):
    """A stage cannot run yet: a CLI or config it relies on is missing."""


def _help(script: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(REPO, script), "--help"], capture_output=True,
                          text=True, cwd=REPO)
    if proc.returncode != 0:
        raise StageUnavailable(f"`python {script} --help` failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    return proc.stdout


def _run(cmd: list[str], say) -> None:
    say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed with exit {proc.returncode}: {' '.join(cmd)}")


def regenerate(target_dir: str, prompts: str, output: str, max_new_tokens: int, batch_size: int, max_len: int,
               temperatures: tuple[float, ...] = (0.0,), seed: int = 0, say=print) -> str:
    """Stage 4: the target's continuations of ``prompts`` as {"messages": [...]} records.

    With several ``temperatures`` the prompts are dealt round-robin into one share per temperature
    (prompt i goes to temperatures[i % n]) and each share is served at its temperature: a draft
    trained only on greedy continuations meets sampled text it has never seen, and its acceptance
    falls off by position at T > 0. The shares are concatenated in temperature order into ``output``.
    """
    text = _help("serve.py")
    missing = [flag for flag in ("--emit", "--target", "--input", "--output", "--max-new-tokens", "--seed")
               if flag not in text]
    if missing or "training" not in text:
        raise StageUnavailable(
            f"serve.py does not support {', '.join(missing) or '--emit training'} yet; stage 4 needs "
            "`serve.py --target DIR --input PROMPTS --output OUT --emit training`")
    if not os.path.isfile(os.path.join(target_dir, "model.safetensors")):
        raise StageUnavailable(f"{target_dir} holds no exported target; run stage 6 (or stages 3 and 6) first")
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures: expected one or more values >= 0, found {list(temperatures)}")
    with open(prompts) as f:
        lines = [line for line in f if line.strip()]
    parts = []
    for i, temperature in enumerate(temperatures):
        share = lines[i::len(temperatures)]
        if len(temperatures) == 1:
            share_in, share_out = prompts, output
        else:
            share_in = f"{output}.T{temperature:g}.prompts.jsonl"
            share_out = f"{output}.T{temperature:g}.jsonl"
            with open(share_in, "w") as f:
                f.writelines(share)
        say(f"regenerating {len(share)} prompts at temperature {temperature:g}")
        cmd = [sys.executable, "serve.py", "--target", target_dir, "--input", share_in, "--output", share_out,
               "--emit", "training", "--max-new-tokens", str(max_new_tokens), "--batch-size", str(batch_size),
               "--max-len", str(max_len), "--temperature", f"{temperature:g}", "--seed", str(seed + i),
               "--mesh", "none",
               # float32: CPU backends have no fast bfloat16 matmuls
               "--dtype", "float32"]
        _run(cmd, say)
        parts.append(share_out)
    if len(parts) > 1:
        # written whole to a temporary name first: a crash never leaves a half-joined output behind
        with open(output + ".tmp", "w") as out:
            for part in parts:
                with open(part) as f:
                    out.write(f.read())
        os.replace(output + ".tmp", output)
    return output


def train_draft(config: str, target_dir: str, data: str, run_dir: str, export_dir: str, say=print) -> str:
    """Stage 5: train.py with the demo config; the draft is exported to ``export_dir``."""
    if not os.path.isfile(os.path.join(REPO, config)):
        raise StageUnavailable(f"{config} does not exist yet; stage 5 trains the draft with "
                               f"`python train.py --config {config}`")
    _help("train.py")
    from eagle3_jax.train.config import TrainConfig

    names = set(TrainConfig.__dataclass_fields__)
    missing = [k for k in ("target", "data", "out_dir", "export_dir") if k not in names]
    if missing:
        raise StageUnavailable(f"train.py's config has no key(s) {missing}; stage 5 sets them on the command line")
    # train.py never writes over a draft, and rebuilding the demo is what asks to replace the shipped
    # one: the run exports into its own directory, which replaces export_dir once it is complete.
    staged = os.path.join(run_dir, "draft")
    overrides = [f"target={target_dir}", f"data={data}", f"out_dir={run_dir}", f"export_dir={staged}"]
    _run([sys.executable, "train.py", "--config", config, "--no-progress", *overrides], say)
    if not os.path.isfile(os.path.join(staged, "config.json")):
        raise RuntimeError(f"train.py finished but wrote no draft config.json to {staged}")
    if os.path.exists(export_dir):
        shutil.rmtree(export_dir)
    shutil.copytree(staged, export_dir)
    return export_dir


def heldout_acceptance(demo_dir: str, k: int, temperatures: tuple[float, ...] = (0.0, 1.0), seed: int = 0,
                       one_pass: str | None = None) -> dict:
    """Tau and per-position acceptance of the demo draft at a fixed K on every held-out prompt, greedy
    and sampled, through the public loaders (``eagle3_jax.serve.demo.DemoPair``: the same loading and
    batching as the demo). The first temperature's figures are also the top-level ``tau``.
    ``one_pass``: that one-pass draft instead (``"P-EAGLE"``, ``"DFlash"``; demo.yaml must run it at ``k``)."""
    from eagle3_jax.serve.demo import DemoPair, batches_of

    pair = DemoPair.load(demo_dir)
    s = pair.settings
    if one_pass is not None and pair.one_pass.get(one_pass, (None, 0))[1] != k:
        raise ValueError(f"demo.yaml does not run the {one_pass} draft at K={k}")
    gen = pair.one_pass_generator(one_pass, s.max_new_tokens) if one_pass else pair.generator(k, s.max_new_tokens)
    out = {"num_draft_tokens": k, "prompts": len(pair.prompt_ids), "max_new_tokens": s.max_new_tokens,
           "by_temperature": {}}
    for temperature in temperatures:
        _, stats = pair.generate(gen, batches_of(pair.prompt_ids, max(s.batch_sizes)), s.max_new_tokens,
                                 temperature=temperature, seed=seed)
        out["by_temperature"][f"{temperature:g}"] = {
            "tau": round(stats.mean_accept_length, 3),
            "accept_rate_per_position": [round(r, 3) for r in stats.accept_rate_per_position]}
    first = out["by_temperature"][f"{temperatures[0]:g}"]
    out.update(temperature=temperatures[0], **first)
    return out


def training_summary(run_dir: str) -> dict:
    """The last training row and every eval row of train.py's metrics.jsonl."""
    import json
    import os

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    last = train_rows[-1] if train_rows else {}
    return {"steps": last.get("step"), "final_loss": last.get("loss"),
            "final_acc_per_position": [round(a, 3) for a in last.get("acc", [])],
            "evals": [{"step": r["step"], "tau": round(r["eval_tau"], 3)} for r in rows if "eval_tau" in r]}
