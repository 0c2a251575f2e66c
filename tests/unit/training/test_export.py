import inspect
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extract_runs import ROOT

from offline_extract.store import manifest, resume
from offline_extract.store.index import iter_samples
from offline_extract.store.schema import ShardError
from offline_extract.testing.shards import write_synthetic
from offline_extract.training import export as export_module
from offline_extract.options import choices
from offline_extract.training.export import (
    EXPORTERS,
    FORMATS,
    MANIFEST_NAME,
    SPECULATORS_TRAIN_CONFIG,
    WRITERS,
    ExportError,
    export_specforge,
    export_speculators,
    specforge_path,
    speculators_layer_ids,
    speculators_path,
)

SCRIPT = ROOT / "bin" / "export.py"
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
    assert files == sorted(
        [
            MANIFEST_NAME,
            "rows_0-3/data_0.ckpt",
            "rows_0-3/data_1.ckpt",
            "rows_0-3/data_2.ckpt",
            "rows_3-6/data_3.ckpt",
            "rows_3-6/data_4.ckpt",
            "rows_3-6/data_5.ckpt",
            "rows_6-9/data_6.ckpt",
        ]
    )
    assert summary.bytes_written == sum(p.stat().st_size for p in dest.rglob("*.ckpt"))

    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert manifest["ids"] == [f"s{i}" for i in range(len(LENGTHS))]
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


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_resumed_export_writes_again_a_file_left_empty(out_dir, pre_norm_dir, tmp_path, fmt):
    """A file under its final name but empty (a power loss after its rename: per-sample files are not fsynced) was
    counted as already there, and the export served it."""
    source, path = (out_dir, specforge_path) if fmt == "specforge" else (pre_norm_dir, speculators_path)
    dest = tmp_path / fmt
    WRITERS[fmt](source, dest, progress=False)
    whole = path(dest, 5).read_bytes()
    path(dest, 5).write_bytes(b"")
    summary = WRITERS[fmt](source, dest, progress=False)
    assert (summary.samples_written, summary.samples_skipped) == (1, len(LENGTHS) - 1)
    assert path(dest, 5).read_bytes() == whole


