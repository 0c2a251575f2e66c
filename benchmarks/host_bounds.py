#!/usr/bin/env python
"""What the host can take of extraction's hand-over, the bounds a small model's extract rate is held to: the
copy from pinned staging into pageable shard buffers (as the offload thread makes it, at each count of
torch threads), the write rate of parallel sequential writers to a directory (tmpfs: /dev/shm), and the
hashing rate of one core, with the xxh3_128 new shards' blocks get and the sha256 earlier versions gave
them (each shard block is hashed once). Each in GB/s and, given --bytes-per-token, in
tokens/s.

The writes are measured first at the default writer count (DEFAULT_WRITERS), --repeats times back to back
(`write_bytes_s_repeated`): run first on a fresh machine, the first of them writes memory the VM has never
touched, which a machine's first extraction into tmpfs writes too; the later ones, memory freed and reused.

\b
    python benchmarks/host_bounds.py --dir /dev/shm/oe-bounds --bytes-per-token 4613 --json OUT.json

Runs on a GPU host (the staging is pinned there) or, pinned memory aside, on any host.
"""

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import click
import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402
from benchmarks.extraction_vs_prefill import disk_write_rate  # noqa: E402
from offline_extract.options import DEFAULT_WRITERS  # noqa: E402


def copy_rate(nbytes: int, threads: int, pinned: bool, repeats: int = 3) -> float:
    """Bytes/s of copying `nbytes` from (pinned) host memory into resident pageable memory, best of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return nbytes / best


def hash_rate(new, nbytes: int) -> float:
    """Bytes/s of one core hashing `nbytes` with the hash object `new()` makes."""
    data = memoryview(bytes(nbytes))
    start = time.perf_counter()
    new(data).digest()
    return nbytes / (time.perf_counter() - start)


@program(help=__doc__)
@click.option("--dir", "directory", default="/dev/shm/oe-bounds", show_default=True, help="Where the writers write.")
@click.option("--gb", default=4.0, show_default=True, help="GiB written by each count of writers.")
@click.option("--copy-mb", default=512, show_default=True, help="MiB copied at each count of threads (a shard buffer).")
@click.option(
    "--repeats", default=3, show_default=True, help="Writes at the default writer count, back to back, first."
)
@click.option("--bytes-per-token", default=None, type=int, help="Adds each rate in tokens/s (bench's bytes_per_token).")
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(directory, gb, copy_mb, repeats, bytes_per_token, json_path):
    cores = os.cpu_count() or 1
    pinned = torch.cuda.is_available()
    writers = DEFAULT_WRITERS
    repeated = [disk_write_rate(Path(directory), int(gb * (1 << 30)), writers) for _ in range(repeats)]
    counts = sorted({1, 2, 4, 8, 16, cores} & set(range(1, cores + 1)))
    copy = {str(n): copy_rate(copy_mb << 20, n, pinned) for n in counts}
    write = {str(n): disk_write_rate(Path(directory), int(gb * (1 << 30)), n) for n in (1, 2, 4, 8, 12)}
    shutil.rmtree(directory, ignore_errors=True)
    result = {
        "command": command_line("python benchmarks/host_bounds.py"),
        "cpu_count": cores,
        "affinity": len(os.sched_getaffinity(0)),
        "pinned_source": pinned,
        "writers_repeated": writers,
        "write_bytes_s_repeated": repeated,
        "copy_bytes_s_by_threads": copy,
        "write_bytes_s_by_writers": write,
        "sha256_bytes_s_one_core": hash_rate(hashlib.sha256, 256 << 20),
        "xxh3_128_bytes_s_one_core": hash_rate(xxhash.xxh3_128, 256 << 20),
    }
    if bytes_per_token:
        result["tokens_s"] = {
            "copy_best": max(copy.values()) / bytes_per_token,
            "write_best": max(write.values()) / bytes_per_token,
            "sha256_one_core": result["sha256_bytes_s_one_core"] / bytes_per_token,
            "xxh3_128_one_core": result["xxh3_128_bytes_s_one_core"] / bytes_per_token,
        }
    emit(result, json_path)


if __name__ == "__main__":
    main()
