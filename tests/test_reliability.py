"""Crash safety, resume, bad input, full disks, non-finite states and verification.

The slow tests drive bin/extract.py in subprocesses on the embedded tiny model and kill, starve or
block them; the others exercise the pieces in-process.
"""
import fcntl
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from extract_runs import (
    ROOT,
    assert_only_complete_shards,
    assert_same_samples,
    extract_command,
    kill_rank_when,
    start_nodes,
)

from offline_extract.data.batching import batch_by_tokens
from offline_extract.data.tokenization import Sample
from offline_extract.default_model import TINY_VERSION
from offline_extract.engine.distributed import Layout
from offline_extract.engine.nonfinite import NonFiniteError, NonFiniteGuard
from offline_extract.engine.sglang_adapter import Captured
from offline_extract import extraction
from offline_extract.engine.distributed import Coordinator
from offline_extract.options import ExtractOptions
from offline_extract.feed import extract_batches
from offline_extract.store import integrity, manifest, resume
from offline_extract.store.index import iter_samples, shard_paths, write_index
from offline_extract.store.journal import Journal, read_journal
from offline_extract.store.schema import SampleInfo, shard_number
from offline_extract.store.shard import read_header
from offline_extract.store.writer import ShardWriter

# Small shards and batches: a few hundred short records make about 80 shards and 120 batches.
SMALL = ("--shard-size-mb", "0.15", "--tokens-per-batch", "256")
BAD_LINES = {17, 77, 137, 197, 257}
WORDS = "the quick brown fox jumps over a lazy dog while hidden states of every layer are saved".split()
RESULT = re.compile(
    r"records (\d+): extracted (\d+)(?: \((\d+) by earlier attempts\))?, skipped (\d+), rejected (\d+), dropped (\d+)"
)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def counts(stderr: str) -> dict:
    records, extracted, earlier, skipped, rejected, dropped = RESULT.search(stderr).groups()
    found = dict(records=records, extracted=extracted, earlier=earlier or 0, skipped=skipped, rejected=rejected,
                 dropped=dropped)
    return {key: int(value) for key, value in found.items()}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    (cache / f"tiny-llama-v{TINY_VERSION}").symlink_to(tiny_model_dir)
    return {**os.environ, "OFFLINE_EXTRACT_CACHE": str(cache)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 short plain-text records, five of them broken JSON."""
    rng = random.Random(5)
    lines = []
    for line in range(1, 301):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        lines.append("{broken" if line in BAD_LINES else json.dumps({"id": f"r{line}", "text": words}))
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(out, *args, env, torchrun=None, **popen):
    return subprocess.run(extract_command(out, *args, torchrun=torchrun), capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600, **popen)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_killed(out, *args, env, until, torchrun=None) -> None:
    """Starts an extraction and SIGKILLs all its processes (torchrun's workers too) once `until()` holds."""
    proc = subprocess.Popen(extract_command(out, *args, torchrun=torchrun), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    deadline = time.monotonic() + 300
    while not until():
        assert proc.poll() is None, "the run ended before its kill point"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victims = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def lock_taken(out) -> bool:
    lock = out / resume.LOCK_NAME
    return lock.exists() and lock.stat().st_size > 0


def hidden_files(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def assert_complete(out, base) -> None:
    """`out` holds exactly the samples and rejects of the uninterrupted run `base`, and verifies clean."""
    assert_same_samples(base, out)
    assert (out / "rejects.jsonl").read_text() == (base / "rejects.jsonl").read_text()
    assert hidden_files(out) == [], "no leftovers, no lock"
    assert integrity.verify(out).problems == []


@pytest.fixture(scope="module")
def baseline(corpus, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "out"
    proc = ok(run(out, "--data", corpus, *SMALL, env=env))
    assert counts(proc.stderr) == dict(records=300, extracted=295, earlier=0, skipped=0, rejected=5, dropped=0)
    return out


@pytest.mark.slow
def test_killed_at_random_points_and_resumed_equals_an_uninterrupted_run(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    rng = random.Random(2024)
    targets = [int(rng.uniform(lo, hi) * total) for lo, hi in ((0.1, 0.3), (0.35, 0.55), (0.6, 0.8))]
    # First while the model loads, before any shard; then after more and more shards.
    run_killed(out, "--data", corpus, *SMALL, env=env, until=lambda: lock_taken(out))
    kept = {}
    for target in targets:
        run_killed(out, "--data", corpus, *SMALL, env=env, until=lambda: len(shard_paths(out)) >= target)
        kept.update({p.name: sha256(p) for p in shard_paths(out)})
    assert len(kept) >= targets[-1]

    proc = ok(run(out, "--data", corpus, *SMALL, env=env))
    assert ".rejects.dp0.jsonl" in re.search(r"removed \d+ files? left by an interrupted run: .*", proc.stderr)[0]
    result = counts(proc.stderr)
    assert result["records"] == 300 and result["rejected"] == 5 and result["earlier"] > 0
    assert result["extracted"] + result["skipped"] + result["rejected"] + result["dropped"] == result["records"]
    assert {name: sha256(out / name) for name in kept} == kept, "a resume never rewrites a complete shard"
    assert_complete(out, baseline)


@pytest.mark.slow
def test_resume_with_another_dp_size_gives_the_same_samples(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    run_killed(out, "--data", corpus, *SMALL, env=env, torchrun=1, until=lambda: len(shard_paths(out)) >= total // 3)
    before = {shard_number(p) for p in shard_paths(out)}

    proc = ok(run(out, "--data", corpus, *SMALL, env=env, torchrun=2))
    new = {shard_number(p) for p in shard_paths(out)} - before
    assert min(new) > max(before)
    assert {n % 2 for n in new} == {0, 1}, "both replicas wrote, numbered apart"
    assert counts(proc.stderr)["earlier"] > 0
    assert_complete(out, baseline)


@pytest.mark.slow
def test_two_nodes_on_localhost_give_the_same_samples_as_one_process(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    for node in start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path):
        output = node.wait(timeout=600)
        assert node.proc.returncode == 0, output[-6000:]
    assert_complete(out, baseline)


@pytest.mark.slow
def test_tp_wider_than_a_node_is_refused_before_anything_starts(corpus, env, tmp_path):
    out = tmp_path / "out"
    for node in start_nodes(out, "--data", corpus, "--tp", "2", env=env, logs=tmp_path):
        output = node.wait(timeout=120)
        assert node.proc.returncode != 0
        assert "--tp 2 must divide the processes per node (1): a TP group has to stay inside one node" in output
    assert not out.exists(), "refused before the output directory was touched"


@pytest.mark.slow
def test_a_killed_dp_rank_stops_the_other_and_a_rerun_completes(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    launcher = subprocess.Popen(extract_command(out, "--data", corpus, *SMALL, torchrun=2), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    killed = kill_rank_when(launcher, 1, until=lambda: len(shard_paths(out)) >= total // 4)
    _, stderr = launcher.communicate(timeout=120)
    # Torchrun stops the survivor at once (SIGTERM): bounded by its 30 s grace period, not by the run.
    assert time.monotonic() - killed < 45
    assert launcher.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", stderr) and "SIGKILL" in stderr, stderr[-3000:]
    assert "rank 0: stopped by SIGTERM" in stderr, stderr[-3000:]
    assert_only_complete_shards(out)

    ok(run(out, "--data", corpus, *SMALL, env=env, torchrun=2))
    assert_complete(out, baseline)


@pytest.mark.slow
def test_a_node_whose_rank_dies_does_not_leave_the_other_node_waiting(baseline, corpus, env, tmp_path):
    """Torchrun stops the ranks of the failed worker's node only; the other node's ranks find out from
    the missing heartbeat at their next meeting point, name the lost rank and stop."""
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    nodes = start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path)
    killed = kill_rank_when(nodes[1].proc, 1, until=lambda: len(shard_paths(out)) >= total // 4)
    survivor = nodes[0].wait(timeout=600)
    nodes[1].wait(timeout=120)
    assert nodes[0].proc.returncode != 0 and nodes[1].proc.returncode != 0
    assert "rank 1 stopped answering" in survivor, survivor[-3000:]
    assert time.monotonic() - killed < 300
    assert_only_complete_shards(out)

    (tmp_path / "rerun").mkdir()
    for node in start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path / "rerun"):
        output = node.wait(timeout=600)
        assert node.proc.returncode == 0, output[-6000:]
    assert_complete(out, baseline)


@pytest.fixture(scope="module")
def stripping_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that strips whitespace and adds no BOS, so that a blank text
    tokenizes to nothing (the embedded one always adds a BOS)."""
    model = tmp_path_factory.mktemp("stripping")
    for f in tiny_model_dir.iterdir():
        if f.name != "tokenizer.json":
            (model / f.name).symlink_to(f)
    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Strip", "strip_left": True, "strip_right": True}
    tokenizer["post_processor"] = tokenizer["post_processor"]["processors"][0]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.mark.slow
def test_every_kind_of_bad_record_is_rejected_and_strict_stops_at_the_first(stripping_model, env, tmp_path):
    long_text = " ".join(WORDS * 6)
    chat = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]
    lines = [
        json.dumps({"id": "good-text", "text": "The quick brown fox."}),
        json.dumps({"id": "long", "text": long_text}),
        b'{"text": "unterminated',
        json.dumps({"id": "good-sharegpt", "conversations": [{"from": "human", "value": "Hi"},
                                                             {"from": "gpt", "value": "Hello."}]}),
        json.dumps({"id": "no-format", "prompt": "Hi"}),
        json.dumps({"id": "bad-role", "messages": [{"role": "robot", "content": "beep"}, *chat[1:]]}),
        json.dumps({"id": "empty", "conversations": []}),
        json.dumps({"id": "no-assistant", "messages": chat[:1]}),
        b'{"id": "latin-1", "text": "caf\xe9"}',
        json.dumps({"id": "blank", "text": "   "}),
        json.dumps({"id": "good-tokens", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}),
        json.dumps({"id": "good-openai", "messages": chat}),
    ]
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    args = ("--data", corpus, "--model", stripping_model, "--dtype", "float32", "--max-length", "40",
            "--overlong", "skip")

    proc = ok(run(tmp_path / "out", *args, env=env))
    assert counts(proc.stderr) == dict(records=12, extracted=4, earlier=0, skipped=1, rejected=7, dropped=0)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    expected = {
        2: ("long", "skipped", "> --max-length 40"),
        3: (None, "rejected", "invalid JSON"),
        5: ("no-format", "rejected", "none of conversations/messages/text/input_ids"),
        6: ("bad-role", "rejected", "unknown role 'robot'"),
        7: ("empty", "rejected", "empty conversation"),
        8: ("no-assistant", "rejected", "no assistant turn"),
        9: (None, "rejected", "not valid UTF-8"),
        10: ("blank", "rejected", "tokenizes to zero tokens"),
    }
    assert [r["line"] for r in rejects] == list(expected)
    for r in rejects:
        sid, kind, reason = expected[r["line"]]
        assert (r["source"], r["id"], r["kind"]) == (str(corpus), sid, kind)
        assert reason in r["reason"], r
    assert {info.id for info, _ in iter_samples(tmp_path / "out")} == {
        "good-text", "good-sharegpt", "good-tokens", "good-openai"
    }

    strict = run(tmp_path / "strict", *args, "--strict", env=env)
    assert strict.returncode != 0
    # The skipped overlong record on line 2 is a policy, not an error: the invalid JSON is the first bad one.
    assert f"Error: {corpus}:3: invalid JSON" in strict.stderr
    assert "Traceback" not in strict.stderr


def limit_file_size(nbytes: int):
    def apply() -> None:
        # Ignored, SIGXFSZ no longer kills the writer; write() fails with EFBIG, as on a full disk.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def assert_stopped_cleanly(proc, out) -> None:
    assert proc.returncode != 0
    assert re.search(r"Error: \[Errno 27\] File too large: '.*/\.shard_\d+\.safetensors\.tmp'", proc.stderr), proc.stderr
    assert "re-running the same command resumes" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(out.glob(".*.tmp")), "no partial file is left"
    journaled = {e["name"]: e["sha256"] for e in read_journal(manifest.journal_path(out, 0))}
    assert {p.name: sha256(p) for p in shard_paths(out)} == journaled, "every shard is complete and recorded"


@pytest.mark.slow
def test_a_full_disk_stops_cleanly_and_a_resume_completes(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    sizes = [p.stat().st_size for p in shard_paths(baseline)]
    first = run(out, "--data", corpus, *SMALL, env=env, preexec_fn=limit_file_size(min(sizes) - 1))
    assert_stopped_cleanly(first, out)
    assert shard_paths(out) == []

    # Nothing was written, so this attempt cuts the baseline's shards. The last one bigger than all before
    # it is the first that does not fit.
    k = max(i for i in range(1, len(sizes)) if sizes[i] > max(sizes[:i]))
    assert k >= 3
    second = run(out, "--data", corpus, *SMALL, env=env, preexec_fn=limit_file_size(max(sizes[:k])))
    assert_stopped_cleanly(second, out)
    assert k <= len(shard_paths(out)) < len(sizes)

    ok(run(out, "--data", corpus, *SMALL, env=env))
    assert_complete(out, baseline)


@pytest.mark.slow
def test_a_second_run_into_the_same_out_is_refused(corpus, env, tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(extract_command(out, "--data", corpus, *SMALL), stdout=log, stderr=log, cwd=ROOT,
                                 env=env)
    try:
        while not lock_taken(out):
            assert first.poll() is None
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock for as long as the second run takes
        second = run(out, "--data", corpus, *SMALL, env=env, torchrun=2)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode != 0
    assert f'is in use by another extraction ({{"pid": {first.pid}' in second.stderr
    assert "rank 0 stopped the run: TakeoverError" in second.stderr, "rank 1 is told, and stops too"
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert integrity.verify(out).problems == []


@pytest.mark.slow
def test_resume_refuses_another_run_unless_forced(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(baseline, out)
    names = [p.name for p in shard_paths(out)]
    # Other layers cannot join these shards, --force or not; nothing is written (issue 17's broken directory).
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    other_layers = run(out, "--data", corpus, *SMALL, "--layers", "1,2,4", "--force", env=env)
    assert other_layers.returncode != 0 and "Traceback" not in other_layers.stderr
    assert "holds shards of a different run" in other_layers.stderr and "--force cannot mix them" in other_layers.stderr
    assert "layer_ids: [1, 3, 4] -> [1, 2, 4]" in other_layers.stderr
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file() and p.name != resume.LOCK_NAME} == {
        name: digest for name, digest in before.items() if name != resume.LOCK_NAME
    }

    # The same file name elsewhere, with two records appended.
    grown = tmp_path / "moved" / corpus.name
    grown.parent.mkdir()
    extra = [json.dumps({"id": f"new{i}", "text": "a late addition"}) for i in range(2)]
    grown.write_text(corpus.read_text() + "\n".join(extra) + "\n")
    refused = run(out, "--data", grown, *SMALL, env=env)
    assert refused.returncode != 0
    assert re.search(r"corpus file 1 \(.*\): bytes \d+ -> \d+, sampled_sha256", refused.stderr), refused.stderr
    assert [p.name for p in shard_paths(out)] == names, "a refused run writes nothing"

    forced = ok(run(out, "--data", grown, *SMALL, "--force", env=env))
    assert counts(forced.stderr) == dict(records=302, extracted=297, earlier=295, skipped=0, rejected=5, dropped=0)
    assert manifest.load(out)["identity"]["corpus"][0]["bytes"] == grown.stat().st_size
    assert integrity.verify(out).problems == []


# In-process tests of the pieces.

RUN = {"model": "m", "config_sha256": "c", "weights": "w", "layer_ids": [1, 3], "hidden_size": 4}


def write_shards(out, groups, numbers=None, on_written=None) -> list:
    """Shard numbers[k] (default k) holds group k of (sample index, length); every value is exact in bf16."""
    paths = []
    for k, group in enumerate(groups):
        writer = ShardWriter(out, RUN, shard_numbers=iter([numbers[k] if numbers else k]), on_written=on_written)
        infos = [SampleInfo(i, f"s{i}", "c.jsonl", i + 1, n, False) for i, n in group]
        total = sum(n for _, n in group)
        rows = torch.arange(total, dtype=torch.float32)[:, None]
        writer.add_batch(infos, np.arange(total), np.ones(total), rows.repeat(1, 8), rows.repeat(1, 4),
                         lengths=[n for _, n in group])
        paths += writer.close()
    return paths


def journal_entry(path) -> dict:
    header = read_header(path)
    return {"name": path.name, "sha256": sha256(path), "bytes": path.stat().st_size,
            "num_samples": len(header.samples), "num_tokens": header.num_tokens}


def test_writer_threads_checksum_each_shard_as_they_write_it(tmp_path):
    written = []
    paths = write_shards(tmp_path, [[(0, 3)], [(1, 2)], [(2, 5)]], on_written=written.append)
    assert sorted(w.name for w in written) == [p.name for p in paths]
    for w in written:
        path = tmp_path / w.name
        assert (w.sha256, w.bytes) == (sha256(path), path.stat().st_size)
        assert (w.num_samples, w.num_tokens) == (1, read_header(path).num_tokens)


def test_take_over_clears_leftovers_and_numbers_new_shards_above_existing(tmp_path):
    write_shards(tmp_path, [[(0, 2), (2, 2)], [(5, 3)]], numbers=[3, 10])
    leftovers = [".shard_011.safetensors.tmp", ".rejects.dp1.jsonl", ".index.json.tmp"]
    for name in leftovers:
        (tmp_path / name).write_text("partial")
    lock, existing = resume.take_over(tmp_path)
    lock.release()
    assert existing.shards == ["shard_003.safetensors", "shard_010.safetensors"]
    assert existing.first_number == 11
    assert existing.notes[0] == f"removed 3 files left by an interrupted run: {', '.join(sorted(leftovers))}"
    assert hidden_files(tmp_path) == []

    mask = resume.done_mask(tmp_path, existing.shards)
    assert np.flatnonzero(mask).tolist() == [0, 2, 5]
    replica = Layout(rank=2, world_size=4)  # dp 2 of 4
    numbers = resume.shard_numbers(existing.first_number, replica.dp_rank, replica.dp_size)
    assert [n for n, _ in zip(numbers, range(3))] == [13, 17, 21]


def test_a_damaged_shard_stops_a_resume_with_what_to_do(tmp_path):
    (path,) = write_shards(tmp_path, [[(0, 2)]])
    os.truncate(path, 100)
    with pytest.raises(resume.TakeoverError, match="Move or delete it and re-run"):
        resume.done_mask(tmp_path, [path.name])


def test_the_lock_admits_one_holder_at_a_time(tmp_path):
    lock = resume.OutputLock(tmp_path)
    with pytest.raises(resume.TakeoverError, match=rf'in use by another extraction \({{"pid": {os.getpid()}'):
        resume.OutputLock(tmp_path)
    lock.release()
    assert not (tmp_path / resume.LOCK_NAME).exists(), "a finished run leaves no lock file behind"
    resume.OutputLock(tmp_path).release()


def test_a_lock_file_removed_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    """The holder releases (and removes) the file after we opened it: our flock on that orphan would
    exclude no one, so the lock is taken again on the file now at the path."""
    real_flock, locked = fcntl.flock, []

    def flock(f, operation):
        if not locked:
            (tmp_path / resume.LOCK_NAME).unlink()
        locked.append(f)
        return real_flock(f, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = resume.OutputLock(tmp_path)
    assert len(locked) == 2
    assert os.fstat(locked[-1].fileno()).st_ino == (tmp_path / resume.LOCK_NAME).stat().st_ino
    lock.release()


def test_consolidate_trusts_the_shards_on_disk(tmp_path):
    paths = write_shards(tmp_path, [[(0, 2)], [(1, 2)], [(2, 2)], [(3, 2)]])
    manifest.save(tmp_path, {"identity": {}, "shards": {"shard_009.safetensors": {"sha256": "x"}}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        journal.append(journal_entry(paths[0]))
    with open(manifest.journal_path(tmp_path, 1), "w") as torn:  # killed in the middle of a line
        torn.write(json.dumps(journal_entry(paths[1])) + '\n{"name": "shard_00')
    paths[3].unlink()

    recorded, notes = manifest.consolidate(tmp_path)
    assert list(recorded["shards"]) == [p.name for p in paths[:3]]
    assert recorded["shards"] == {p.name: {k: v for k, v in journal_entry(p).items() if k != "name"} for p in paths[:3]}
    assert "shard_009.safetensors" in notes[0] and paths[2].name in notes[1]
    assert manifest.load(tmp_path) == {"format_version": 1, **recorded}
    assert hidden_files(tmp_path) == []


def test_a_corrupt_journal_line_that_is_not_the_last_is_an_error(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ValueError, match="corrupt line 2"):
        read_journal(path)


def test_corpus_fingerprints_sample_big_files_and_ignore_where_they_live(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 16)  # 16 blocks of 16 bytes: a 1000-byte file is sampled
    data = bytes(random.Random(0).randrange(256) for _ in range(1000))
    a = tmp_path / "a" / "corpus.jsonl"
    b = tmp_path / "b" / "corpus.jsonl"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(data)
    identity = manifest.run_identity(RUN, [a])
    assert manifest.corpus_differences(identity, manifest.run_identity(RUN, [b])) == []

    b.write_bytes(b"X" + data[1:])
    assert "sampled_sha256" in manifest.corpus_differences(identity, manifest.run_identity(RUN, [b]))[0]
    b.write_bytes(data + b"{}\n")
    assert "bytes 1000 -> 1003" in manifest.corpus_differences(identity, manifest.run_identity(RUN, [b]))[0]
    (tmp_path / "c.jsonl").write_bytes(data)
    other = manifest.run_identity({**RUN, "layer_ids": [2]}, [tmp_path / "c.jsonl"])
    assert manifest.run_differences(identity, other) == ["layer_ids: [1, 3] -> [2]"]
    (diff,) = manifest.corpus_differences(identity, other)
    assert "name 'corpus.jsonl' -> 'c.jsonl'" in diff


def test_a_pipe_is_fingerprinted_without_reading_it_and_never_matches_a_recorded_corpus(tmp_path):
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b'{"text": "a"}\n')
        fingerprint = manifest.file_fingerprint(f"/dev/fd/{read_end}")
        assert os.read(read_end, 100) == b'{"text": "a"}\n', "the records are still there for the reader"
    finally:
        os.close(read_end)
        os.close(write_end)
    assert fingerprint["sampled_sha256"] is None
    identity = {"corpus": [fingerprint]}
    (diff,) = manifest.corpus_differences(identity, identity)
    assert "a pipe, whose records cannot be compared" in diff


def test_force_never_mixes_shards_of_another_model_tokenizer_layers_or_length_policy(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    write_shards(out, [[(0, 2)]])
    with pytest.raises(resume.TakeoverError, match="no manifest.json records the corpus"):
        resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=True)
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    before = manifest.load(out)
    for change in ({"layer_ids": [1, 2]}, {"max_length": 7}):
        with pytest.raises(resume.TakeoverError, match="--force cannot mix") as refused:
            resume.check_identity(out, manifest.run_identity({**RUN, **change}, [corpus]), force=True)
        assert f"{next(iter(change))}: " in str(refused.value)
        assert manifest.load(out) == before, "a refused run writes nothing"

    # Shards without a manifest are judged by their own run metadata.
    (out / manifest.MANIFEST_NAME).unlink()
    with pytest.raises(resume.TakeoverError, match="layer_ids: \\[1, 3\\] -> \\[1, 2\\]"):
        resume.check_identity(out, manifest.run_identity({**RUN, "layer_ids": [1, 2]}, [corpus]), force=True)

    # A grown corpus is what --force is for: the shards stay one data set.
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(resume.TakeoverError, match="pass --force"):
        resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    notes = resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=True)
    assert len(notes) == 1 and notes[0].startswith("--force: resuming despite")
    assert manifest.load(out) is None, "the check alone writes nothing"
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    assert manifest.load(out)["identity"] == manifest.run_identity(RUN, [corpus])


def test_a_directory_holding_no_complete_shard_is_taken_over(tmp_path):
    """A --strict run that stopped at a bad line wrote no shard; the fixed corpus simply starts again."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{broken\n')
    out = tmp_path / "out"
    lock, _ = resume.take_over(out)
    resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    lock.release()

    os.utime(corpus, ns=(0, 0))  # touched, not changed: the same run, taken over without a note
    lock, _ = resume.take_over(out)
    assert resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False) == []
    lock.release()

    corpus.write_text('{"text": "fixed"}\n')
    fixed = manifest.run_identity({**RUN, "layer_ids": [2]}, [corpus])
    lock, _ = resume.take_over(out)
    (note,) = resume.check_identity(out, fixed, force=False)
    resume.claim(out, fixed)
    lock.release()
    assert "holds no complete shard" in note
    assert manifest.load(out)["identity"] == fixed


def _claim_as_a_rerun(out, corpus, force=False) -> None:
    """What a rerun does to `out` before extracting: take it over, then claim it for RUN on `corpus`."""
    lock, existing = resume.take_over(out)
    try:
        layout = Layout(rank=0, world_size=1)
        # The job's claim phase itself, on what it reads of a job whose model has loaded.
        job = SimpleNamespace(
            opts=ExtractOptions(data=(str(corpus),), out=str(out), force=force), out=out, layout=layout,
            checked=SimpleNamespace(corpus_paths=[corpus]), coord=Coordinator(layout, "test"), meta=dict(RUN),
        )
        extraction.Job._claim(job, existing)
    finally:
        lock.release()


def test_a_refused_rerun_writes_nothing(tmp_path):
    corpus, other = tmp_path / "c.jsonl", tmp_path / "other.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    other.write_text('{"text": "z"}\n')
    out = tmp_path / "out"
    paths = write_shards(out, [[(0, 2)], [(1, 3)]])
    _claim_as_a_rerun(out, corpus, force=True)  # shards written through the library: no manifest yet
    manifest.consolidate(out, status="complete")

    def files() -> dict:
        return {p.name: p.read_bytes() for p in out.iterdir()}

    # A truncated shard: refused, and the manifest still says complete.
    os.truncate(paths[1], 100)
    before = files()
    with pytest.raises(resume.TakeoverError, match="Move or delete it"):
        _claim_as_a_rerun(out, corpus)
    assert files() == before

    # No manifest, and another corpus: refused, and no manifest written (a reader would take a statusless
    # one for an unfinished run).
    paths[1].unlink()
    (out / manifest.MANIFEST_NAME).unlink()
    before = files()
    with pytest.raises(resume.TakeoverError, match="corpus is not recorded"):
        _claim_as_a_rerun(out, other)
    assert files() == before


def test_a_rerun_of_a_finished_run_rebuilds_a_lost_index_and_refuses_a_damaged_shard(tmp_path):
    paths = write_shards(tmp_path, [[(0, 2)], [(1, 3)]])
    recorded, _ = manifest.consolidate(tmp_path, status="complete")
    assert resume.settle_finished(tmp_path, recorded) == ["rebuilt index.json, which was missing or did not describe the shards"]
    index = (tmp_path / "index.json").read_text()
    assert json.loads(index)["num_samples"] == 2
    assert resume.settle_finished(tmp_path, recorded) == [], "a good index is left alone"
    assert (tmp_path / "index.json").read_text() == index

    data = bytearray(paths[1].read_bytes())
    data[-1] ^= 0x01  # a flipped bit in the states: same size, same header
    paths[1].write_bytes(bytes(data))
    with pytest.raises(resume.TakeoverError, match=rf"{paths[1].name}: sha256 \w+ differs from manifest.json's") as e:
        resume.settle_finished(tmp_path, recorded)
    assert paths[0].name not in str(e.value) and "Delete the damaged shards and re-run" in str(e.value)


class PoisonedEngine:
    """Stands in for the engine: each token's states are its id; token 99 makes its row of layer 3 NaN,
    token 98 its last state's first value Inf. A single sequence over 8 tokens comes in chunks of 3."""

    device = "cpu"
    layer_ids = (1, 3)
    hidden_size = 4
    max_forward_tokens = 8
    chunk_tokens = 3

    def capture(self, seqs):
        ids = torch.from_numpy(np.concatenate(seqs)).float()[:, None]
        aux, last = ids.repeat(1, 8), ids.repeat(1, 4)
        aux[ids[:, 0] == 99, 4:] = float("nan")
        last[ids[:, 0] == 98, 0] = float("inf")
        return Captured(aux, last)

    def is_chunked(self, seqs):
        return len(seqs) == 1 and len(seqs[0]) > self.max_forward_tokens

    def chunks(self, ids, chunk):
        for start in range(0, len(ids), chunk):
            yield start, min(start + chunk, len(ids)), self.capture([ids[start : start + chunk]])


def samples(*token_lists):
    return [
        Sample(i, f"s{i}", "c.jsonl", i + 1, np.array(ids, dtype=np.int32), np.ones(len(ids), np.uint8), len(ids), False)
        for i, ids in enumerate(token_lists)
    ]


POISONED = samples([1, 2], [3, 99, 99, 4], [5], [98, 6], [7, 8, 9])
# Samples over the batch budget, prefilled in chunks: a clean one, one poisoned in its third chunk, and
# one in its first; short ones between them.
LONG = samples(list(range(10, 21)), [1, 2], [30, 31, 32, 33, 34, 35, 99, 37, 38, 39], [5], [98] + list(range(40, 49)))
LONG_NAN = "4 non-finite values (NaN/Inf) in its hidden states: 4 in layer 3"
NAN_REASON = "8 non-finite values (NaN/Inf) in its hidden states: 8 in layer 3"
INF_REASON = "1 non-finite values (NaN/Inf) in its hidden states: 1 in the final state"


def extract(tmp_path, guard, items=POISONED, shard_bytes=512 << 20):
    writer = ShardWriter(tmp_path, RUN, shard_bytes=shard_bytes)
    try:
        extract_batches(PoisonedEngine(), batch_by_tokens(items, 8, 8), writer, nonfinite=guard)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return {info.id: t for info, t in iter_samples(tmp_path)}


def test_nonfinite_drop_leaves_out_only_the_poisoned_samples(tmp_path):
    found = []
    got = extract(tmp_path, NonFiniteGuard("drop", PoisonedEngine.layer_ids, lambda s, why: found.append((s.id, why))))
    assert found == [("s1", NAN_REASON), ("s3", INF_REASON)]
    assert set(got) == {"s0", "s2", "s4"}
    for sid, tokens in (("s0", [1, 2]), ("s2", [5]), ("s4", [7, 8, 9])):
        assert got[sid]["aux_hidden_states"][:, 0].tolist() == tokens  # the kept rows, not their neighbours'


def test_nonfinite_fail_names_the_sample_and_the_layer(tmp_path):
    with pytest.raises(NonFiniteError, match=re.escape(f"sample 's1' (c.jsonl:2) has {NAN_REASON}")):
        extract(tmp_path, NonFiniteGuard("fail", PoisonedEngine.layer_ids))


def test_nonfinite_keep_writes_the_states_as_they_are(tmp_path):
    found = []
    got = extract(tmp_path, NonFiniteGuard("keep", PoisonedEngine.layer_ids, lambda s, why: found.append(s.id)))
    assert found == ["s1", "s3"] and len(got) == 5
    assert torch.isnan(got["s1"]["aux_hidden_states"][1:3, 4:].float()).all()
    assert torch.isinf(got["s3"]["hidden_states"][0, 0].float())


# (8 + 4) bf16 values a token: with shards of 8 tokens, each long sample completes a shard, which is then
# written while its chunks arrive (but not under "drop": a streamed sample could not be left out).
@pytest.mark.parametrize("shard_bytes", [512 << 20, 8 * 24], ids=["big-shards", "streamed"])
@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_long_samples_arrive_chunk_by_chunk_and_are_screened_whole(tmp_path, policy, shard_bytes):
    found = []
    guard = NonFiniteGuard(policy, PoisonedEngine.layer_ids, lambda s, why: found.append((s.id, why)))
    got = extract(tmp_path, guard, LONG, shard_bytes)
    assert found == [("s2", LONG_NAN), ("s4", INF_REASON)]
    assert set(got) == ({"s0", "s1", "s3"} if policy == "drop" else {"s0", "s1", "s2", "s3", "s4"})
    for sample in LONG:
        if sample.id in got:  # every chunk's rows in their place
            assert got[sample.id]["aux_hidden_states"][:, 0].float().tolist() == sample.input_ids.tolist()
            assert got[sample.id]["input_ids"].tolist() == sample.input_ids.tolist()


def test_a_long_sample_poisoned_in_a_later_chunk_fails_the_run(tmp_path):
    with pytest.raises(NonFiniteError, match=re.escape(f"sample 's2' (c.jsonl:3) has {LONG_NAN}")):
        extract(tmp_path, NonFiniteGuard("fail", PoisonedEngine.layer_ids), LONG, shard_bytes=8 * 24)
    # s0's shard is complete; s2's (with s1), already being written as s2 arrived, is gone with its
    # temporary file: a re-run redoes both.
    assert [p.name for p in tmp_path.iterdir()] == ["shard_000.safetensors"]


def test_clean_batches_are_never_examined_sample_by_sample(tmp_path):
    class Watched(NonFiniteGuard):
        def screen(self, *args):
            raise AssertionError("a clean batch was screened")

    clean = [POISONED[i] for i in (0, 2, 4)]
    assert len(extract(tmp_path, Watched("fail", PoisonedEngine.layer_ids), clean)) == 3


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

    proc = subprocess.run(["python", str(ROOT / "bin" / "inspect.py"), str(tmp_path), "--verify"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    problems = proc.stdout.splitlines()
    expected = [
        rf"{paths[0].name}: sha256 \w+ differs from manifest.json's",
        rf"{paths[1].name}: \d+ bytes, but manifest.json says",
        rf"{paths[1].name} is not a readable safetensors file",
        rf"index.json: {paths[2].name} num_tokens is 4, the shard has 3",
        r"index.json: sample 's3' \(index 3\) is not at row 1 of shard 3",
        r"verified 4 shards holding 3 samples in .*: 7 problems",
    ]
    for pattern in expected:
        assert any(re.search(pattern, line) for line in problems), (pattern, problems)


def verify_script(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bin" / "inspect.py"), str(out), "--verify"],
                          capture_output=True, text=True)


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


def test_verify_counts_one_shard_as_one(tmp_path):
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        write_shards(tmp_path, [[(0, 3), (1, 2)]], on_written=lambda w: journal.append(vars(w)))
    manifest.consolidate(tmp_path, identity={"layer_ids": [1, 3]}, status="complete")
    write_index(tmp_path)
    proc = verify_script(tmp_path)
    assert proc.returncode == 0
    assert f"verified 1 shard holding 2 samples in {tmp_path}: no problems" in proc.stdout


def test_finished_is_only_a_complete_run_of_the_same_identity_with_its_shards(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_000.safetensors").write_bytes(b"x" * 10)
    recorded = {**RUN, "layer_ids": [1, 3, 4], "compute_dtype": "bfloat16"}
    manifest.save(out, {"identity": manifest.run_identity(recorded, [corpus]), "status": "complete",
                        "shards": {"shard_000.safetensors": {"bytes": 10}}})
    known = {key: value for key, value in RUN.items() if key not in ("layer_ids", "compute_dtype")}
    assert resume.finished(out, known, [corpus])["status"] == "complete"  # SGLang's defaults taken as recorded
    assert resume.finished(out, {**known, "layer_ids": [1, 3, 4]}, [corpus]) is not None
    assert resume.finished(out, {**known, "layer_ids": [2]}, [corpus]) is None
    assert resume.finished(out, {**known, "max_length": 7}, [corpus]) is None
    corpus.write_text('{"text": "b"}\n')
    assert resume.finished(out, known, [corpus]) is None
    corpus.write_text('{"text": "a"}\n')
    (out / "shard_000.safetensors").write_bytes(b"x" * 9)
    assert resume.finished(out, known, [corpus]) is None
    (out / "shard_000.safetensors").write_bytes(b"x" * 10)
    manifest.save(out, {**manifest.load(out), "status": "running"})
    assert resume.finished(out, known, [corpus]) is None


def test_finished_takes_the_recorded_tokenizer_only_from_the_same_tokenizer_files(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    out.mkdir()
    recorded = {**RUN, "tokenizer_sha256": "t", "chat_template_sha256": "c", "tokenizer_files": "f1"}
    manifest.save(out, {"identity": manifest.run_identity(recorded, [corpus]), "status": "complete", "shards": {}})
    known = {key: value for key, value in recorded.items() if key not in ("tokenizer_sha256", "chat_template_sha256")}
    assert resume.finished(out, known, [corpus]) is not None
    assert resume.finished(out, {**known, "tokenizer_files": "f2"}, [corpus]) is None
    # Loaded after all, the tokenizer decides: the same hashes from other files are the same run.
    assert resume.finished(out, {**recorded, "tokenizer_files": "f2"}, [corpus]) is not None
    assert resume.finished(out, {**recorded, "tokenizer_files": "f2", "tokenizer_sha256": "u"}, [corpus]) is None
