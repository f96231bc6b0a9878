"""Rules of the code base a reviewer would otherwise check by hand: modules small enough to read
(at most 400 lines in the package, tools/ and benchmarks/), no import circles, counting the imports
made inside functions too (a lazy import is how a circle hides), and no benchmark or tool that
leans on the tests (what they need lives in the library or tools/)."""

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
