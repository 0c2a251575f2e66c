"""The family table against what reads it: each family's random checkpoint is of its SGLang class, its HF
routing names a scoring the parity gate has, and the README and docs/supported-models.md name it."""

import json
from dataclasses import replace

import pytest

from extract_runs import ROOT
from offline_extract.engine import parity
from offline_extract.engine.families import BY_NAME, FAMILIES, cpu_models, hf_routings
from offline_extract.testing.models import VISION_LANGUAGE, build_model, towers


@pytest.mark.parametrize("name", [n for f in FAMILIES for n in (f.name, *f.variants)])
def test_each_familys_random_checkpoint_is_of_its_sglang_class(name, tiny_model_dir, tmp_path):
    family = BY_NAME.get(name) or cpu_models()[name]
    config = json.loads(
        (build_model(name, tmp_path / name, tokenizer_dir=tiny_model_dir, weights=False) / "config.json").read_text()
    )
    assert config["architectures"] == [family.sglang_class]


def test_the_vision_language_models_are_the_families_whose_images_are_extracted():
    assert list(VISION_LANGUAGE) == [f.name for f in FAMILIES if f.images]
    # Family.images alone says which take images: a family without it has no tower.
    assert towers([replace(BY_NAME["qwen3_vl"], images=None)]) == {}


def test_every_hf_routing_names_a_scoring_the_parity_gate_has():
    assert {r.scoring for r in hf_routings().values()} <= set(parity.SCORING)


def test_names_and_classes_are_each_one_familys():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert len({f.sglang_class for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("page", ["README.md", "docs/supported-models.md"])
def test_the_model_tables_name_every_family(page):
    text = (ROOT / page).read_text()
    assert [f.sglang_class for f in FAMILIES if f"`{f.sglang_class}`" not in text] == []
