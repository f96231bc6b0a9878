"""The README's Python example runs as printed (on the demo pair, one device)."""

import re

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
