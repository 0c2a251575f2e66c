"""No function in the product package or the checkout's benchmarks runs past 60 lines and no class body past 250,
from its `def` or `class` line to its last: bodies longer than that mix concerns (CONTRIBUTING.md, "Code")."""

import ast

import pytest

from extract_runs import ROOT

LIMITS = {ast.FunctionDef: 60, ast.AsyncFunctionDef: 60, ast.ClassDef: 250}
CHECKED = ("offline_extract", "benchmarks")
# Over its limit and still to be split along its seams; listed here by path and name until it is, and the test
# fails once it is not over any more, so that the list only shrinks.
TO_SPLIT: set[str] = set()


def _over(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each body in `source` longer than its limit."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if type(node) in LIMITS and node.end_lineno - node.lineno + 1 > LIMITS[type(node)]
    ]


def _found() -> dict[str, str]:
    """'path: name' of every body over its limit in the checked folders, with where it is and how long."""
    return {
        f"{path.relative_to(ROOT)}: {name}": f"line {line}, {lines} lines"
        for folder in CHECKED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, line, lines in _over(path.read_text())
    }


def test_no_body_in_the_package_or_the_benchmarks_is_over_its_limit():
    found = _found()
    new = [f"{body} ({where})" for body, where in found.items() if body not in TO_SPLIT]
    assert not new, "split these along their seams:\n" + "\n".join(new)
    assert TO_SPLIT <= found.keys(), f"no longer over the limit, take off TO_SPLIT: {TO_SPLIT - found.keys()}"


@pytest.mark.parametrize(("kind", "limit"), [("def f():", 60), ("class C:", 250)])
def test_a_body_one_line_over_its_limit_is_found(kind, limit):
    body = "\n".join("    x = 1" for _ in range(limit - 1))
    assert _over(f"{kind}\n{body}\n") == []
    assert _over(f"{kind}\n{body}\n    x = 2\n") == [(kind.split()[1].rstrip(":()"), 1, limit + 1)]
