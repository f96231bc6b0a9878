"""Rules of the code base a reviewer would otherwise check by hand: modules small enough to read
(at most 400 lines in the package, tools/ and benchmarks/), no import circles, counting the imports
made inside functions too (a lazy import is how a circle hides), no benchmark or tool that leans on
the tests (what they need lives in the library or tools/), and no draft-kind decisions outside the
registry (eagle3_jax/drafts/)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3_jax", "tools")
LINE_CAPPED = ("eagle3_jax", "tools", "benchmarks")
MAX_LINES = 400


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(path, mods):
    """Project modules that ``path`` imports anywhere in it; ``from pkg import sub`` names ``pkg.sub``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
            out |= subs
            if len(subs) < len(node.names):
                out.add(node.module)
    return out & mods.keys()


def _cycles(graph):
    state, found = {}, []

    def visit(u, stack):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_no_module_is_over_400_lines():
    files = [p for d in LINE_CAPPED for p in (ROOT / d).rglob("*.py")]
    assert any(p.name == "run_all.py" for p in files)   # the walk reached benchmarks/
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by job (at most {MAX_LINES} lines): {long}"


def _imports_tests(path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n == "tests" or n.startswith("tests.") for n in names):
            return True
    return False


def test_benchmarks_and_tools_do_not_import_the_tests():
    offenders = [str(p.relative_to(ROOT)) for d in ("benchmarks", "tools") for p in (ROOT / d).rglob("*.py")
                 if _imports_tests(p)]
    assert not offenders, f"move what these take from tests/ into the library or tools/: {offenders}"
    assert _imports_tests(ROOT / "tests" / "conftest.py")   # the check sees `from tests import ...`


def test_no_import_circles_lazy_imports_included():
    mods = _modules()
    assert "eagle3_jax.api" in mods and "tools.plan.serve" in mods   # the walk found the packages
    graph = {m: _imports(p, mods) for m, p in mods.items()}
    assert graph["eagle3_jax.api"], "the import scan found nothing in api.py"
    assert not _cycles(graph), f"import circles: {_cycles(graph)}"


def test_the_circle_finder_finds_a_lazy_circle():
    # The checker itself: a circle closed by a function-level import is reported.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _kind_comparisons(source: str, kind_names, kind_classes) -> list[int]:
    """Lines that compare a value with a draft kind's name ("peagle" == ...) or test isinstance
    against a kind's config or module class: the decisions that belong to the registry."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            consts = [c for part in [node.left, *node.comparators]
                      for c in ([part] if isinstance(part, ast.Constant) else getattr(part, "elts", []))]
            if any(isinstance(c, ast.Constant) and c.value in kind_names for c in consts):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            second = node.args[1]
            named = [e for e in (second.elts if isinstance(second, ast.Tuple) else [second])]
            if any(getattr(e, "id", getattr(e, "attr", None)) in kind_classes for e in named):
                lines.append(node.lineno)
    return lines


def test_no_draft_kind_is_compared_outside_the_registry():
    from eagle3_jax import drafts

    names = set(drafts.NAMES)
    classes = {c.__name__ for k in drafts.KINDS for c in (k.config, k.module)}
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if (ROOT / "eagle3_jax" / "drafts") in path.parents:
                continue
            if lines := _kind_comparisons(path.read_text(), names, classes):
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"ask the registry (eagle3_jax.drafts) instead of comparing draft kinds: {found}"


def test_the_kind_comparison_finder_finds_them():
    names, classes = {"peagle", "eagle3"}, {"PEagleConfig"}
    assert _kind_comparisons('if kind == "peagle": pass', names, classes) == [1]
    assert _kind_comparisons('x = k in ("eagle3", "other")', names, classes) == [1]
    assert _kind_comparisons('ok = isinstance(c, cfgs.PEagleConfig)', names, classes) == [1]
    assert _kind_comparisons('path = os.path.join(d, "peagle")\nif mode == "train": pass', names, classes) == []


# Boxes and what they never import (DESIGN.md's layering): the registry sits above the model math
# and the file formats and below everything that dispatches through it; training never reaches
# for the public facade.
NEVER_IMPORTS = {
    "eagle3_jax.drafts": ("eagle3_jax.api", "eagle3_jax.loading", "eagle3_jax.preflight", "eagle3_jax.speculative",
                          "eagle3_jax.train", "eagle3_jax.serve", "tools"),
    "eagle3_jax.models": ("eagle3_jax.drafts",),
    "eagle3_jax.config": ("eagle3_jax.drafts",),
    "eagle3_jax.checkpoint": ("eagle3_jax.drafts",),
    "eagle3_jax.train": ("eagle3_jax.api",),
}


def test_lower_boxes_never_import_higher_ones():
    mods = _modules()
    bad = []
    for m, path in mods.items():
        for box, banned in NEVER_IMPORTS.items():
            if m == box or m.startswith(box + "."):
                bad += [(m, i) for i in _imports(path, mods)
                        if any(i == b or i.startswith(b + ".") for b in banned)]
        if m.startswith("eagle3_jax.train") and "eagle3_jax" in _imports(path, mods):
            bad.append((m, "eagle3_jax (the facade)"))
    assert not bad, f"imports across the layering: {bad}"
