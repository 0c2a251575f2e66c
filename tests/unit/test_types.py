"""The package passes mypy with the configuration in setup.cfg ([mypy]: every annotation holds; CONTRIBUTING.md,
"Types"), with the version the `test` extra pins."""

import subprocess
import sys

from extract_runs import ROOT


def _mypy(*args: str) -> subprocess.CompletedProcess:
    # Its cache (.mypy_cache) makes a run after the first take seconds; the first reads torch's annotations.
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "setup.cfg", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def test_mypy_finds_nothing_in_the_package():
    proc = _mypy()
    assert "No module named mypy" not in proc.stderr, "pip install -e '.[test]' installs the mypy setup.cfg pins"
    assert proc.returncode == 0, f"mypy found (fix the code or its annotations):\n{proc.stdout}{proc.stderr}"


def test_mypy_with_this_configuration_sees_a_wrong_type(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from offline_extract.formatting import plural\n\nplural('3', 'shard')\n")
    proc = _mypy(str(wrong))
    assert proc.returncode == 1 and 'incompatible type "str"; expected "int"' in proc.stdout, proc.stdout + proc.stderr
