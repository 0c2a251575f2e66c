"""The tree passes `ruff check` with the rules of ruff.toml (pyflakes, pycodestyle, bugbear)."""

import importlib.util
import subprocess
import sys

import pytest

from extract_runs import ROOT


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed: pip install -e '.[test]' installs the version setup.cfg pins",
)
def test_ruff_check_finds_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, f"ruff check . found (fix them, or see ruff.toml):\n{proc.stdout}{proc.stderr}"
