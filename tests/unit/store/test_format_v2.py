"""An output of format version 2, as the extraction of that version wrote it (tests/data/format_v2: the embedded
tiny model on the three records of tests/data/format_v1, --max-length 32, bf16), before shards recorded which
tokens stand for images: still read (an image_mask of zeros), verified and exported; and this version resumes it, and
those of version 1 (tests/data/format_v1), into shards that hold the image mask."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from extract_runs import ROOT
from safetensors import safe_open

from offline_extract.store import integrity, manifest, resume
from offline_extract.store.index import read_index, shard_paths, write_index
from offline_extract.store.schema import FORMAT_VERSION, METADATA_KEY, Encoding
from offline_extract.store.shard import open_shard, read_header
from offline_extract.testing.shards import write_samples
from offline_extract.training.datasets import HiddenStateDataset
from offline_extract.training.export import export_specforge

V2 = ROOT / "tests" / "data" / "format_v2"


@pytest.fixture
def v2(tmp_path):
    shutil.copytree(V2 / "bf16", tmp_path / "bf16")
    return tmp_path / "bf16"


def _document(path) -> dict:
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()[METADATA_KEY]), set(f.keys())


def test_a_version_2_output_reads_with_no_image_tokens_verifies_and_exports(v2, tmp_path):
    (path,) = shard_paths(v2)
    document, names = _document(path)
    assert document["format_version"] == 2 < FORMAT_VERSION and "image_mask" not in names
    header = read_header(path)
    assert header.encoding == Encoding(image_mask=False)
    assert [s.images_sha256 for s in header.samples] == [None, None]
    shard = open_shard(path)
    item = shard.sample(0)
    assert item["image_mask"].dtype == torch.uint8 and not item["image_mask"].any()
    assert item["image_mask"].shape == item["loss_mask"].shape
    dataset = HiddenStateDataset(v2, verify_checksums=True)
    assert dataset.ids == ["geo-1", "corpus.jsonl:3"]
    assert torch.equal(dataset[1]["image_mask"], torch.zeros_like(dataset[1]["loss_mask"]))
    report = integrity.verify(v2)
    assert (report.problems, report.unfinished, report.samples) == ([], [], 2)
    export_specforge(v2, tmp_path / "sf", progress=False)
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == 2


# Each older output this version resumes: (version, run); the runs of one version share a corpus.
OLDER = [(1, "bf16"), (1, "fp8_zstd_pre"), (2, "bf16")]


@pytest.mark.parametrize("version, name", OLDER, ids=[f"v{v}-{name}" for v, name in OLDER])
def test_this_version_resumes_an_older_output_into_shards_that_hold_the_image_mask(tmp_path, version, name):
    """The same run's facts, as this version records them, are the recorded identity; new shards, with this
    version's image mask, join the old ones and the directory stays one data set."""
    older = ROOT / "tests" / "data" / f"format_v{version}"
    out = tmp_path / name
    shutil.copytree(older / name, out)
    corpus = older / "corpus.jsonl"
    (path,) = shard_paths(out)
    run = read_header(path).run
    assert resume.finished(out, run, [corpus]) is not None
    assert resume.finished(out, replace(run, max_length=64), [corpus]) is None
    assert resume.check_identity(out, manifest.run_identity(run, [corpus]), force=False) == []
    with pytest.raises(resume.TakeoverError, match="layer_ids"):
        resume.check_identity(out, manifest.run_identity(replace(run, layer_ids=(1, 2, 3)), [corpus]), force=True)

    rows = 5
    image_mask = torch.tensor([0, 1, 1, 0, 0], dtype=torch.uint8)
    (new,) = write_samples(
        out,
        run,
        [rows],
        torch.arange(rows),
        torch.tensor([1, 0, 0, 1, 1]),
        torch.randn(rows, 3 * run.hidden_size),
        torch.randn(rows, run.hidden_size),
        indices=[7],
        index=False,
        shard_numbers=iter([1]),
        image_mask=image_mask,
    )
    document, names = _document(new)
    assert document["format_version"] == FORMAT_VERSION and "encoding" not in document and "image_mask" in names
    result = manifest.load(out)["result"]
    manifest.consolidate(out, result={**result, "records": result["records"] + 1, "extracted": result["extracted"] + 1})
    write_index(out)
    assert read_index(out)["format_version"] == FORMAT_VERSION
    assert integrity.verify(out).problems == []
    dataset = HiddenStateDataset(out, verify_checksums=True)
    assert dataset.ids == ["geo-1", "corpus.jsonl:3", "s7"]
    assert dataset[2]["aux_hidden_states"].shape == (rows, 3 * run.hidden_size)
    assert dataset[2]["image_mask"].tolist() == image_mask.tolist() and not dataset[0]["image_mask"].any()