def test_refuses_a_destination_holding_other_data(out_dir, tmp_path):
    dest = tmp_path / "sf"
    export_specforge(out_dir, dest, progress=False)
    # What differs is named, so that the export can be rerun as it was begun.
    with pytest.raises(
        ExportError,
        match=rf"^{dest} holds another export, so this one cannot resume there: "
        rf"rows_per_folder 2000 there, 10 now \(see ",
    ):
        export_specforge(out_dir, dest, rows_per_folder=10, progress=False)
    with pytest.raises(ExportError, match="cannot resume there: gzip false there, true now"):
        export_specforge(out_dir, dest, gzipped=True, progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_specforge(out_dir, busy, progress=False)


def test_bad_out_dir_leaves_no_destination(tmp_path):
    with pytest.raises(ShardError, match="missing does not exist: give an extraction.s output directory"):
        export_specforge(tmp_path / "missing", tmp_path / "sf", progress=False)
    assert not (tmp_path / "sf").exists()


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_an_unfinished_extraction_is_exported_only_when_asked(out_dir, tmp_path):
    manifest.consolidate(out_dir, identity={}, status="running")
    refused = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress")
    assert refused.returncode == 1 and "unfinished extraction" in refused.stderr and "--allow-partial" in refused.stderr
    assert not (tmp_path / "sf").exists()
    partial = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress", "--allow-partial")
    assert partial.returncode == 0, partial.stderr
    (warning,) = [line for line in partial.stderr.splitlines() if "unfinished extraction" in line]
    assert (
        warning.startswith("warning: ")
        and "UserWarning" not in partial.stderr
        and "warnings.warn" not in partial.stderr
    )
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == len(LENGTHS)


def test_an_edited_index_does_not_move_a_sample_to_another_id(out_dir, tmp_path):
    index = json.loads((out_dir / "index.json").read_text())
    ids = index["samples"]["id"]
    ids[0], ids[1] = ids[1], ids[0]
    (out_dir / "index.json").write_text(json.dumps(index))
    done = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "index.json does not match the shards" in done.stderr and "sample position 0 is id 's1'" in done.stderr
    exported = json.loads((tmp_path / "sf" / MANIFEST_NAME).read_text())
    assert exported["ids"] == [f"s{i}" for i in range(len(LENGTHS))]
    want = shard_samples(out_dir)
    for i, sample_id in enumerate(exported["ids"]):
        data = torch.load(specforge_path(tmp_path / "sf", i), weights_only=True)
        assert torch.equal(data["input_ids"], want[sample_id]["input_ids"].long()), sample_id


def test_an_export_during_a_run_says_that_one_is_writing_and_to_wait(out_dir, tmp_path):
    manifest.consolidate(out_dir, identity={}, status="running")
    held = resume.OutputLock(out_dir)
    try:
        refused = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress")
    finally:
        held.release()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"An extraction is writing it now (pid {os.getpid()} on {socket.gethostname()}, since " in said, said
    assert "wait for it to end, or allow a partial read" in said and "Re-run" not in said
    done = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress")
    assert "Re-run the extraction to finish it" in done.stderr, "once it has ended, the run was interrupted"


def test_a_shard_whose_bytes_differ_from_its_checksum_is_not_exported(out_dir, tmp_path):
    manifest.consolidate(out_dir, identity={}, status="complete")
    damaged = sorted(out_dir.glob("shard_*.safetensors"))[1]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x01  # a flipped bit in a state: same size, readable header
    damaged.write_bytes(bytes(data))
    refused = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--no-progress")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"{damaged.name}: block_xxh3_128" in refused.stderr and "differs from manifest.json's" in refused.stderr
    assert not (tmp_path / "sf").exists()
    with pytest.raises(ShardError, match=damaged.name):
        export_speculators(out_dir, tmp_path / "spec", progress=False)


def test_ctrl_c_while_a_sample_is_saved_stops_after_it_and_the_export_resumes(
    out_dir, tmp_path, monkeypatch, signals_kept
):
    # Python's own handler, as the export command runs with it (cli._Command.invoke): importing
    # offline_extract.commands, as other test files do when collected, installs the one that ends a command still
    # importing, and which handler an earlier test left is no business of this one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    saved = []
    real_save = export_module._save_specforge

    def save_then_interrupted(record, path, gzipped):
        if not saved:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-save, as Ctrl-C inside torch.save would
        real_save(record, path, gzipped)
        saved.append(path)

    monkeypatch.setattr(export_module, "_save_specforge", save_then_interrupted)
    dest = tmp_path / "sf"
    with pytest.raises(KeyboardInterrupt):
        export_specforge(out_dir, dest, progress=False)
    assert len(saved) == 1 and torch.load(specforge_path(dest, 0))["input_ids"].shape == (LENGTHS[0],)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    summary = export_specforge(out_dir, dest, progress=False)
    assert (summary.samples_skipped, summary.samples_written) == (1, len(LENGTHS) - 1)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_full_disk_names_the_file_and_errno_and_a_rerun_resumes(out_dir, pre_norm_dir, tmp_path, fmt):
    source = out_dir if fmt == "specforge" else pre_norm_dir
    limit = 1200  # bytes: less than the longest sample's file in either format

    def full_disk() -> None:
        # Ignored, SIGXFSZ no longer kills the writer; write() fails with EFBIG, as on a full disk.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    dest = tmp_path / "dest"
    full = subprocess.run(
        [sys.executable, str(SCRIPT), "--format", fmt, source, "--to", dest, "--no-progress"],
        capture_output=True,
        text=True,
        preexec_fn=full_disk,
    )
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
    assert re.search(r"Error: \[Errno 27\] File too large: '.*/\.[\w.]+\.tmp'", full.stderr), full.stderr
    assert "rerunning the same export resumes" in full.stderr
    assert not list(dest.rglob(".*.tmp")), "no partial file is left"
    done = run_script("--format", fmt, source, "--to", dest, "--no-progress")
    assert done.returncode == 0, done.stderr


def test_rows_per_folder_must_be_positive(out_dir, tmp_path):
    refused = run_script("--format", "specforge", out_dir, "--to", tmp_path / "sf", "--rows-per-folder", "0")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--rows-per-folder" in refused.stderr and "0 is not in the range x>=1" in refused.stderr


def test_script(out_dir, tmp_path):
    dest = tmp_path / "sf"
    done = run_script("--format", "specforge", out_dir, "--to", dest, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"wrote {len(LENGTHS)} samples" in done.stderr
    assert len(list(dest.rglob("*.ckpt"))) == len(LENGTHS)
    (said,) = [line for line in done.stderr.splitlines() if "manifest.json" in line]
    assert said == (
        f"warning: {out_dir} has no manifest.json, which records its shards' checksums: damage in them "
        f"cannot be told, and would be served as it is"
    ), "an output without its checksums is not served unsaid"

    bad = run_script("--format", "specforge", tmp_path / "nowhere", "--to", tmp_path / "sf2", "--no-progress")
    assert bad.returncode == 1
    assert "Error:" in bad.stderr and "nowhere" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_export_with_the_progress_bar(out_dir, tmp_path, capsys):
    summary = export_specforge(out_dir, tmp_path / "sf", progress=True)
    assert summary.samples_written == len(LENGTHS)
    assert "export" in capsys.readouterr().err


@pytest.fixture
def pre_norm_dir(tmp_path):
    out = tmp_path / "pre"
    write_synthetic(out, LENGTHS, hidden_size=H, num_aux=K, shard_bytes=10 * (K + 1) * H * 2, final_state="pre-norm")
    return out


def test_speculators_export_is_what_its_trainer_reads(pre_norm_dir, tmp_path):
    import datasets
    from safetensors.torch import load_file

    dest = tmp_path / "spec"
    summary = export_speculators(pre_norm_dir, dest, progress=False)
    assert (summary.samples_written, summary.samples_skipped) == (len(LENGTHS), 0)
    table = datasets.load_from_disk(str(dest))
    assert len(table) == len(LENGTHS) and table.format["type"] == "torch"
    want = shard_samples(pre_norm_dir)
    ids = json.loads((dest / MANIFEST_NAME).read_text())["ids"]
    freq = torch.load(dest / "token_freq.pt", weights_only=True)
    expected_freq: dict[int, int] = {}
    for i, sample_id in enumerate(ids):
        shard, row = want[sample_id], table[i]
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert torch.equal(row["input_ids"], shard["input_ids"].long())
        assert torch.equal(row["loss_mask"], shard["loss_mask"].long()) and int(row["seq_len"]) == LENGTHS[i]
        hs = load_file(speculators_path(dest, i))
        assert torch.equal(hs["token_ids"], row["input_ids"])
        assert hs["hidden_states"].shape == (LENGTHS[i], K + 1, H) and hs["hidden_states"].dtype == torch.bfloat16
        # What speculators' loader does with it: all but the last layer flattened, the last as the verifier's.
        assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), shard["aux_hidden_states"])
        assert torch.equal(hs["hidden_states"][:, -1], shard["hidden_states"])
        for t in shard["input_ids"][shard["loss_mask"].bool()].tolist():
            expected_freq[t] = expected_freq.get(t, 0) + 1
    assert freq == expected_freq
    assert not (dest / ".datasets-cache").exists()
    # Layers 0..K-1 of a (K+1)-layer model, in speculators' convention: HF indices, then num_layers.
    export_manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert export_manifest["layer_ids"] == [*range(1, K + 1), K + 1]
    assert export_manifest["target_layer_ids"] == list(range(1, K + 1))

    speculators_path(dest, 3).unlink()
    again = export_speculators(pre_norm_dir, dest, progress=False)
    assert (again.samples_written, again.samples_skipped) == (1, len(LENGTHS) - 1)
    assert len(datasets.load_from_disk(str(dest))) == len(LENGTHS)


