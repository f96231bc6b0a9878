"""Shape suffixes in eagle3_jax/models/ follow the glossary in eagle3_jax/models/__init__.py.

Checked mechanically, by parsing the source (no JAX work): the glossary gives every letter one
meaning; every suffix (``x_BTD``) is made of glossary letters, digits and a trailing ``_``, in
upper case; every einsum / ``project`` string agrees with the suffixes of the arrays it is given
and of the name its result is assigned to. Whether a letter is used in its glossary meaning is
for the reader; KNOWN_MISUSES lists the names that still use a letter in another meaning, and
the last test makes sure each entry still exists, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import eagle3_jax.models

MODELS = Path(eagle3_jax.models.__file__).parent
# models/ and the expert kernels and tiled dequantization that moved from it to kernels/
FILES = sorted([p for p in MODELS.glob("*.py") if p.name != "__init__.py"]
               + [MODELS.parent / "kernels" / name for name in ("experts.py", "dequant.py")])

# a lower-case stem, then a suffix holding at least one capital, then an optional "_" (more axes)
SUFFIXED = re.compile(r"_?[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?P<suffix>[A-Za-z0-9]*[A-Z][A-Za-z0-9]*)(?P<rest>_?)")
# "B  batch rows" at the start of a glossary line or after a column gap of 3+ spaces
ENTRY = re.compile(r"(?:^\s*|\s{3,})(?P<letter>[A-Z]) {2}(?=\S)")

# name: the glossary meaning it breaks (attention.py, moe.py / experts.py, quantized.py). Keyed by
# name, not file, so moving code between files keeps its entry. Rename it, then delete the entry.
KNOWN_MISUSES = {
    "w_KNX": "K/X used for a tile of latent columns (C) and kv_b's per-head width",
    "part_BTNK": "K used for a tile of latent columns (C)",
    "lat_BTNK": "K used for a tile of latent columns (C)",
    "q_nope_BTNO": "O used for the no-rope part of a head (Z)",
    "out_BTNO": "O used for the value head width (Y)",
    "acc_BTNV": "V used for the value head width (Y)",
    "out_BTNV": "V used for the value head width (Y)",
    "idx_MK": "K used for experts chosen per token (U)",
    "weights_MK": "K used for experts chosen per token (U)",
    "w_MK": "K used for experts chosen per token (U)",
    "grouped_MGE": "G used for router groups (no letter: drop the suffix)",
    "group_score_MG": "G used for router groups (no letter: drop the suffix)",
    "group_keep_MG": "G used for router groups (no letter: drop the suffix)",
    "row_JB": "B used for the rows of one expert block (an A slice)",
    "valid_JB": "B used for the rows of one expert block (an A slice)",
    "a_JB": "B used for the rows of one expert block (an A slice)",
    "tok_JB": "B used for the rows of one expert block (an A slice)",
    "w_JB": "B used for the rows of one expert block (an A slice)",
    "x_JBD": "B used for the rows of one expert block (an A slice)",
    "g_JBF": "B used for the rows of one expert block (an A slice)",
    "u_JBF": "B used for the rows of one expert block (an A slice)",
    "y_JBD": "B used for the rows of one expert block (an A slice)",
    "packed_OW": "W used for packed int32 words (an I slice, or no suffix)",
    "scale_OG": "G used for scale groups (no letter: drop the suffix)",
    "scale_RC": "R/C used for the FP8 scale-block grid (no letter: drop the suffix)",
    "w_OT": "T used for a tile of input columns (I)",
    "w_HI": "H used for a tile of output rows (O)",
    "y_LH": "L/H used for leading axes and a tile of output rows (O)",
    "x_LI": "L used for arbitrary leading axes (layers in the glossary)",
    "acc_LO": "L used for arbitrary leading axes (layers in the glossary)",
    "y_LO": "L used for arbitrary leading axes (layers in the glossary)",
    "a_LO": "L used for arbitrary leading axes (layers in the glossary)",
    "x_LK": "L/K used for leading axes and a tile of input columns (I)",
    "w_K_": "K used for a tile of input columns (I)",
    "x_bI": "lower-case b for rows (M, or an A slice in the blocked kernel)",
    "x_KbW": "K/b/W used for nibble planes, rows and packed words (no letters: drop the suffix)",
    "q_KOW": "K/W used for nibble planes and packed words",
    "w_KOW": "K/W used for nibble planes and packed words",
    "planes_K": "K used for the 8 nibble planes of a word",
    "words_OW": "W used for packed int32 words",
    "s_OW": "W used for packed int32 words",
    "s_OG": "G used for scale groups",
    "spread_GW": "G/W used for scale groups and packed words",
    "x_bT": "lower-case b for rows; T used for a tile of input columns (I)",
    "acc_bO": "lower-case b for rows (M, or A in the blocked kernel)",
    "x_bD": "lower-case b for the rows of one expert block (an A slice)",
    "y_bD": "lower-case b for the rows of one expert block (an A slice)",
}


def glossary() -> dict[str, list[str]]:
    """letter -> the glossary lines defining it (one each, when the glossary is sound)."""
    doc = eagle3_jax.models.__doc__
    table = doc.split("\n\n")[1]   # the two-column block after the opening paragraph
    found: dict[str, list[str]] = {}
    for line in table.splitlines():
        for m in ENTRY.finditer(line):
            found.setdefault(m["letter"], []).append(line.strip())
    return found


def suffix_of(name: str) -> tuple[str, str] | None:
    m = SUFFIXED.fullmatch(name)
    return (m["suffix"], m["rest"]) if m else None


def identifiers(tree: ast.AST):
    """(name, line) for every variable, argument, attribute and keyword name in the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value.lineno


