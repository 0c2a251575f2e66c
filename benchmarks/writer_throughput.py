#!/usr/bin/env python
"""Host side of extraction, without a GPU: how fast ShardWriter takes batches, with and without its
buffers preallocated, and what a first-touch copy costs against a copy into resident memory.

    python benchmarks/writer_throughput.py [--out /dev/shm/oe-writer] [--gb 4]

Writes benchmarks/results/writer_throughput_<host>.json with this command.
"""
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import click
import torch

from offline_extract.store.schema import Encoding, SampleInfo
from offline_extract.store.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[1]
K, H = 3, 4096  # the 8B shape: 3 aux layers + the last state
BATCH_TOKENS = 16384


def _copy_rate(nbytes: int, warm: bool) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    if warm:
        dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - start)


def _writer_rate(out: Path, total_bytes: int, preallocate: bool, shard_bytes: int) -> dict:
    """Bytes/s that add_batch + close sustain for 8B-shaped batches (the consumer thread's view)."""
    shutil.rmtree(out, ignore_errors=True)
    aux = torch.ones(BATCH_TOKENS, K * H, dtype=torch.bfloat16)
    last = torch.ones(BATCH_TOKENS, H, dtype=torch.bfloat16)
    ids = torch.zeros(BATCH_TOKENS, dtype=torch.int32)
    mask = torch.ones(BATCH_TOKENS, dtype=torch.uint8)
    per_batch = (aux.numel() + last.numel()) * 2
    batches = max(1, total_bytes // per_batch)
    created = time.perf_counter()
    writer = ShardWriter(out, {"benchmark": True}, shard_bytes=shard_bytes, widths=Encoding().widths(K, H) if preallocate else None)
    start = time.perf_counter()
    for b in range(batches):
        samples = [SampleInfo(index=b * 8 + i, id=f"s{b * 8 + i}", source="synthetic", line=b * 8 + i + 1,
                              source_len=BATCH_TOKENS // 8, truncated=False) for i in range(8)]
        writer.add_batch(samples, ids, mask, aux, last, lengths=[BATCH_TOKENS // 8] * 8)
    fed = time.perf_counter()
    writer.close()
    done = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    data = batches * per_batch
    return {
        "preallocate": preallocate,
        "shard_bytes": shard_bytes,
        "bytes": data,
        "setup_s": start - created,
        "add_batch_bytes_s": data / (fed - start),
        "end_to_end_bytes_s": data / (done - start),
        "tail_s": done - fed,
    }


@click.command()
@click.option("--out", default="/dev/shm/oe-writer", show_default=True)
@click.option("--gb", default=4.0, show_default=True, help="Hidden-state bytes to push through each writer.")
def main(out: str, gb: float) -> None:
    total = int(gb * (1 << 30))
    result = {
        "command": "python " + " ".join(["benchmarks/writer_throughput.py", *sys.argv[1:]]),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "first_touch_copy_bytes_s": _copy_rate(1 << 30, warm=False),
        "resident_copy_bytes_s": _copy_rate(1 << 30, warm=True),
        "writer": [
            _writer_rate(Path(out), total, preallocate, shard_bytes)
            for shard_bytes in (1 << 30, 512 << 20)
            for preallocate in (False, True)
        ],
    }
    path = ROOT / "benchmarks" / "results" / f"writer_throughput_{platform.node() or 'host'}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
