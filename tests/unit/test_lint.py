"""The tree passes `ruff check` with the rules of ruff.toml (pyflakes, pycodestyle, bugbear), and is laid out
as `ruff format` lays it out."""

import importlib.util
import subprocess
import sys

import pytest

from extract_runs import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed: pip install -e '.[test]' installs the version setup.cfg pins",
)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_ruff_check_finds_nothing():
    proc = _ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, f"ruff check . found (fix them, or see ruff.toml):\n{proc.stdout}{proc.stderr}"


def test_ruff_format_check_finds_nothing():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, f"ruff format . would change these files (run it):\n{proc.stdout}{proc.stderr}"
