"""The SGLang releases the engine runs on (engine/sglang_releases.py): an unsupported one is refused before
SGLang is imported, naming the supported releases, and setup.cfg installs exactly those, a fresh machine the
tested one."""

import configparser

import pytest
from extract_runs import ROOT
from packaging.requirements import Requirement

from offline_extract.engine import sglang_releases
from offline_extract.engine.sglang_adapter import Engine, EngineConfig
from offline_extract.engine.sglang_releases import SUPPORTED, UnsupportedSGLang


@pytest.fixture
def installed_sglang(monkeypatch):
    """Sets the SGLang version the environment reports for the rest of the test."""

    def install(version: str) -> None:
        monkeypatch.setattr(sglang_releases, "installed_version", lambda: version)
        sglang_releases.installed.cache_clear()

    yield install
    monkeypatch.undo()
    sglang_releases.installed.cache_clear()


@pytest.mark.parametrize("version", ["0.5.16", "0.5.20", "0.5.24", "none"])
def test_an_unsupported_sglang_is_refused_before_it_is_imported(version, installed_sglang, tiny_model_dir):
    installed_sglang(version)
    with pytest.raises(UnsupportedSGLang) as refused:
        Engine(EngineConfig(model_path=str(tiny_model_dir), device="cpu"))
    assert str(refused.value) == (
        f"SGLang {version} is installed, but the engine runs only on SGLang 0.5.17 and 0.5.23 (the releases "
        f"between are not supported). Install one: pip install sglang==0.5.23"
    )


def test_the_installed_sglang_is_a_supported_one():
    assert sglang_releases.installed().version in SUPPORTED


def _requirements(config: configparser.ConfigParser, section: str, key: str) -> list[Requirement]:
    lines = [line.strip() for line in config[section][key].splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


def test_setup_cfg_installs_exactly_the_supported_releases_and_lets_sglang_pin_torch():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = _requirements(config, "options", "install_requires")
    (sglang,) = [r for r in requirements if r.name == "sglang"]
    candidates = [f"0.5.{minor}" for minor in range(10, 30)]
    assert [v for v in candidates if sglang.specifier.contains(v)] == list(SUPPORTED)
    assert "torch" not in [r.name for r in requirements]  # each release pins its own
    # The `tested` extra (the README's first command, CI's whole suite) pins one of them, and its torch with it.
    tested = _requirements(config, "options.extras_require", "tested")
    (pinned,) = [r for r in tested if r.name == "sglang"]
    assert str(pinned.specifier) in [f"=={v}" for v in SUPPORTED]
    assert "torch" not in [r.name for r in tested]
