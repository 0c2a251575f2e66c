"""No function in the product package runs past 60 lines and no class body past 250, from its `def` or `class`
line to its last: bodies longer than that mix concerns (CONTRIBUTING.md, "Code")."""

import ast

import pytest

from extract_runs import ROOT

LIMITS = {ast.FunctionDef: 60, ast.AsyncFunctionDef: 60, ast.ClassDef: 250}


def _over(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each body in `source` longer than its limit."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if type(node) in LIMITS and node.end_lineno - node.lineno + 1 > LIMITS[type(node)]
    ]


def test_no_body_in_the_package_is_over_its_limit():
    found = [
        f"{path.relative_to(ROOT)}:{line} {name}: {lines} lines"
        for path in sorted((ROOT / "offline_extract").rglob("*.py"))
        for name, line, lines in _over(path.read_text())
    ]
    assert not found, "split these along their seams:\n" + "\n".join(found)


@pytest.mark.parametrize(("kind", "limit"), [("def f():", 60), ("class C:", 250)])
def test_a_body_one_line_over_its_limit_is_found(kind, limit):
    body = "\n".join("    x = 1" for _ in range(limit - 1))
    assert _over(f"{kind}\n{body}\n") == []
    assert _over(f"{kind}\n{body}\n    x = 2\n") == [(kind.split()[1].rstrip(":()"), 1, limit + 1)]
