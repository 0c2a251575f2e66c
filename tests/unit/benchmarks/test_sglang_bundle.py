"""benchmarks/make_sglang_bundle.sh, as far as it runs without network: its shell parses, it takes the release
from engine/sglang_releases.py and refuses what that does not support, and its wheel list leaves to that file
the versions it states."""

import re
import subprocess

import pytest
from extract_runs import ROOT

from offline_extract.engine.sglang_releases import RELEASES, SUPPORTED

SCRIPT = ROOT / "benchmarks" / "make_sglang_bundle.sh"


def _run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_newest_release_has_a_wheel_list_that_leaves_its_pins_to_sglang_releases():
    names = [
        re.split("==", line.split()[0])[0]
        for line in (ROOT / "benchmarks" / f"sglang-{SUPPORTED[-1]}-bundle.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(names) > 50, names
    assert not {"sglang", "torch", "transformers"} & set(names), "sglang_releases.py states these"
    assert len(names) == len(set(names)), "one version of each: two stop the install"


@pytest.mark.parametrize("release", ["0.5.20", "0.6.0"])
def test_an_unsupported_release_is_refused_naming_the_supported_ones(release):
    result = _run(release)
    assert result.returncode != 0
    assert f"SGLang {release} is not supported; give one of {' '.join(SUPPORTED)}" in result.stderr


def test_a_supported_release_without_a_wheel_list_is_refused_before_any_download():
    (unlisted,) = [r for r in RELEASES if not (ROOT / "benchmarks" / f"sglang-{r}-bundle.txt").exists()]
    result = _run(unlisted)
    assert result.returncode == 1
    assert f"no wheel list for SGLang {unlisted}" in result.stderr


def test_an_unknown_option_is_refused():
    result = _run("--with-cuda")
    assert result.returncode == 2 and "unknown option --with-cuda" in result.stderr
