"""How the end-to-end tests start bin/extract.py (alone, under torchrun, or as several torchrun "nodes" on
localhost) and compare what runs wrote, and the hub cache they find models in."""

import dataclasses
import hashlib
import os
import signal
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from offline_extract.engine.distributed import free_port
from offline_extract.options import ExtractOptions
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.schema import shard_number
from offline_extract.store.shard import read_header

ROOT = Path(__file__).resolve().parents[1]

# The parts of a run's parity gate (manifest timings) that add up to its parity_gate_s on a rank that ran HF.
GATE_PARTS = (
    "gate_engine_s",
    "gate_preload_waited_s",
    "gate_hf_config_s",
    "gate_hf_to_host_s",
    "gate_hf_to_device_s",
    "gate_hf_forwards_s",
    "gate_compare_s",
    "gate_other_s",
)


def small_run(corpus, out, **options) -> ExtractOptions:
    """The options of a run of `corpus` into `out` on CPU, as the in-process tests make it on the session's
    engine: no parity gate nor progress, forwards of 256 tokens and shards of 32 KiB, so that even the example
    corpus fills several; `options` over these."""
    small = ExtractOptions(
        data=(str(corpus),),
        out=str(out),
        device="cpu",
        parity_samples=0,
        tokens_per_batch=256,
        shard_bytes=32 << 10,
        progress=False,
        progress_every=0,
    )
    return dataclasses.replace(small, **options)


def extract_command(out, *args, torchrun: int | None = None) -> list[str]:
    cmd = [sys.executable, str(ROOT / "bin" / "extract.py"), "--out", str(out), "--no-progress", *map(str, args)]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun),
            "--master-port",
            str(free_port()),
            *cmd[1:],
        ]
    return cmd


def run_extract(out, *args, torchrun: int | None = None, env=None, timeout: float = 600, **popen):
    """bin/extract.py (under torchrun, given `torchrun` processes) run to its end, its output captured as text;
    `env` sets variables over this process's environment, a value of None unsetting one."""
    environment = {**os.environ, **(env or {})}
    for name in [name for name, value in environment.items() if value is None]:
        del environment[name]
    return subprocess.run(
        extract_command(out, *args, torchrun=torchrun),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=timeout,
        **popen,
    )


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`proc`, once it is known to have exited 0; the end of its output says why not."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def node_commands(out, *args, nodes: int = 2, nproc_per_node: int = 1) -> list[list[str]]:
    """One torchrun command per "node", all on localhost: the static rendezvous of a real multi-node job
    (node 0 serves the store at --master-addr:--master-port, the others join it)."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    extract = [str(ROOT / "bin" / "extract.py"), "--out", str(out), "--no-progress", *map(str, args)]
    return [[*launch, "--node-rank", str(node), *extract] for node in range(nodes)]


@dataclass
class Node:
    """One node's torchrun, its output going to a file: a pipe nobody drains would stall the node once full,
    and its peers would then wait on it."""

    proc: subprocess.Popen
    log: Path


def start_nodes(out, *args, env, logs: Path, node_env=None, nproc_per_node: int = 1) -> list[Node]:
    """Starts every node's torchrun; `node_env[i]` adds to node i's environment (e.g. its GPU)."""
    commands = node_commands(out, *args, nproc_per_node=nproc_per_node)
    node_env = node_env or [{}] * len(commands)
    Path(logs).mkdir(parents=True, exist_ok=True)
    nodes = []
    for i, (cmd, extra) in enumerate(zip(commands, node_env)):
        log = Path(logs) / f"node{i}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**env, **extra})
        nodes.append(Node(proc, log))
    return nodes


def wait_nodes(nodes: list[Node], timeout: float) -> list[str]:
    """Every node's output once all have exited, waiting `timeout` seconds for all of them together. Nodes
    still running then are killed (workers too) and the test fails with every node's log: a node that
    waits for a peer prints nothing, and the test's own time limit would kill it without a word."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running = [i for i, n in enumerate(nodes) if n.proc.poll() is None]
            for n in nodes:
                kill_tree(n.proc.pid)
            logs = "\n".join(
                f"--- node {i} (exit status {n.proc.wait()}), {n.log}:\n{n.log.read_text()[-4000:]}"
                for i, n in enumerate(nodes)
            )
            raise AssertionError(f"node(s) {running} still running after {timeout:.0f} s, killed\n{logs}") from None
    return [node.log.read_text() for node in nodes]


