"""The names `offline_extract` promises, and that importing it stays cheap."""

import subprocess
import sys

import pytest

import offline_extract
from extract_runs import ROOT


def test_every_public_name_resolves_to_what_it_names():
    for name in offline_extract.__all__:
        assert getattr(offline_extract, name) is not None, name
    from offline_extract.extraction import run
    from offline_extract.training.datasets import HiddenStateDataset

    assert offline_extract.extract is run
    assert offline_extract.HiddenStateDataset is HiddenStateDataset


def test_importing_the_package_loads_neither_torch_nor_sglang():
    code = "import sys, offline_extract; print(sorted({'torch', 'sglang'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = offline_extract.no_such_name
