#!/usr/bin/env python
"""What the datasets' default checksum check costs: shards hashed against their recorded checksums, once
(store/verdicts.py), then the verdicts kept beside them, which a later dataset checks with a stat per shard.

Writes `--files` files of `--gb-per-file` random bytes (shard-sized, named as shards) into `--dir` and times

    one core         checksum.file_checksum of each file in turn, from a warm page cache: the CPU's
                     hashing rate alone (xxh3_128 of 64 MiB blocks; `one_core_warm_block_sha256`: the
                     same with the sha256 that outputs of earlier versions record)
    threads          manifest.checksums over all files with `--threads` threads, warm, as a reader checks
                     (files side by side: a rate that grows with the threads up to one per file or core)
    threads, cold    the same after each file is dropped from the page cache (posix_fadvise DONTNEED, no
                     root needed): the disk and the hashing together
    kept             verdicts.damaged_shards once the verdicts are kept: what a second dataset pays

and extrapolates each rate to a 100 GB output. The result records the load average: on a shared machine
the hashing rate is the share of a core this process got. The disk's rate bounds the cold check wherever
it is below the hashing rate.

\b
    python benchmarks/checksum_throughput.py --json benchmarks/runs/checksum.json
    python benchmarks/checksum_throughput.py --files 16 --threads 8 --dir /some/nvme/dir --json RESULT.json
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402

from offline_extract import __version__  # noqa: E402
from offline_extract.store import checksum, manifest, verdicts  # noqa: E402
from offline_extract.store.schema import shard_name  # noqa: E402

OUTPUT_BYTES = 100e9  # the output size the rates are extrapolated to
WRITE_CHUNK = 64 << 20


def _write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, size, WRITE_CHUNK):
            f.write(os.urandom(min(WRITE_CHUNK, size - start)))
        f.flush()
        os.fsync(f.fileno())


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rate(total_bytes: int, seconds: list[float]) -> dict:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "seconds": [round(s, 3) for s in seconds],
        "best_gb_s": round(total_bytes / best / 1e9, 3),
        "median_gb_s": round(total_bytes / median / 1e9, 3),
        "seconds_for_100_gb_at_median": round(OUTPUT_BYTES / (total_bytes / median), 1),
    }


def run(files: int, gb_per_file: float, threads: int, repeats: int, work: Path) -> dict:
    size = int(gb_per_file * 1e9)
    paths = [work / shard_name(i) for i in range(files)]
    for path in paths:
        _write_random(path, size)
    entries = [{checksum.KEY: checksum.file_checksum(p), "bytes": size} for p in paths]  # also warms the cache
    total = size * files

    one_core = [_timed(lambda: [checksum.file_checksum(p) for p in paths]) for _ in range(repeats)]
    one_core_sha256 = [
        _timed(lambda: [checksum.file_checksum(p, checksum.BLOCK_SHA256_KEY) for p in paths]) for _ in range(repeats)
    ]
    threaded = [_timed(lambda: manifest.checksums(paths, entries, threads)) for _ in range(repeats)]

    def cold() -> float:
        for path in paths:
            _drop_from_page_cache(path)
        return _timed(lambda: manifest.checksums(paths, entries, threads))

    cold_runs = [cold() for _ in range(repeats)]
    recorded = {"status": "complete", "shards": {p.name: e for p, e in zip(paths, entries)}}
    first_check = _timed(lambda: verdicts.damaged_shards(work, recorded, threads))
    kept = [_timed(lambda: verdicts.damaged_shards(work, recorded, threads)) for _ in range(repeats)]
    return {
        "command": command_line("python benchmarks/checksum_throughput.py"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "offline_extract": __version__,
            "dir": str(work),
            "load_average_1_5_15_min": os.getloadavg(),
        },
        "files": files,
        "bytes_per_file": size,
        "threads": threads,
        "repeats": repeats,
        "checksum": checksum.KEY,
        "one_core_warm": _rate(total, one_core),
        "one_core_warm_block_sha256": _rate(total, one_core_sha256),
        "threads_warm": _rate(total, threaded),
        "threads_cold": _rate(total, cold_runs),
        "first_check_s": round(first_check, 3),
        "kept_check_s_per_shard": round(statistics.median(kept) / files, 6),
    }


@program(__doc__)
@click.option("--files", default=2, show_default=True, help="Shard-sized files to hash.")
@click.option("--gb-per-file", default=1.0, show_default=True, help="Each file's size, GB.")
@click.option(
    "--threads",
    default=min(8, os.cpu_count() or 1),
    show_default="min(8, cores)",
    help="Threads hashing side by side, as the datasets' check uses.",
)
@click.option("--repeats", default=3, show_default=True)
@click.option("--dir", "dir_", default=None, help="Where the files go (a temporary directory under it).")
@click.option("--json", "json_path", default=None, help="Also save the result to this file.")
def main(files: int, gb_per_file: float, threads: int, repeats: int, dir_: str | None, json_path: str | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="oe-checksum-", dir=dir_))
    try:
        emit(run(files, gb_per_file, threads, repeats, work), json_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
