"""Outputs of format version 1, as the extraction of that version wrote them (tests/data/format_v1: the
embedded tiny model on three records, --max-length 32; bf16, and fp8 + zstd with the pre-norm final state),
still read, verify and export (test_format_v2.py resumes them); and a run document whose key has the wrong type
is refused, naming the shard and the key."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from extract_runs import ROOT
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from offline_extract.store import integrity
from offline_extract.store.index import shard_paths
from offline_extract.store.inspection import summarize
from offline_extract.store.schema import FORMAT_VERSION, METADATA_KEY, Encoding, RunInfo, ShardError
from offline_extract.store.shard import read_header
from offline_extract.training.datasets import HiddenStateDataset
from offline_extract.training.export import export_specforge, export_speculators, speculators_path

V1 = ROOT / "tests" / "data" / "format_v1"
OUTPUTS = {"bf16": Encoding(image_mask=False), "fp8_zstd_pre": Encoding("fp8", "zstd", image_mask=False)}


@pytest.fixture(params=sorted(OUTPUTS))
def v1(request, tmp_path):
    out = tmp_path / request.param
    shutil.copytree(V1 / request.param, out)
    return out, OUTPUTS[request.param]


def _document(path) -> dict:
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()[METADATA_KEY])


def test_a_version_1_output_reads_with_its_recorded_encoding(v1):
    out, encoding = v1
    (path,) = shard_paths(out)
    document = _document(path)
    assert document["format_version"] == 1 < FORMAT_VERSION
    header = read_header(path)
    # This version's writer, resuming the run, would store its image_mask as well.
    assert header.encoding == encoding == replace(header.run.encoding, image_mask=False)
    assert header.run.stored_dtype == {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[encoding.store]
    assert str(header.run.stored_dtype).removeprefix("torch.") == document["run"]["dtype"]
    assert "dtype" not in header.run.to_json() and header.run.extra == {}
    assert header.run.layer_ids == (1, 3, 4) and header.run.compute_dtype == "float32"
    dataset = HiddenStateDataset(out, verify_checksums=True)
    assert dataset.ids == ["geo-1", "corpus.jsonl:3"] and dataset.run == header.run
    item = dataset[0]
    assert item["aux_hidden_states"].shape == (item["input_ids"].numel(), 3 * header.run.hidden_size)
    assert item["image_mask"].tolist() == [0] * item["input_ids"].numel()  # it holds no image
    assert item["hidden_states"].dtype == torch.bfloat16 and torch.isfinite(item["hidden_states"]).all()
    summary = summarize(out)
    assert summary["encoding"] == encoding.to_json() and summary["stored_dtype"] == document["run"]["dtype"]


def test_a_version_1_output_verifies_and_exports(v1, tmp_path):
    out, encoding = v1
    report = integrity.verify(out)
    assert (report.problems, report.unfinished, report.samples) == ([], [], 2)
    export_specforge(out, tmp_path / "sf", progress=False)
    spec = export_speculators(out, tmp_path / "spec", progress=False)
    # The fp8 run holds speculators' pre-norm state: its fp8 values go out as they are.
    assert any("--hidden-states-backend fp8" in note for note in spec.notes) == (encoding.store == "fp8")
    stacked = load_file(speculators_path(tmp_path / "spec", 0))["hidden_states"]
    assert stacked.shape[:2] == (HiddenStateDataset(out)[0]["input_ids"].numel(), 4)


def test_a_flipped_byte_in_a_version_1_shard_fails_its_plain_sha256(v1):
    """Its manifest records the plain sha256 of each shard (before the block checksum), which verification
    still computes for it."""
    out, _ = v1
    (path,) = shard_paths(out)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    (problem,) = integrity.verify(out).problems
    assert problem.startswith(f"{path.name}: sha256 ") and "differs from manifest.json's" in problem


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("layer_ids", "1,3,4", "a list of int or null"),
        ("store", "fp4", "'bf16' or 'fp8'"),
        ("num_layers", 8.5, "int or null"),
    ],
)
def test_a_run_key_of_the_wrong_type_is_refused_naming_the_shard_and_the_key(tmp_path, key, value, expected):
    shutil.copytree(V1 / "bf16", tmp_path / "out")
    (path,) = shard_paths(tmp_path / "out")
    document = _document(path)
    document["run"][key] = value
    save_file(load_file(path), path, metadata={METADATA_KEY: json.dumps(document)})
    with pytest.raises(ShardError, match=rf"{path}: run key '{key}' is .*, expected {expected}"):
        read_header(path)
    assert str(path) in "\n".join(integrity.verify(tmp_path / "out").problems)


def test_a_run_key_this_version_does_not_know_is_kept_as_written():
    """A library caller's own key, in a document of any version: nothing it wrote is dropped."""
    run = RunInfo.from_json({"layer_ids": [1, 2], "dtype": "bfloat16", "my_tag": {"a": 1}}, "shard_000.safetensors")
    assert (run.layer_ids, run.extra) == ((1, 2), {"my_tag": {"a": 1}})
    document = run.to_json()
    assert document["my_tag"] == {"a": 1} and "dtype" not in document
    assert RunInfo.from_json(document, "index.json") == run