def operand_name(node: ast.AST) -> str | None:
    """The suffixed name an einsum operand's axes come from: ``x_BTD``, ``x_BTD.astype(..)``,
    ``w_KNX[..., :n]`` (plain slices keep the axes); None for anything else (a gather changes them)."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "astype":
            node = node.func.value
        elif isinstance(node, ast.Subscript):
            index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if not all(isinstance(i, ast.Slice) or (isinstance(i, ast.Constant) and i.value is Ellipsis)
                       for i in index):
                return None
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        elif isinstance(node, ast.Attribute):
            return node.attr
        else:
            return None


def is_einsum(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return (name in ("einsum", "project") and call.args and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str) and "->" in call.args[0].value)


def einsum_mismatches(tree: ast.AST):
    """(name, line, message) where an einsum term and the suffix of the array in its place disagree."""
    assigned = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[id(node.value)] = node.targets[0].id
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and is_einsum(node)):
            continue
        spec = node.args[0].value.replace(" ", "")
        ins, out = spec.split("->")
        pairs = list(zip(ins.split(","), (operand_name(a) for a in node.args[1:])))
        pairs.append((out, assigned.get(id(node))))
        for term, name in pairs:
            s = suffix_of(name) if name else None
            if s is None or s[1] or not s[0].isalpha() or "." in term:
                continue   # unsuffixed, open-ended (x_E_), multiplied (x_BT2D) or ellipsis: nothing to compare
            if term.upper() != s[0]:
                yield name, node.lineno, f"einsum '{spec}': term '{term}' vs {name}"


def suffix_problems(path: Path, letters: set[str]):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    seen = set()
    for name, line in identifiers(tree):
        s = suffix_of(name)
        if s is None or name in seen:
            continue
        seen.add(name)
        suffix = s[0]
        if suffix != suffix.upper():
            yield name, line, f"{name}: suffix '{suffix}' mixes lower and upper case"
        elif unknown := sorted({c for c in suffix if c.isalpha()} - letters):
            yield name, line, f"{name}: letters {unknown} are not in the glossary"
    yield from einsum_mismatches(tree)


def test_each_letter_has_one_meaning():
    found = glossary()
    twice = {k: v for k, v in found.items() if len(v) > 1}
    assert not twice, f"letters defined more than once in eagle3_jax/models/__init__.py: {twice}"
    assert len(found) == 26, f"the glossary parser found only {sorted(found)}: has the table's layout changed?"


def test_parser_sees_what_it_should():
    """The checks themselves can fail: a made-up module with each kind of mistake is caught."""
    src = ("import jax.numpy as jnp\n"
           "def f(x_BTD, w_DF):\n"
           "    h_BTF = jnp.einsum('btd,df->btf', x_BTD, w_DF)\n"     # agrees
           "    h_BTE = jnp.einsum('btd,df->btf', x_BTD, w_DF)\n"     # result named with the wrong letter
           "    z_BTF = jnp.einsum('bsd,df->bsf', x_BTD, w_DF)\n"     # operand term disagrees
           "    k_BT_ = w_DF[x_BTD]\n")
    tree = ast.parse(src)
    msgs = [m for _, _, m in einsum_mismatches(tree)]
    assert len(msgs) == 3 and any("h_BTE" in m for m in msgs) and sum("x_BTD" in m for m in msgs) == 1
    assert suffix_of("y_bD") == ("bD", "") and suffix_of("k_BT_") == ("BT", "_")
    assert suffix_of("TILE_COLS") is None and suffix_of("kv_b") is None and suffix_of("dequant_int4") is None


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_suffixes_follow_the_glossary(path):
    letters = set(glossary())
    problems = [f"{path.name}:{line}: {msg}" for name, line, msg in suffix_problems(path, letters)
                if name not in KNOWN_MISUSES]
    assert not problems, "shape suffixes outside the glossary (eagle3_jax/models/__init__.py):\n" + "\n".join(problems)


def test_known_misuses_still_exist():
    """An entry whose name is gone has been renamed: delete it so the list stays the work left."""
    names = {n for p in FILES for n, _ in identifiers(ast.parse(p.read_text(encoding="utf-8")))}
    stale = sorted(set(KNOWN_MISUSES) - names)
    assert not stale, f"renamed already, remove from KNOWN_MISUSES: {stale}"
