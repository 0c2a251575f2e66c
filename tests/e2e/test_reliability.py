"""Crash safety, resume and bad input end to end: bin/extract.py in subprocesses on the embedded tiny
model, alone, under torchrun and as two "nodes", killed, starved of disk or blocked."""

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import time

import psutil
import pytest
from extract_runs import (
    ROOT,
    run_extract,
    succeeded,
    assert_only_complete_shards,
    assert_same_samples,
    extract_command,
    hidden_files,
    kill_left_behind,
    kill_rank_when,
    sha256,
    start_nodes,
    wait_nodes,
    worker_of_rank,
)

from offline_extract.default_model import TINY_VERSION
from offline_extract.engine.distributed import HEARTBEAT, PEER_TIMEOUT
from offline_extract.store import checksum, integrity, manifest, resume
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.journal import read_journal
from offline_extract.store.schema import shard_number
from offline_extract.store.shard import read_header

pytestmark = pytest.mark.usefixtures("processes_end_with_the_test")

# Small shards and batches: a few hundred short records make about 80 shards and 120 batches.
SMALL = ("--shard-size-mb", "0.15", "--tokens-per-batch", "256")
BAD_LINES = {17, 77, 137, 197, 257}
WORDS = "the quick brown fox jumps over a lazy dog while hidden states of every layer are saved".split()
RESULT = re.compile(
    r"records (\d+): extracted (\d+)(?: \((\d+) by earlier attempts\))?, skipped (\d+), rejected (\d+), dropped (\d+)"
)


def counts(stderr: str) -> dict:
    records, extracted, earlier, skipped, rejected, dropped = RESULT.search(stderr).groups()
    found = dict(
        records=records, extracted=extracted, earlier=earlier or 0, skipped=skipped, rejected=rejected, dropped=dropped
    )
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


