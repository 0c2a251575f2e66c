"""Two GPUs through bin/extract.py in bf16: TP=2 against HF, TP=2, DP=2 and two one-GPU "nodes" against one
GPU, and killed runs that resume under the other topology (run with `-m gpu` on a two-GPU machine).

Every extraction start costs about 50 s on an H200 (SGLang's imports alone 27 s), so the file starts as few as
its checks need, to run whole within ten minutes, each test under a time limit.

States computed with TP=2 sum their all-reduced partial products in another order than one GPU does, so
across topologies the tests compare each token's cosine (as the parity gate does in bf16), and tokens,
masks and sample metadata exactly.
"""

import json
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from extract_runs import (
    ROOT,
    run_extract,
    succeeded,
    assert_only_complete_shards,
    extract_command,
    kill_rank_when,
    paired_samples,
    start_nodes,
    wait_nodes,
)

from offline_extract.store import integrity
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.shard import open_shard
from offline_extract.testing.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.two_gpus,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
    pytest.mark.usefixtures("processes_end_with_the_test"),
]

CORPUS = ROOT / "examples" / "corpus.jsonl"
MIN_COSINE = 0.999
WORDS = "the quick brown fox jumps over a lazy dog while hidden states of every layer are saved".split()
# Small shards and forwards, so that a run is still writing when a test kills part of it (after 20 of its
# hundreds of shards).
SMALL = ("--shard-size-mb", "0.1", "--tokens-per-batch", "128")
CHATS = 500


def extract(out, *args, torchrun=None):
    return succeeded(run_extract(out, *args, torchrun=torchrun, timeout=300))


