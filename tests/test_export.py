import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offline_extract.read_benchmark import write_synthetic
from offline_extract.store.shards import ShardError, iter_samples
from offline_extract.training.export import MANIFEST_NAME, ExportError, export_specforge, specforge_path

SCRIPT = Path(__file__).resolve().parent.parent / "bin" / "export.py"
K, H = 3, 16
LENGTHS = [5, 3, 7, 1, 9, 4, 6]
KEYS = {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}


@pytest.fixture
def out_dir(tmp_path):
    out = tmp_path / "out"
    paths = write_synthetic(out, LENGTHS, hidden_size=H, num_aux=K, shard_bytes=10 * (K + 1) * H * 2)
    assert len(paths) > 1
    return out


def shard_samples(out_dir):
    """Sample id -> tensors read with the shard API."""
    return {info.id: tensors for info, tensors in iter_samples(out_dir)}


def test_export_matches_the_shards(out_dir, tmp_path):
    dest = tmp_path / "sf"
    summary = export_specforge(out_dir, dest, rows_per_folder=3, progress=False)
    assert (summary.samples_written, summary.samples_skipped) == (len(LENGTHS), 0)

    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == sorted([
        MANIFEST_NAME,
        "rows_0-3/data_0.ckpt", "rows_0-3/data_1.ckpt", "rows_0-3/data_2.ckpt",
        "rows_3-6/data_3.ckpt", "rows_3-6/data_4.ckpt", "rows_3-6/data_5.ckpt",
        "rows_6-9/data_6.ckpt",
    ])
    assert summary.bytes_written == sum(p.stat().st_size for p in dest.rglob("*.ckpt"))

    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert manifest["ids"] == [f"sample-{i}" for i in range(len(LENGTHS))]
    assert manifest["rows_per_folder"] == 3
    assert manifest["run"]["layer_ids"] == list(range(K))

    want = shard_samples(out_dir)
    for i, sample_id in enumerate(manifest["ids"]):
        data = torch.load(specforge_path(dest, i, 3), weights_only=True)
        shard = want[sample_id]
        n = LENGTHS[i]
        assert set(data) == KEYS
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["hidden_state"].dtype == data["aux_hidden_state"].dtype == torch.bfloat16
        assert data["input_ids"].shape == data["loss_mask"].shape == (n,)
        assert data["hidden_state"].shape == (1, n, H)
        assert data["aux_hidden_state"].shape == (1, n, K * H)
        assert torch.equal(data["input_ids"], shard["input_ids"].long())
        assert torch.equal(data["loss_mask"], shard["loss_mask"].long())
        assert torch.equal(data["hidden_state"][0], shard["hidden_states"])
        assert torch.equal(data["aux_hidden_state"][0], shard["aux_hidden_states"])
        for name, t in data.items():
            # Only the sample's own bytes were saved, not the shard tensor it was read from.
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_resumes_an_interrupted_export(out_dir, tmp_path):
    dest = tmp_path / "sf"
    export_specforge(out_dir, dest, progress=False)
    specforge_path(dest, 4).unlink()
    before = specforge_path(dest, 2).stat().st_mtime_ns
    summary = export_specforge(out_dir, dest, progress=False)
    assert (summary.samples_written, summary.samples_skipped) == (1, len(LENGTHS) - 1)
    assert specforge_path(dest, 4).is_file()
    assert specforge_path(dest, 2).stat().st_mtime_ns == before


def test_refuses_a_destination_holding_other_data(out_dir, tmp_path):
    dest = tmp_path / "sf"
    export_specforge(out_dir, dest, progress=False)
    with pytest.raises(ExportError, match="different"):
        export_specforge(out_dir, dest, rows_per_folder=10, progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_specforge(out_dir, busy, progress=False)


def test_bad_out_dir_leaves_no_destination(tmp_path):
    with pytest.raises(ShardError, match="not a directory"):
        export_specforge(tmp_path / "missing", tmp_path / "sf", progress=False)
    assert not (tmp_path / "sf").exists()


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_script(out_dir, tmp_path):
    dest = tmp_path / "sf"
    done = run_script("--format", "specforge", out_dir, "--to", dest, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"wrote {len(LENGTHS)} samples" in done.stderr
    assert len(list(dest.rglob("*.ckpt"))) == len(LENGTHS)

    bad = run_script("--format", "specforge", tmp_path / "nowhere", "--to", tmp_path / "sf2", "--no-progress")
    assert bad.returncode == 1
    assert "Error:" in bad.stderr and "nowhere" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_export_with_the_progress_bar(out_dir, tmp_path, capsys):
    summary = export_specforge(out_dir, tmp_path / "sf", progress=True)
    assert summary.samples_written == len(LENGTHS)
    assert "export" in capsys.readouterr().err
