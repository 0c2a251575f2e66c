"""A finished output edited or added to by hand: counts in its manifest that the shards contradict, a shard copied
under a new number, another run's shard copied in. inspect --verify names each and what to do, a rerun repairs what
it can (reading the corpus again) and refuses the rest, and no reader serves such an output as a finished run."""

import json
import shutil

import pytest
from click.testing import CliRunner
from extract_runs import ROOT
from small_shards import write_shards

from offline_extract import extraction
from offline_extract.commands import inspect
from offline_extract.options import ExtractOptions
from offline_extract.store import integrity, manifest, resume
from offline_extract.store.index import write_index
from offline_extract.store.journal import Journal
from offline_extract.store.schema import ShardError
from offline_extract.training.datasets import HiddenStateDataset

CORPUS = ROOT / "examples" / "corpus.jsonl"
RESULT = {"records": 5, "skipped": 1, "rejected": 0, "dropped": 0, "extracted": 4}


@pytest.fixture
def out(tmp_path):
    """A finished run of 5 records: 4 samples in two shards, and one record skipped."""
    out = tmp_path / "out"
    out.mkdir()
    with Journal(manifest.journal_path(out, 0)) as journal:
        write_shards(out, [[(0, 3), (1, 2)], [(2, 4), (4, 1)]], on_written=lambda w: journal.append(vars(w)))
    skipped = {"source": "c.jsonl", "line": 4, "index": 3, "id": "c.jsonl:4", "kind": "skipped", "reason": "empty"}
    (out / "rejects.jsonl").write_text(json.dumps(skipped) + "\n")
    manifest.consolidate(out, identity={"layer_ids": [1, 3]}, status="complete", result=RESULT)
    write_index(out)
    assert integrity.verify(out).problems == []
    return out


def verified(out) -> tuple[int, list[str]]:
    checked = CliRunner().invoke(inspect.main, [str(out), "--verify"])
    return checked.exit_code, checked.output.splitlines()


def edit_manifest(out, edit) -> dict:
    recorded = json.loads((out / "manifest.json").read_text())
    edit(recorded)
    (out / "manifest.json").write_text(json.dumps(recorded))
    return recorded


def test_counts_edited_in_the_manifest_are_found_and_not_served(out):
    def edit(recorded):
        recorded["shards"]["shard_001.safetensors"]["num_samples"] = 7
        recorded["result"].update(extracted=40, rejected=2)

    edit_manifest(out, edit)
    status, said = verified(out)
    assert status == 1
    assert said == [
        "manifest.json: shard_001.safetensors num_samples is 7, the shard holds 2",
        "manifest.json: result extracted is 40, the shards and rejects.jsonl hold 4",
        "manifest.json: result rejected is 2, the shards and rejects.jsonl hold 0",
        f"verified 2 shards holding 4 samples in {out}: 3 problems",
        "no shard is damaged: delete nothing, re-running the extraction repairs the rest",
    ]
    with pytest.raises(ShardError, match="is complete by its manifest.json, with counts that its shards and"):
        HiddenStateDataset(out)


def test_a_rerun_reads_the_corpus_again_where_the_manifests_counts_are_not_the_shards(
    tiny_engine, tmp_path, monkeypatch
):
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    out = tmp_path / "out"
    settings = dict(device="cpu", parity_samples=0, tokens_per_batch=256, progress=False, progress_every=0)
    opts = ExtractOptions(data=(str(CORPUS),), out=str(out), shard_bytes=64 << 10, **settings)
    extraction.run(opts)
    whole = json.loads((out / "manifest.json").read_text())

    def edit(recorded):
        recorded["shards"]["shard_001.safetensors"]["num_tokens"] += 1
        recorded["result"]["records"] = 5

    edit_manifest(out, edit)
    assert resume.finished(out, extraction.Job(opts).known, opts.data) is None, "not taken for the finished run"
    summary = extraction.run(opts)
    assert (summary.records, summary.resumed, summary.extracted) == (24, 24, 0)
    repaired = json.loads((out / "manifest.json").read_text())
    assert (repaired["status"], repaired["result"], repaired["shards"]) == (
        "complete",
        whole["result"],
        whole["shards"],
    )
    assert verified(out) == (0, [f"verified {len(whole['shards'])} shards holding 24 samples in {out}: no problems"])


def test_a_shard_copied_under_a_new_number_is_named_to_move_out(out):
    shutil.copy(out / "shard_001.safetensors", out / "shard_007.safetensors")
    status, said = verified(out)
    assert status == 1
    assert "shard_007.safetensors: not listed in manifest.json, so no shard of its run" in said
    assert "shard_007.safetensors holds 2 samples that shard_001.safetensors holds too (sample_index 2, 4)" in said
    assert said[-1] == (
        f"move shard_007.safetensors out of {out}: it is no shard of the run (samples another shard holds, or not "
        "listed in its finished manifest), which no reader or run takes as they are; then verify again"
    )
    assert not any("delete nothing" in line for line in said), said
    with pytest.raises(resume.TakeoverError, match="and shard_007.safetensors, which its manifest.json does not list"):
        resume.settle_finished(out, manifest.load(out))
    with pytest.raises(ShardError, match="holds shard_007.safetensors, which its finished run's manifest.json"):
        HiddenStateDataset(out)

    (out / "shard_007.safetensors").unlink()
    assert verified(out)[0] == 0


def test_another_runs_shard_copied_into_a_finished_output_is_never_served(out, tmp_path):
    # Samples of records 5 and 6, which the run never read: the dataset served them as the run's.
    write_shards(tmp_path / "other", [[(5, 2), (6, 3)]], numbers=[2])
    shutil.copy(tmp_path / "other" / "shard_002.safetensors", out)
    with pytest.raises(ShardError, match="holds shard_002.safetensors, which its finished run's manifest.json"):
        HiddenStateDataset(out)
    assert len(HiddenStateDataset(out, allow_partial=True)) == 6, "read as it is only when asked"
    summary = CliRunner().invoke(inspect.main, [str(out)])
    assert summary.exit_code == 1 and "Move it out of" in summary.output, summary.output
    with pytest.raises(resume.TakeoverError, match="no shard of this run"):
        resume.settle_finished(out, manifest.load(out))
    status, said = verified(out)
    assert status == 1 and said[-1].startswith("move shard_002.safetensors out of "), said
