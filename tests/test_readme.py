"""The README runs as printed from a fresh clone: its Python example (on the demo pair, one
device) and its shell commands (the quick block here, the slow training block on request)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import eagle3_jax as e3

from tests.serve_fixtures import REPO

MARKER = "<!-- readme-example: python-api -->"


def readme_example() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert MARKER in text, f"README.md lost the marker {MARKER!r} before its Python example"
    m = re.compile(r"```python\n(.*?)```", re.S).match(text, text.index(MARKER) + len(MARKER) + 1)
    assert m, f"no ```python block right after {MARKER!r} in README.md"
    return m.group(1)


def test_readme_python_example_runs_as_printed(monkeypatch, capsys):
    if not (REPO / "demo" / "target" / "config.json").is_file():
        pytest.skip("demo/ is not in this checkout")
    monkeypatch.chdir(REPO)
    code = readme_example()
    namespace = {"__name__": "readme_example"}
    exec(compile(code, "README.md (python-api example)", "exec"), namespace)
    res, out = namespace["res"], namespace["out"]
    assert len(res.tokens) == 1 and 1 <= len(res.tokens[0]) <= 32
    assert res.stats.mean_accept_length >= 1.0
    T = len(namespace["prompt_ids"][0])
    cfg = e3.TargetConfig.from_path(REPO / "demo" / "target")
    assert out.logits.shape == (1, T, cfg.vocab_size)
    assert out.aux_hidden.shape == (1, T, 3 * cfg.hidden_size)
    printed = capsys.readouterr().out
    assert res.finish_reasons[0] in printed


def test_links_in_readme_and_docs_resolve():
    """Every relative link in README.md and docs/*.md names a file or folder of the repository."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert len(pages) > 1 and not broken, f"links to nothing: {broken}"


# ---------------------------------------------------------------------- the shell commands
COMMANDS = re.compile(r"<!-- readme-commands: (quick|slow) -->\n```bash\n(.*?)```", re.S)
# Files a fresh clone has that the commands name; they run in a scratch directory that links to
# them, so what they write (build/...) stays out of the checkout.
CLONE = ("demo", "configs", "eagle3_jax", "tools", "serve.py", "train.py")


def readme_commands(kind: str) -> list[str]:
    blocks = [body for k, body in COMMANDS.findall((REPO / "README.md").read_text(encoding="utf-8")) if k == kind]
    assert blocks, f"README.md has no <!-- readme-commands: {kind} --> block"
    return [line for body in blocks for line in body.splitlines() if line.strip() and not line.startswith("#")]


def run_as_printed(command: str, cwd) -> subprocess.CompletedProcess:
    """One README line as a user runs it: `python` is this interpreter, the environment has no
    test settings (no JAX_PLATFORMS, no fake devices); the suite's compile cache is shared."""
    from tests.conftest import suite_cache_env

    argv = shlex.split(command)
    assert argv[0] == "python", f"README command does not start with python: {command}"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(suite_cache_env(), PYTHONPATH=str(REPO), ALLOW_MULTIPLE_LIBTPU_LOAD="1")   # see test_quiet_start
    return subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1800)


@pytest.fixture
def clone(tmp_path):
    if not (REPO / "demo" / "target" / "config.json").is_file():
        pytest.skip("demo/ is not in this checkout")
    for name in CLONE:
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def check_ran(command: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    libtpu = [ln for ln in proc.stderr.splitlines() if "Failed to find host bounds" in ln or "TPU_WORKER_HOSTNAMES" in ln]
    assert not libtpu, f"{command}: libtpu's start-up reached the user:\n" + "\n".join(libtpu)


def test_readme_quick_commands_run_as_printed(clone):
    commands = readme_commands("quick")
    assert any(c.startswith("python serve.py") for c in commands)
    for command in commands:
        check_ran(command, run_as_printed(command, clone))
    served = [json.loads(line) for line in (clone / "build" / "served.jsonl").read_text().splitlines()]
    assert served and all(r["finish_reason"] in ("eos", "length") for r in served)


@pytest.mark.skipif(os.environ.get("EAGLE3_README_SLOW") != "1",
                    reason="the README's slow block (regenerate, train, serve; ~13 min of 2-core CPU time): "
                           "set EAGLE3_README_SLOW=1")
def test_readme_train_commands_run_as_printed_and_the_draft_serves(clone):
    commands = readme_commands("slow")
    for command in commands:
        check_ran(command, run_as_printed(command, clone))
    draft = clone / "build" / "quick" / "run" / "draft"
    assert (draft / "config.json").is_file() and (draft / "model.safetensors").is_file()
    metrics = json.loads((clone / "build" / "quick" / "metrics.json").read_text())
    assert metrics["prompts"] > 0 and metrics["errors"] == 0
    assert metrics["mean_accept_length"] > 1.0, metrics   # the trained draft's guesses are accepted