def run_killed(out, *args, env, until, torchrun=None) -> None:
    """Starts an extraction and SIGKILLs all its processes (torchrun's workers too) once `until()` holds."""
    proc = subprocess.Popen(
        extract_command(out, *args, torchrun=torchrun),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
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


def assert_complete(out, base) -> None:
    """`out` holds exactly the samples and rejects of the uninterrupted run `base`, and verifies clean."""
    assert_same_samples(base, out)
    assert (out / "rejects.jsonl").read_text() == (base / "rejects.jsonl").read_text()
    assert hidden_files(out) == [], "no leftovers, no lock"
    assert integrity.verify(out).problems == []


@pytest.fixture(scope="module")
def baseline(corpus, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "out"
    proc = succeeded(run_extract(out, "--data", corpus, *SMALL, env=env))
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

    proc = succeeded(run_extract(out, "--data", corpus, *SMALL, env=env))
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

    proc = succeeded(run_extract(out, "--data", corpus, *SMALL, env=env, torchrun=2))
    new = {shard_number(p) for p in shard_paths(out)} - before
    assert min(new) > max(before)
    assert {n % 2 for n in new} == {0, 1}, "both replicas wrote, numbered apart"
    assert counts(proc.stderr)["earlier"] > 0
    assert_complete(out, baseline)
    # A rank waiting for a slower one (the leader at the end, for a replica with more left) polled the store
    # in slices that c10d reported as "waitForInput ... timed out", and that wait was counted as the index's.
    assert "waitForInput" not in proc.stderr
    t = json.loads((out / manifest.MANIFEST_NAME).read_text())["timings"]
    parts = t["to_host_s"] + t["last_shards_s"] + t["replicas_waited_s"] + t["rejects_and_index_s"]
    assert parts == pytest.approx(t["tail_s"])
    assert f"the other replicas {t['replicas_waited_s']:.2f} s, rejects and index" in proc.stderr


@pytest.mark.slow
def test_two_nodes_on_localhost_give_the_same_samples_as_one_process(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    nodes = start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path)
    for node, output in zip(nodes, wait_nodes(nodes, timeout=600)):
        assert node.proc.returncode == 0, output[-6000:]
    assert_complete(out, baseline)


# Loaded by node 1's processes (PYTHONPATH): the first open of a config.json waits SLOW_CHECKS seconds, as a
# model on a slow filesystem, or still downloading to that node, would.
LATE_CONFIG = """
import sys, time
def _late(event, args, waited=[]):
    if event == "open" and not waited and str(args[0]).endswith("config.json"):
        waited.append(True)
        time.sleep({seconds})
sys.addaudithook(_late)
"""
SLOW_CHECKS = 45


@pytest.mark.slow
def test_a_rank_still_in_its_checks_is_waited_for_not_taken_for_lost(baseline, corpus, env, tmp_path):
    """Node 1 reads its model's config.json SLOW_CHECKS s late, longer than a rank that stops answering is
    given; it is not lost, and the run completes."""
    assert SLOW_CHECKS > (PEER_TIMEOUT + 2 * HEARTBEAT).total_seconds()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LATE_CONFIG.format(seconds=SLOW_CHECKS))
    out = tmp_path / "out"
    nodes = start_nodes(
        out,
        "--data",
        corpus,
        *SMALL,
        env=env,
        logs=tmp_path,
        node_env=[{}, {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}],
    )
    for node, output in zip(nodes, wait_nodes(nodes, timeout=600)):
        assert node.proc.returncode == 0, output[-6000:]
    assert_complete(out, baseline)


@pytest.mark.slow
def test_tp_wider_than_a_node_is_refused_before_anything_starts(corpus, env, tmp_path):
    out = tmp_path / "out"
    nodes = start_nodes(out, "--data", corpus, "--tp", "2", env=env, logs=tmp_path)
    for node, output in zip(nodes, wait_nodes(nodes, timeout=120)):
        assert node.proc.returncode != 0
        assert "--tp 2 must divide the processes per node (1): a TP group has to stay inside one node" in output
    assert not out.exists(), "refused before the output directory was touched"


@pytest.mark.slow
def test_nodes_still_running_at_the_deadline_are_killed_and_reported_with_their_logs(corpus, env, tmp_path):
    """Node 1 dies before it joins: node 0's torchrun waits for it (600 s by default), printing nothing."""
    nodes = start_nodes(tmp_path / "out", "--data", corpus, env=env, logs=tmp_path)
    nodes[1].proc.kill()
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_nodes(nodes, timeout=10)
    assert time.monotonic() - start < 30
    assert "node(s) [0] still running after 10 s, killed" in str(failed.value)
    assert f"--- node 0 (exit status -9), {nodes[0].log}" in str(failed.value)
    assert f"--- node 1 (exit status -9), {nodes[1].log}" in str(failed.value)
    assert kill_left_behind() == []


@pytest.mark.slow
def test_workers_that_outlive_a_killed_torchrun_are_found_and_killed(corpus, env, tmp_path):
    launcher = subprocess.Popen(
        extract_command(tmp_path / "out", "--data", corpus, torchrun=1),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = worker_of_rank(launcher, 0)
    launcher.kill()
    launcher.wait()
    assert worker.is_running(), "torchrun's worker outlives it"
    left = kill_left_behind()
    assert len(left) == 1 and "bin/extract.py" in left[0]
    worker.wait(timeout=10)


@pytest.mark.slow
def test_a_killed_dp_rank_stops_the_other_and_a_rerun_completes(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    launcher = subprocess.Popen(
        extract_command(out, "--data", corpus, *SMALL, torchrun=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    killed = kill_rank_when(launcher, 1, until=lambda: len(shard_paths(out)) >= total // 4)
    _, stderr = launcher.communicate(timeout=120)
    # Torchrun stops the survivor at once (SIGTERM): bounded by its 30 s grace period, not by the run.
    assert time.monotonic() - killed < 45
    assert launcher.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", stderr) and "SIGKILL" in stderr, stderr[-3000:]
    assert "rank 0: stopped by SIGTERM" in stderr, stderr[-3000:]
    assert_only_complete_shards(out, killed=(1, 2))  # rank 1 of DP=2 is replica 1

    succeeded(run_extract(out, "--data", corpus, *SMALL, env=env, torchrun=2))
    assert_complete(out, baseline)


@pytest.mark.slow
def test_a_node_whose_rank_dies_does_not_leave_the_other_node_waiting(baseline, corpus, env, tmp_path):
    """Torchrun stops the ranks of the failed worker's node only; the other node's ranks find out from
    the missing heartbeat at their next meeting point, name the lost rank and stop."""
    out = tmp_path / "out"
    total = len(shard_paths(baseline))
    nodes = start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path)
    killed = kill_rank_when(nodes[1].proc, 1, until=lambda: len(shard_paths(out)) >= total // 4)
    survivor, _ = wait_nodes(nodes, timeout=600)
    assert nodes[0].proc.returncode != 0 and nodes[1].proc.returncode != 0
    assert "rank 1 stopped answering" in survivor, survivor[-3000:]
    assert time.monotonic() - killed < 300
    assert_only_complete_shards(out, killed=(1, 2))  # rank 1 of DP=2 is replica 1

    nodes = start_nodes(out, "--data", corpus, *SMALL, env=env, logs=tmp_path / "rerun")
    for node, output in zip(nodes, wait_nodes(nodes, timeout=600)):
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
        json.dumps(
            {
                "id": "good-sharegpt",
                "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
            }
        ),
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
    args = (
        "--data",
        corpus,
        "--model",
        stripping_model,
        "--dtype",
        "float32",
        "--max-length",
        "40",
        "--overlong",
        "skip",
    )

    proc = succeeded(run_extract(tmp_path / "out", *args, env=env))
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
        "good-text",
        "good-sharegpt",
        "good-tokens",
        "good-openai",
    }

    strict = run_extract(tmp_path / "strict", *args, "--strict", env=env)
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
    assert re.search(r"Error: \[Errno 27\] File too large: '.*/\.shard_\d+\.safetensors\.tmp'", proc.stderr), (
        proc.stderr
    )
    assert "re-running the same command resumes" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(out.glob(".*.tmp")), "no partial file is left"
    journaled = {e["name"]: e[checksum.KEY] for e in read_journal(manifest.journal_path(out, 0))}
    assert {p.name: checksum.file_checksum(p) for p in shard_paths(out)} == journaled, (
        "every shard is complete and recorded"
    )


@pytest.mark.slow
def test_a_full_disk_stops_cleanly_and_a_resume_completes(baseline, corpus, env, tmp_path):
    out = tmp_path / "out"
    sizes = [p.stat().st_size for p in shard_paths(baseline)]
    first = run_extract(out, "--data", corpus, *SMALL, env=env, preexec_fn=limit_file_size(min(sizes) - 1))
    assert_stopped_cleanly(first, out)
    assert shard_paths(out) == []

    # Nothing was written, so this attempt cuts the baseline's shards. The last one bigger than all before
    # it is the first that does not fit.
    k = max(i for i in range(1, len(sizes)) if sizes[i] > max(sizes[:i]))
    assert k >= 3
    second = run_extract(out, "--data", corpus, *SMALL, env=env, preexec_fn=limit_file_size(max(sizes[:k])))
    assert_stopped_cleanly(second, out)
    assert k <= len(shard_paths(out)) < len(sizes)

    succeeded(run_extract(out, "--data", corpus, *SMALL, env=env))
    assert_complete(out, baseline)


@pytest.mark.slow
def test_a_full_disk_under_zstd_stops_cleanly_and_a_resume_completes(corpus, env, tmp_path):
    # Compressed states are written frame by frame (store/shard_file.py's Frames), not from one buffer. One
    # record midway is far longer than a shard, so that its shard alone outgrows the limit: twice the shard
    # size, above any shard of the short records (the size plus one record, before zstd shrinks it) and
    # under the long record's (about 2,000 tokens of 517 bytes, which zstd does not shrink 3x).
    rng = random.Random(7)
    lines = corpus.read_text().splitlines()
    lines.insert(150, json.dumps({"id": "long", "text": " ".join(rng.choice(WORDS) for _ in range(700))}))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    args = ("--data", mixed, *SMALL, "--compress", "zstd")
    first = run_extract(out, *args, env=env, preexec_fn=limit_file_size(2 * int(0.15 * (1 << 20))))
    assert_stopped_cleanly(first, out)
    kept = {p.name: sha256(p) for p in shard_paths(out)}
    earlier = sum(len(read_header(p).samples) for p in shard_paths(out))
    assert kept and earlier < 296, "the shards before the long record's are kept, and only those"

    done = succeeded(run_extract(out, *args, env=env))
    assert counts(done.stderr) == dict(records=301, extracted=296, earlier=earlier, skipped=0, rejected=5, dropped=0)
    assert {name: sha256(out / name) for name in kept} == kept, "the kept shards are untouched"
    ids = [info.id for info, _ in iter_samples(out)]
    assert sorted(ids) == sorted(json.loads(line)["id"] for line in lines if not line.startswith("{broken"))
    assert hidden_files(out) == [] and integrity.verify(out).problems == []


@pytest.mark.slow
def test_a_second_run_into_the_same_out_is_refused(corpus, env, tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            extract_command(out, "--data", corpus, *SMALL), stdout=log, stderr=log, cwd=ROOT, env=env
        )
    try:
        while not lock_taken(out):
            assert first.poll() is None
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock for as long as the second run takes
        second = run_extract(out, "--data", corpus, *SMALL, env=env, torchrun=2)
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
    other_layers = run_extract(out, "--data", corpus, *SMALL, "--layers", "1,2,4", "--force", env=env)
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
    refused = run_extract(out, "--data", grown, *SMALL, env=env)
    assert refused.returncode != 0
    assert re.search(r"corpus file 1 \(.*\): bytes \d+ -> \d+, sampled_sha256", refused.stderr), refused.stderr
    assert [p.name for p in shard_paths(out)] == names, "a refused run writes nothing"

    forced = succeeded(run_extract(out, "--data", grown, *SMALL, "--force", env=env))
    assert counts(forced.stderr) == dict(records=302, extracted=297, earlier=295, skipped=0, rejected=5, dropped=0)
    assert manifest.load(out)["identity"]["corpus"][0]["bytes"] == grown.stat().st_size
    assert integrity.verify(out).problems == []