def test_speculators_refuses_a_run_that_records_no_layer_ids():
    from dataclasses import replace

    from offline_extract.testing.shards import synthetic_run

    run = synthetic_run(hidden_size=H)
    assert speculators_layer_ids(run, "out") == [1, 2, 3, run.num_layers]
    with pytest.raises(ExportError, match="out does not record its layer_ids"):
        speculators_layer_ids(replace(run, layer_ids=None), "out")


def test_each_trainer_refuses_the_other_final_state(out_dir, pre_norm_dir, tmp_path):
    with pytest.raises(ExportError, match="holds the post-norm final state, but speculators trains on the pre-norm"):
        export_speculators(out_dir, tmp_path / "a", progress=False)
    with pytest.raises(ExportError, match="--final-state post-norm"):
        export_specforge(pre_norm_dir, tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "recipe, keys",
    [
        ("dflash", {"input_ids", "loss_mask", "hidden_states"}),
        ("dspark", {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"}),
    ],
)
def test_specforge_export_uses_each_recipes_keys(tmp_path, recipe, keys):
    out = tmp_path / recipe
    write_synthetic(out, LENGTHS[:3], hidden_size=H, num_aux=5, recipe=recipe)
    export_specforge(out, tmp_path / "sf", progress=False)
    want = shard_samples(out)
    for i in range(3):
        data = torch.load(specforge_path(tmp_path / "sf", i), weights_only=True)
        assert set(data) == keys
        assert torch.equal(data["hidden_states"][0], want[f"s{i}"]["aux_hidden_states"])
        if recipe == "dspark":
            assert torch.equal(data["target_last_hidden_states"][0], want[f"s{i}"]["hidden_states"])
    with pytest.raises(ExportError, match=f"--recipe {recipe}; speculators trains EAGLE-3"):
        export_speculators(out, tmp_path / "spec", progress=False)


@pytest.mark.parametrize(
    "options, named",
    [
        (["--gzip"], "--gzip/--no-gzip"),
        (["--no-gzip"], "--gzip/--no-gzip"),
        (["--rows-per-folder", "10"], "--rows-per-folder"),
    ],
)
def test_specforge_options_are_refused_for_speculators(pre_norm_dir, tmp_path, options, named):
    # They were dropped silently.
    refused = run_script("--format", "speculators", pre_norm_dir, "--to", tmp_path / "spec", *options)
    assert refused.returncode == 2 and f"Error: {named}: for --format specforge only, not speculators" in refused.stderr
    assert not (tmp_path / "spec").exists()


def test_script_exports_to_speculators(pre_norm_dir, tmp_path):
    done = run_script("--format", "speculators", pre_norm_dir, "--to", tmp_path / "spec")
    assert done.returncode == 0, done.stderr
    # Our bar, and none of datasets' own ("Generating train split", "Saving the dataset").
    assert re.search(f"export .*{len(LENGTHS)}/{len(LENGTHS)} samples", done.stderr), done.stderr
    assert "split" not in done.stderr and "Saving" not in done.stderr, done.stderr
    assert len(list((tmp_path / "spec" / "hidden_states").glob("hs_*.safetensors"))) == len(LENGTHS)
    # What the user must pass to speculators is said where they look.
    assert (
        f"train with --target-layer-ids {' '.join(str(k + 1) for k in range(K))} (speculators' ids: ours + 1)"
        in done.stderr
    )


def test_speculators_export_without_datasets_is_refused_before_writing_anything(pre_norm_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails as where it is not installed
    dest = tmp_path / "spec"
    with pytest.raises(ExportError, match="needs the datasets package, which is not installed: pip install datasets"):
        export_speculators(pre_norm_dir, dest, progress=False)
    assert not dest.exists()


def test_speculators_export_names_custom_layers_in_its_convention(tmp_path):
    import yaml

    out = tmp_path / "custom"
    # A 6-layer model extracted with --layers 1,3,4 (our ids: decoder layer outputs).
    write_synthetic(out, LENGTHS[:2], hidden_size=H, final_state="pre-norm", layer_ids=(1, 3, 4), num_layers=6)
    dest = tmp_path / "spec"
    export_speculators(out, dest, progress=False)
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert (manifest["layer_ids"], manifest["target_layer_ids"]) == ([2, 4, 5, 6], [2, 4, 5])
    config_text = (dest / SPECULATORS_TRAIN_CONFIG).read_text()
    config = yaml.safe_load(config_text)["train"]
    assert config["draft"]["target_layer_ids"] == [2, 4, 5]
    assert (
        config["data"]["data_path"] == str(dest.resolve())
        and config["verifier"]["verifier_name_or_path"] == "synthetic"
    )
    assert "[2, 4, 5, 6]" in config_text


def test_speculators_export_needs_the_models_layer_count(tmp_path):
    out = tmp_path / "old"
    write_synthetic(out, LENGTHS[:2], hidden_size=H, num_aux=K, final_state="pre-norm", num_layers=None)
    with pytest.raises(ExportError, match="num_layers"):
        export_speculators(out, tmp_path / "spec", progress=False)


@pytest.mark.parametrize("store, compress", [("fp8", "none"), ("bf16", "zstd"), ("nvfp4", "none")])
def test_specforge_export_of_a_smaller_run_is_gzipped_by_default(tmp_path, store, compress):
    import gzip
    import io

    from offline_extract.training.datasets import HiddenStateDataset

    out = tmp_path / "run"
    write_synthetic(out, LENGTHS, hidden_size=H, num_aux=K, store=store, compress=compress)
    export_specforge(out, tmp_path / "sf", progress=False)
    assert json.loads((tmp_path / "sf" / MANIFEST_NAME).read_text())["gzip"] is True
    ours = HiddenStateDataset(out)
    for i in range(len(LENGTHS)):
        with gzip.open(specforge_path(tmp_path / "sf", i, gzipped=True), "rb") as f:
            data = torch.load(io.BytesIO(f.read()), weights_only=True)
        assert data["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(data["hidden_state"][0], ours[i]["hidden_states"])
        assert torch.equal(data["aux_hidden_state"][0], ours[i]["aux_hidden_states"])
    plain = export_specforge(out, tmp_path / "plain", gzipped=False, progress=False)
    assert plain.samples_written == len(LENGTHS) and specforge_path(tmp_path / "plain", 0).is_file()


def test_speculators_export_of_an_fp8_run_keeps_its_bytes(tmp_path):
    from safetensors.torch import load_file

    from offline_extract.training.datasets import HiddenStateDataset

    WIDE = 256  # wide enough that the states, not the file headers, make the size
    out = tmp_path / "run"
    write_synthetic(out, LENGTHS, hidden_size=WIDE, num_aux=K, store="fp8", final_state="pre-norm")
    summary = export_speculators(out, tmp_path / "spec", progress=False)
    assert any("--hidden-states-backend fp8" in note for note in summary.notes)
    assert "hidden_states_backend: fp8" in (tmp_path / "spec" / SPECULATORS_TRAIN_CONFIG).read_text()
    ours = HiddenStateDataset(out)
    for i in range(len(LENGTHS)):
        hs, stored = load_file(speculators_path(tmp_path / "spec", i)), ours.stored(i)
        assert hs["hidden_states"].dtype == torch.float8_e4m3fn and hs["hidden_states"].shape == (
            LENGTHS[i],
            K + 1,
            WIDE,
        )
        assert hs["hidden_states_scales"].shape == (LENGTHS[i], K + 1, 1)
        assert torch.equal(
            hs["hidden_states"][:, :K].flatten(1).view(torch.uint8), stored["aux_hidden_states"].view(torch.uint8)
        )
        assert torch.equal(hs["hidden_states_scales"][:, :K, 0], stored["aux_hidden_states_scale"])
        assert torch.equal(hs["hidden_states_scales"][:, K], stored["hidden_states_scale"])
    fp8_bytes = sum(p.stat().st_size for p in (tmp_path / "spec" / "hidden_states").iterdir())
    bf16 = tmp_path / "bf16"
    write_synthetic(bf16, LENGTHS, hidden_size=WIDE, num_aux=K, final_state="pre-norm")
    export_speculators(bf16, tmp_path / "spec16", progress=False)
    bf16_bytes = sum(p.stat().st_size for p in (tmp_path / "spec16" / "hidden_states").iterdir())
    assert fp8_bytes < 0.6 * bf16_bytes, (fp8_bytes, bf16_bytes)


@pytest.mark.parametrize("final_store", [None, "fp8"])
def test_speculators_export_of_an_nvfp4_run_is_its_states_decoded_to_bf16(tmp_path, final_store):
    """speculators reads bf16, or fp8 with a scale per token: nvfp4's block scales have no place there, and an
    fp8 final state beside nvfp4 aux layers cannot share its one stacked tensor."""
    from safetensors.torch import load_file

    from offline_extract.training.datasets import HiddenStateDataset

    out = tmp_path / "run"
    write_synthetic(
        out, LENGTHS, hidden_size=H, num_aux=K, store="nvfp4", final_store=final_store, final_state="pre-norm"
    )
    summary = export_speculators(out, tmp_path / "spec", progress=False)
    stores = "fp8 and nvfp4" if final_store else "nvfp4"
    assert any(f"states written as bf16, decoded from the run's {stores}" in note for note in summary.notes)
    assert "hidden_states_backend: file" in (tmp_path / "spec" / SPECULATORS_TRAIN_CONFIG).read_text()
    ours = HiddenStateDataset(out)
    for i in range(len(LENGTHS)):
        hs = load_file(speculators_path(tmp_path / "spec", i))
        assert set(hs) == {"hidden_states", "token_ids"} and hs["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(hs["hidden_states"][:, :K].flatten(1), ours[i]["aux_hidden_states"])
        assert torch.equal(hs["hidden_states"][:, K], ours[i]["hidden_states"])


def test_each_format_is_one_exporter_whose_options_its_writer_and_the_command_take():
    # An option in the table that the writer or the command lacks would fail only when someone gives it.
    from offline_extract.commands.export import main as command

    assert FORMATS == tuple(EXPORTERS) == tuple(WRITERS)
    params = {param.name for param in command.params}
    for name, exporter in EXPORTERS.items():
        takes = inspect.signature(WRITERS[name]).parameters
        assert {"progress", "allow_partial"} <= set(takes), name
        assert set(exporter.options) <= set(takes) & params, (name, exporter.options)
        assert exporter.final_state in choices("final_state"), name


def test_a_resumed_speculators_export_counts_the_token_frequencies_of_every_sample(pre_norm_dir, tmp_path, monkeypatch):
    """Killed once `datasets` had finished its table in DEST's cache, the export was resumed: `datasets` took the
    table from that cache, never reading the samples again, and token_freq.pt was written empty."""
    dest = tmp_path / "spec"
    clean = export_speculators(pre_norm_dir, tmp_path / "clean", progress=False)
    want = torch.load(clean.dest / "token_freq.pt", weights_only=True)
    assert sum(want.values()) > 0
    remove = shutil.rmtree
    # The kill: the cache stays, and token_freq.pt is not written.
    monkeypatch.setattr(
        shutil, "rmtree", lambda path, *a, **k: None if Path(path).name == ".datasets-cache" else remove(path, *a, **k)
    )
    write = export_module.atomic_write
    monkeypatch.setattr(
        export_module,
        "atomic_write",
        lambda path, *a, **k: None if path.name == "token_freq.pt" else write(path, *a, **k),
    )
    export_speculators(pre_norm_dir, dest, progress=False)
    assert (dest / ".datasets-cache").is_dir() and not (dest / "token_freq.pt").exists()
    monkeypatch.undo()

    summary = export_speculators(pre_norm_dir, dest, progress=False)
    assert summary.samples_skipped == len(LENGTHS)
    assert torch.load(dest / "token_freq.pt", weights_only=True) == want
    assert not (dest / ".datasets-cache").exists()