# Every process a test starts inherits this (the test process's id): processes a test left behind (a run a
# time limit cut, torchrun's workers once torchrun itself was killed: each worker leads its own session, so
# they outlive it) are found by it and killed, instead of holding the GPUs and the rendezvous ports of the
# tests after it.
TEST_PROCESS = "OFFLINE_EXTRACT_TEST_PROCESS"
os.environ[TEST_PROCESS] = str(os.getpid())


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid` and every process below it."""
    try:
        parent = psutil.Process(pid)
        victims = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def kill_left_behind() -> list[str]:
    """Kills the extractions and torchruns this test process started that still run; returns their command
    lines."""
    ours, killed = str(os.getpid()), []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        if p.pid == os.getpid() or not (str(ROOT / "bin") in cmdline or "torch.distributed.run" in cmdline):
            continue
        try:
            if p.environ().get(TEST_PROCESS) == ours:
                p.kill()
                killed.append(cmdline)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed


def worker_of_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The worker process torchrun started for global `rank`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    raise AssertionError(f"torchrun started no worker of rank {rank}")


def kill_rank_when(launcher: subprocess.Popen, rank: int, until) -> float:
    """SIGKILLs the worker of `rank` once `until()` holds; returns the time of the kill (monotonic)."""
    victim = worker_of_rank(launcher, rank)
    deadline = time.monotonic() + 600
    while not until():
        assert launcher.poll() is None, "the run ended before its kill point"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    return time.monotonic()


def assert_only_complete_shards(out, killed: tuple[int, int] | None = None) -> None:
    """What a stopped run leaves: complete shards only (a resume's journals may remain, no half file).
    `killed` = (dp_rank, dp_size) of a replica stopped by SIGKILL: it may leave the temp files of the shards
    its writer threads were writing (nothing can clean up after SIGKILL; the rerun removes them), numbered as
    its shards are in a fresh run; every other replica leaves none."""
    unfinished = sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))
    its = [
        n
        for n in unfinished
        if killed and n.startswith(".shard_") and shard_number(Path(n[1 : -len(".tmp")])) % killed[1] == killed[0]
    ]
    assert unfinished == its, f"no unfinished file but the killed replica's: {unfinished}"
    for path in shard_paths(out):
        read_header(path)  # every shard on disk is whole


def paired_samples(out_a, out_b) -> Iterator[tuple[int, dict, dict]]:
    """Two directories' samples paired by corpus index, each pair's (index, tensors of a, tensors of b),
    once it is checked that both hold the same samples with the same metadata and tokens."""
    a = {info.index: (info, t) for info, t in iter_samples(out_a)}
    b = {info.index: (info, t) for info, t in iter_samples(out_b)}
    assert a.keys() == b.keys()
    for index, (info, t) in a.items():
        info_b, t_b = b[index]
        assert info == info_b
        for name in ("input_ids", "loss_mask"):
            assert torch.equal(t[name], t_b[name]), (index, name)
        yield index, t, t_b


def assert_same_samples(out_a, out_b) -> None:
    """Both directories hold the same samples: metadata and tokens exactly, states up to bf16 rounding.

    Exact equality holds for a sample whose batch was the same in both runs. When batches differ
    (another budget, DP size, or a resume that starts mid-corpus), CPU matmuls sum in another order:
    float32 states differ in their last bits, which moves a bf16 value across a rounding boundary now
    and then, i.e. by one bf16 step (rtol 2^-7). Near zero that one step is finer than float32's
    summation noise, which scales with the states' largest value (their scale, about 7 on the tiny model)
    and differs with the CPU's GEMM blocking: hence an absolute floor of 16 float32 steps of that scale.
    """
    for index, t, t_b in paired_samples(out_a, out_b):
        for name in ("aux_hidden_states", "hidden_states"):
            x, y = t[name].float(), t_b[name].float()
            floor = 16 * torch.finfo(torch.float32).eps * y.abs().max().item()
            assert torch.allclose(x, y, rtol=2**-7, atol=floor), (index, name)


REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(hf_home, repo_id: str, files_from, kind: str = "models") -> None:
    """The layout huggingface_hub's cache gives a downloaded model (or, with kind="datasets", data set):
    refs/main naming a snapshot folder."""
    repo = Path(hf_home) / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(files_from, repo / "snapshots" / REVISION)


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def hidden_files(out) -> list[str]:
    """The dot files in `out`: journals, the lock, temporaries."""
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))
