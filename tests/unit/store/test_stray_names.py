"""Files named like shards but not as one (a copy "shard_000 - Copy.safetensors", a "shard_abc.safetensors") in a
finished output: every command and reader leaves them alone and names them in one line."""

import shutil
import warnings

import pytest
from click.testing import CliRunner
from small_shards import write_shards

from offline_extract.commands import export, inspect
from offline_extract.store import integrity, manifest
from offline_extract.store.index import write_index
from offline_extract.store.journal import Journal
from offline_extract.training.datasets import HiddenStateDataset

STRAYS = ["shard_000 - Copy.safetensors", "shard_abc.safetensors"]


@pytest.fixture
def out(tmp_path):
    """A finished output of three samples in two shards, with a copy of its first shard under each stray name."""
    out = tmp_path / "out"
    out.mkdir()
    with Journal(manifest.journal_path(out, 0)) as journal:
        paths = write_shards(out, [[(0, 3), (1, 2)], [(2, 4)]], on_written=lambda w: journal.append(vars(w)))
    manifest.consolidate(out, identity={"layer_ids": [1, 3]}, status="complete")
    write_index(out)
    for name in STRAYS:
        shutil.copy(paths[0], out / name)
    return out


def said(out) -> str:
    return f"ignored 2 files in {out} named like a shard but not shard_<digits>.safetensors, so no run's shard: " + (
        ", ".join(STRAYS)
    )


def test_verify_checks_the_shards_alone_and_names_the_others_in_one_line(out):
    report = integrity.verify(out)
    assert (report.problems, report.shards, report.samples, report.ignored) == ([], 2, 3, said(out))
    checked = CliRunner().invoke(inspect.main, [str(out), "--verify"])
    assert checked.exit_code == 0, checked.output
    assert checked.output.splitlines()[0] == said(out)
    assert checked.output.splitlines()[1] == f"verified 2 shards holding 3 samples in {out}: no problems"


def test_the_summary_and_a_sample_read_the_shards_alone(out):
    with pytest.warns(UserWarning) as caught:
        summary = CliRunner().invoke(inspect.main, [str(out), "--json"])
        sample = CliRunner().invoke(inspect.main, [str(out), "--sample", "s2", "--json"])
    assert summary.exit_code == 0, summary.output
    assert '"num_shards": 2' in summary.output and '"num_samples": 3' in summary.output
    assert sample.exit_code == 0 and "shard_001.safetensors" in sample.output, sample.output
    assert [str(w.message) for w in caught] == [said(out)] * 2


def test_the_dataset_and_the_export_serve_the_shards_alone(out, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = HiddenStateDataset(out)
    assert dataset.ids == ["s0", "s1", "s2"]
    assert [str(w.message) for w in caught] == [said(out)]
    exported = CliRunner().invoke(export.main, [str(out), "--to", str(tmp_path / "sf"), "--no-progress"])
    assert exported.exit_code == 0, exported.output
    assert "wrote 3 samples" in exported.output