def per_token_cosine(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """Cosine of each (token, layer) pair of two [T, k*width] tensors."""
    a, b = a.float().reshape(a.shape[0], -1, width), b.float().reshape(b.shape[0], -1, width)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def compare_runs(out_a, out_b) -> dict:
    """Same samples with the same tokens and metadata; returns the worst and median token cosine of each tensor."""
    width = open_shard(shard_paths(out_a)[0]).run.hidden_size
    cosines = {"aux_hidden_states": [], "hidden_states": []}
    for _, t, t_b in paired_samples(out_a, out_b):
        for name, found in cosines.items():
            found.append(per_token_cosine(t[name], t_b[name], width).flatten())
    return {
        name: {"worst": float(torch.cat(c).min()), "median": float(torch.cat(c).median())}
        for name, c in cosines.items()
    }


def assert_close_runs(out_a, out_b) -> dict:
    found = compare_runs(out_a, out_b)
    for name, c in found.items():
        assert c["worst"] >= MIN_COSINE, (name, found)
    return found


def assert_verified(out, tp):
    run = open_shard(shard_paths(out)[0]).run
    assert run.tp_size == tp and run.compute_dtype == "bfloat16"
    rows = run.parity
    assert [r["layer"] for r in rows] == [f"aux {k}" for k in run.layer_ids] + ["last"]
    for r in rows:
        assert r["ok"] and r["cosine"] >= MIN_COSINE, r
        assert r["neighbour_cosine"] < r["cosine"] - 0.01, r
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("tiny") / "m", dtype=torch.bfloat16, device="cuda")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A long pre-tokenized sample first (so that --verify covers a chunked prefill), then CHATS short chats."""
    rng = random.Random(7)
    lines = [json.dumps({"id": "long", "input_ids": np.random.default_rng(0).integers(10, 380, 1500).tolist()})]
    for i in range(CHATS):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 80)))
        lines.append(
            json.dumps(
                {
                    "id": f"r{i}",
                    "messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": words}],
                }
            )
        )
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def one_gpu(tiny, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_gpu") / "out"
    extract(out, "--model", tiny, "--data", corpus, *SMALL)
    return out


def test_tp2_tiny_llama_matches_hf_including_a_chunked_sample_and_gives_the_samples_of_one_gpu(
    tiny, corpus, one_gpu, tmp_path
):
    out = tmp_path / "out"
    # The 1,500-token sample is longer than a 512-token forward: prefilled in 3 chunks on prefix KV, under TP.
    extract(
        out, "--model", tiny, "--data", corpus, "--tp", "2", "--verify", "8", "--tokens-per-batch", "512", torchrun=2
    )
    assert_verified(out, tp=2)
    assert len(list(iter_samples(out))) == CHATS + 1
    print(json.dumps(assert_close_runs(one_gpu, out)))
    assert integrity.verify(out).problems == []


def test_dp2_gives_the_samples_of_one_gpu(tiny, corpus, one_gpu, tmp_path):
    out = tmp_path / "out"
    extract(out, "--model", tiny, "--data", corpus, *SMALL, torchrun=2)
    print(json.dumps(assert_close_runs(one_gpu, out)))
    assert integrity.verify(out).problems == []


def test_two_one_gpu_nodes_give_the_samples_of_one_gpu(tiny, corpus, one_gpu, tmp_path):
    out = tmp_path / "out"
    # Kept beside the run's results: a failed run's node logs are its only account.
    results = os.environ.get("OFFLINE_EXTRACT_RESULTS")
    logs = Path(results) / "two_nodes" if results else tmp_path
    nodes = start_nodes(
        out,
        "--model",
        tiny,
        "--data",
        corpus,
        *SMALL,
        env=dict(os.environ),
        logs=logs,
        node_env=[{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}],
    )
    # One run's start and its share of the corpus take about a minute.
    outputs = wait_nodes(nodes, timeout=120)
    for node, output in zip(nodes, outputs):
        assert node.proc.returncode == 0, output[-6000:]
    assert_close_runs(one_gpu, out)
    assert integrity.verify(out).problems == []


def test_a_killed_dp_rank_stops_the_other_within_seconds_and_the_run_resumes_under_tp2(tiny, corpus, one_gpu, tmp_path):
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        extract_command(out, "--model", tiny, "--data", corpus, *SMALL, torchrun=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    killed = kill_rank_when(launcher, 1, until=lambda: len(shard_paths(out)) >= 20)
    _, stderr = launcher.communicate(timeout=120)
    stopped_after = time.monotonic() - killed
    assert launcher.returncode != 0 and stopped_after < 45, stopped_after
    assert "rank 0: stopped by SIGTERM" in stderr and "SIGKILL" in stderr, stderr[-3000:]
    assert_only_complete_shards(out, killed=(1, 2))  # rank 1 of DP=2 is replica 1
    proc = extract(out, "--model", tiny, "--data", corpus, *SMALL, "--tp", "2", torchrun=2)
    assert "by earlier attempts" in proc.stderr
    assert_close_runs(one_gpu, out)
    assert integrity.verify(out).problems == []


def test_a_run_killed_under_tp2_resumes_under_dp2(tiny, corpus, one_gpu, tmp_path):
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        extract_command(out, "--model", tiny, "--data", corpus, *SMALL, "--tp", "2", torchrun=2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    kill_rank_when(launcher, 0, until=lambda: len(shard_paths(out)) >= 20)
    launcher.wait(timeout=120)
    proc = extract(out, "--model", tiny, "--data", corpus, *SMALL, torchrun=2)
    assert "by earlier attempts" in proc.stderr
    assert_close_runs(one_gpu, out)
    assert integrity.verify(out).problems == []


def test_float32_on_cuda_is_refused_before_the_model_loads(tiny, tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        extract_command(tmp_path / "out", "--model", tiny, "--data", CORPUS, "--dtype", "float32"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode != 0 and "--dtype float32 does not run on CUDA" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60


def test_tp2_llama3_8b_shaped_matches_hf_including_a_chunked_sample(tmp_path):
    model = build_model(
        "llama3_8b", tmp_path / "m", dtype=torch.bfloat16, device="cuda", overrides={"max_position_embeddings": 16384}
    )
    data = tmp_path / "corpus.jsonl"
    long_ids = np.random.default_rng(1).integers(10, 380, 12000).tolist()
    data.write_text(json.dumps({"id": "long-12k", "input_ids": long_ids}) + "\n" + CORPUS.read_text())
    out = tmp_path / "out"
    extract(
        out,
        "--model",
        model,
        "--data",
        data,
        "--tp",
        "2",
        "--verify",
        "4",
        "--max-length",
        "16384",
        "--tokens-per-batch",
        "4096",
        torchrun=2,
    )
    rows = assert_verified(out, tp=2)
    assert [r["hf_index"] for r in rows[:-1]] == [2, 16, 29]  # SGLang's default ids [1, 15, 28], plus one
    samples = {info.id: t for info, t in iter_samples(out)}
    assert samples["long-12k"]["aux_hidden_states"].shape == (12000, 3 * 4096)
