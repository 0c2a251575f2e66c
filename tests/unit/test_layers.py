"""The package's parts import downwards only: a part may import its own floor and those below it.

Read from the source (no imports run), so a wrong-way import fails here before it makes a cycle.
"""

import ast
from pathlib import Path

from extract_runs import ROOT

PACKAGE = ROOT / "offline_extract"

# Bottom first. A part is a top-level module or subpackage of offline_extract; the package itself
# (its __init__, the public API) is the top floor.
FLOORS = [
    {
        "version",
        "formatting",
        "options",
        "recipes",
        "hub",
        "default_model",
        "final_norm",
    },
    {"data"},
    {"store"},
    {"engine"},
    {"lifecycle", "training", "testing"},
    {"preflight", "planning", "summary", "feed", "parity_gate", "output", "extract_phase"},
    {"extraction"},
    {"cli"},
    {"commands"},
    {""},
]
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


def part_of(module: str) -> str:
    """'offline_extract.store.index' -> 'store'; the package itself -> ''."""
    return module.split(".")[1] if "." in module else ""


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every offline_extract module that `path` imports, `from offline_extract import x`
    counted as importing offline_extract.x when x is a module, else the package itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "offline_extract"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "offline_extract"
        ):
            if node.module == "offline_extract":
                for a in node.names:
                    is_module = (PACKAGE / f"{a.name}.py").exists() or (PACKAGE / a.name).is_dir()
                    found.append((node.lineno, f"offline_extract.{a.name}" if is_module else "offline_extract"))
            else:
                found.append((node.lineno, node.module))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_part_has_a_floor():
    parts = {part_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts - FLOOR.keys() == set(), "add the new part to FLOORS"


def test_no_part_imports_a_part_above_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = part_of(module_name(path))
        for line, module in imports(path):
            there = part_of(module)
            if FLOOR.get(there, -1) > FLOOR.get(here, len(FLOORS)):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here or 'the package'} imports {module}")
    assert wrong == []


def test_the_check_sees_a_wrong_way_import(tmp_path):
    wrong = tmp_path / "resume.py"
    wrong.write_text("from offline_extract.engine.distributed import Layout\nfrom offline_extract import extraction\n")
    assert [part_of(m) for _, m in imports(wrong)] == ["engine", "extraction"]
    assert FLOOR["engine"] > FLOOR["store"] and FLOOR["extraction"] > FLOOR["store"]


def sglang_imports(path: Path) -> list[int]:
    """The lines where `path` imports SGLang: an import statement, or importlib.import_module of a literal name."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        lines += [node.lineno] if any(n.split(".")[0] in ("sglang", "sgl_kernel") for n in names) else []
    return lines


def test_only_the_engine_package_touches_sglang():
    """SGLang's internals are pinned to one version, so every call into them stays in the engine package, where
    an upgrade has one place to look."""
    outside = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if part_of(module_name(path)) != "engine"
        for line in sglang_imports(path)
    ]
    assert outside == []
    assert sglang_imports(PACKAGE / "engine" / "sglang_adapter.py"), "the check sees the adapter's imports"


def test_the_sglang_check_sees_each_way_of_importing_it(tmp_path):
    wrong = tmp_path / "feed.py"
    wrong.write_text(
        "import sglang.srt\nfrom sglang.srt.utils import x\nimport importlib\n"
        "importlib.import_module('sgl_kernel')\nimport sglang_like\n"
    )
    assert sglang_imports(wrong) == [1, 2, 4]
