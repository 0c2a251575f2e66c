"""inspect --verify on damaged, interrupted and healthy output directories."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from extract_runs import ROOT
from small_shards import RUN, write_shards

from offline_extract.store import integrity, manifest, resume
from offline_extract.store.index import write_index
from offline_extract.store.journal import Journal
from offline_extract.testing.shards import write_samples


def test_verify_reports_a_flipped_byte_a_truncated_shard_and_a_stale_index(tmp_path):
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        paths = write_shards(tmp_path, [[(i, 3)] for i in range(4)], on_written=lambda w: journal.append(vars(w)))
    manifest.consolidate(tmp_path, identity={"layer_ids": [1, 3]}, status="complete")
    write_index(tmp_path)
    assert integrity.verify(tmp_path).problems == []

    data = bytearray(paths[0].read_bytes())
    data[-5] ^= 0x01
    paths[0].write_bytes(data)
    os.truncate(paths[1], paths[1].stat().st_size - 7)
    index = json.loads((tmp_path / "index.json").read_text())
    index["shards"][2]["num_tokens"] += 1
    index["samples"]["row"][3] = 1
    (tmp_path / "index.json").write_text(json.dumps(index))

    proc = subprocess.run(
        ["python", str(ROOT / "bin" / "inspect.py"), str(tmp_path), "--verify"], capture_output=True, text=True
    )
    assert proc.returncode == 1
    problems = proc.stdout.splitlines()
    expected = [
        rf"{paths[0].name}: block_xxh3_128 \w+ differs from manifest.json's",
        rf"{paths[1].name}: \d+ bytes, but manifest.json says",
        rf"{paths[1].name} is not a readable safetensors file",
        rf"index.json: {paths[2].name} num_tokens is 4, the shard has 3",
        r"index.json: sample 's3' \(index 3\) is not at row 1 of shard 3",
        r"verified 4 shards holding 3 samples in .*: 6 problems",
    ]
    for pattern in expected:
        assert any(re.search(pattern, line) for line in problems), (pattern, problems)
    assert not any("the shards hold" in line for line in problems), "totals over 3 of 4 shards prove nothing"


def test_verify_checks_the_index_totals_and_run_against_the_shards(tmp_path):
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        write_shards(tmp_path, [[(0, 3), (1, 5)], [(2, 4)]], on_written=lambda w: journal.append(vars(w)))
    manifest.consolidate(tmp_path, identity={"layer_ids": [1, 3]}, status="complete")
    write_index(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    index["num_tokens"] += 8000
    index["run"]["layer_ids"] = [0, 1]
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert integrity.verify(tmp_path).problems == [
        "index.json: num_tokens is 8012, the shards hold 12",
        "index.json: its run differs from the one the shards record",
    ]


def verify_script(out, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bin" / "inspect.py"), str(out), "--verify", *args], capture_output=True, text=True
    )


def test_verify_tells_an_interrupted_run_from_a_damaged_one(tmp_path):
    """Killed mid-run: manifest.json says running and lists nothing yet, the journal lists three shards, and
    a fourth was renamed into place just before the kill, too late for its journal line. All four are good."""
    manifest.save(tmp_path, {"identity": {"layer_ids": [1, 3]}, "status": "running", "shards": {}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        paths = write_shards(tmp_path, [[(i, 3)] for i in range(3)], on_written=lambda w: journal.append(vars(w)))
    paths += write_shards(tmp_path, [[(3, 3)]], numbers=[3])

    report = integrity.verify(tmp_path)
    assert report.problems == [] and report.damaged == []
    assert any("has not finished" in note for note in report.unfinished)
    assert report.unfinished[1:3] == [
        "3 shards complete, not yet recorded in manifest.json because the run stopped (checked against the run's "
        f"journal): {', '.join(p.name for p in paths[:3])}",
        "1 shard complete, not yet recorded in manifest.json because the run stopped (written just before the stop; "
        f"a re-run checksums it): {paths[3].name}",
    ]
    proc = verify_script(tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "verified 4 shards holding 4 samples" in proc.stdout and "delete nothing" in proc.stdout

    data = bytearray(paths[1].read_bytes())
    data[-5] ^= 0x01
    paths[1].write_bytes(data)
    report = integrity.verify(tmp_path)
    assert report.damaged == [paths[1].name]
    assert [p for p in report.problems if not p.startswith(paths[1].name)] == []
    assert not any(paths[1].name in note for note in report.unfinished), "damaged is never 'complete'"
    proc = verify_script(tmp_path)
    assert proc.returncode == 1
    assert f"delete {paths[1].name} and re-run the extraction, which redoes exactly its samples" in proc.stdout


def test_verify_during_a_run_says_that_one_is_writing_and_to_wait(tmp_path):
    manifest.save(tmp_path, {"identity": {"layer_ids": [1, 3]}, "status": "running", "shards": {}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        paths = write_shards(tmp_path, [[(i, 3)] for i in range(2)], on_written=lambda w: journal.append(vars(w)))
    held = resume.OutputLock(tmp_path)
    try:
        proc = verify_script(tmp_path)
    finally:
        held.release()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        f"an extraction is writing {tmp_path} now (pid {os.getpid()} on {socket.gethostname()}, since " in proc.stdout
    ), proc.stdout
    assert "wait for it to end, then verify again" in proc.stdout
    assert f"because the run is still writing (checked against the run's journal): {paths[0].name}" in proc.stdout
    assert "interrupted" not in proc.stdout and "re-run" not in proc.stdout


def test_verify_without_manifest_advises_the_rerun_that_is_let_through(tmp_path):
    out, corpus = tmp_path / "out", tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    paths = write_shards(out, [[(0, 3)], [(1, 2)]])
    write_index(out)
    proc = verify_script(out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "no manifest.json: shard checksums cannot be checked"
    assert (
        "no shard is damaged as far as can be told without checksums: delete nothing; re-run the extraction with "
        "--force and the same --data (no manifest.json records its corpus), which rebuilds manifest.json"
    ) in proc.stdout
    identity = manifest.run_identity(RUN, [corpus])
    with pytest.raises(resume.TakeoverError, match="pass --force"):
        resume.check_identity(out, identity, force=False)
    assert resume.check_identity(out, identity, force=True), "the advised re-run is let through"

    os.truncate(paths[1], paths[1].stat().st_size - 7)
    proc = verify_script(out)
    assert (
        f"delete {paths[1].name} and re-run the extraction with --force and the same --data (no manifest.json "
        f"records its corpus), which redoes exactly its samples"
    ) in proc.stdout


def test_verify_counts_one_shard_as_one(tmp_path):
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        write_shards(tmp_path, [[(0, 3), (1, 2)]], on_written=lambda w: journal.append(vars(w)))
    manifest.consolidate(tmp_path, identity={"layer_ids": [1, 3]}, status="complete")
    write_index(tmp_path)
    proc = verify_script(tmp_path)
    assert proc.returncode == 0
    assert f"verified 1 shard holding 2 samples in {tmp_path}: no problems" in proc.stdout


def test_verify_refuses_a_directory_that_no_extraction_wrote(tmp_path):
    # It once listed a missing manifest.json and index.json as two problems, and advised re-running the
    # extraction to repair them.
    (tmp_path / "corpus.jsonl").write_text('{"text": "a corpus, not an output"}\n')
    proc = verify_script(tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert (
        proc.stderr.strip()
        == f"Error: {tmp_path} is not an extraction's output: it holds neither manifest.json nor shard files"
    )
    missing = verify_script(tmp_path / "nope")
    assert missing.returncode == 2 and f"{tmp_path / 'nope'} does not exist" in missing.stderr, missing.stderr


def test_verify_names_a_manifest_no_extraction_wrote(tmp_path):
    # It judged another tool's manifest.json as an interrupted run's, advising to re-run the extraction to finish it.
    (tmp_path / "manifest.json").write_text('{"name": "my-site", "files": []}')
    proc = verify_script(tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (
        f"Error: {tmp_path / 'manifest.json'} is not a manifest offline_extract wrote: it "
        f"has no format_version and no shards key"
    )


def test_verify_answers_in_json_when_asked_and_refuses_a_sample_beside_it(tmp_path):
    # --json and --sample were silently ignored beside --verify: a script parsing its output got text.
    manifest.save(tmp_path, {"identity": {"layer_ids": [1, 3]}, "status": "running", "shards": {}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        paths = write_shards(tmp_path, [[(i, 3)] for i in range(2)], on_written=lambda w: journal.append(vars(w)))
    proc = verify_script(tmp_path, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_status"] == 3
    assert (report["path"], report["shards"], report["samples"], report["problems"], report["damaged"]) == (
        str(tmp_path),
        2,
        2,
        [],
        [],
    )
    assert report["unfinished"][0] == "the run has not finished (manifest.json status 'running')"
    paths[1].write_bytes(b"not a shard")
    damaged = json.loads(verify_script(tmp_path, "--json").stdout)
    assert damaged["exit_status"] == 1 and damaged["damaged"] == [paths[1].name]
    both = verify_script(tmp_path, "--sample", "s0")
    assert both.returncode == 2 and "give one of them" in both.stderr, both.stderr
    one = verify_script(paths[0])  # the user named a shard: the directory to give is named
    assert one.returncode == 2 and (
        f"--verify checks an output directory, not one file: give {tmp_path}, which holds {paths[0].name}"
    ) in " ".join(one.stderr.split()), one.stderr


@pytest.mark.parametrize(
    "image_mask, problem",
    [
        ([0, 1, 1, 0, 0, 0], None),
        ([0, 1, 2, 0, 0, 0], "image_mask holds 1 values other than 0 and 1"),
        ([1, 1, 0, 0, 0, 1], "2 image tokens are in the loss (loss_mask 1 where image_mask is 1)"),
    ],
    ids=["sound", "not 0/1", "in the loss"],
)
def test_verify_checks_the_image_mask_against_the_loss_mask(tmp_path, image_mask, problem):
    rows, run = 6, RUN
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        (path,) = write_samples(
            tmp_path,
            run,
            [rows],
            torch.arange(rows),
            torch.tensor([1, 0, 0, 0, 1, 1]),
            torch.randn(rows, run.num_aux_layers * run.hidden_size),
            torch.randn(rows, run.hidden_size),
            image_mask=torch.tensor(image_mask, dtype=torch.uint8),
            on_written=lambda w: journal.append(vars(w)),
        )
    manifest.consolidate(tmp_path, identity={}, status="complete")
    assert integrity.verify(tmp_path).problems == ([] if problem is None else [f"{path.name}: {problem}"])
