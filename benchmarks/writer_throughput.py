#!/usr/bin/env python
"""Host side of extraction, without a GPU: how fast ShardWriter takes batches, with and without its
buffers preallocated, and what a first-touch copy costs against a copy into resident memory; with
--store/--compress, in that encoding, with the process's peak resident memory above its baseline.

\b
    python benchmarks/writer_throughput.py [--out /dev/shm/oe-writer] [--gb 4]
    python benchmarks/writer_throughput.py --store fp8 --compress zstd --writers 4 --gb 2
    python benchmarks/writer_throughput.py --store bf16 --hidden 576 --samples 20 --gb 4   # SmolLM2-135M

Writes benchmarks/runs/writer_throughput_<host>[_<store>_<compress>].json with this command. The
states are Gaussian with a few large channels per layer, which zstd compresses about as it does real
activations (ones, as before, would compress to nothing and hide its cost).
"""

import json
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import click
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import RUNS, command_line, program  # noqa: E402

from offline_extract.options import DEFAULT_WRITERS, choices, default  # noqa: E402
from offline_extract.store.schema import Encoding, RunInfo, SampleInfo  # noqa: E402
from offline_extract.store.writer import ShardWriter  # noqa: E402
from offline_extract.testing.states import activation_like  # noqa: E402

K = 3  # aux layers, beside the last state
H = 4096  # the 8B shape's hidden size; --hidden gives another (576: SmolLM2-135M)
BATCH_TOKENS = 16384


def _copy_rate(nbytes: int, warm: bool) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    if warm:
        dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - start)


def _states(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of activation-like bf16 states (aux, last)."""
    x = activation_like(BATCH_TOKENS, K + 1, hidden)
    return x[:, :K].reshape(BATCH_TOKENS, K * hidden).contiguous(), x[:, K].contiguous()


class _PeakRSS:
    """The process's resident memory, sampled every few milliseconds while the block runs."""

    def __enter__(self):
        self._proc, self._stop = psutil.Process(), threading.Event()
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _writer_rate(
    out: Path,
    total_bytes: int,
    preallocate: bool,
    shard_bytes: int,
    encoding: Encoding = Encoding(),
    writers: int = DEFAULT_WRITERS,
    hidden: int = H,
    samples: int = 8,
) -> dict:
    """Bytes/s that add_batch + close sustain for batches of `samples` samples of `hidden`-wide states (the
    consumer thread's view)."""
    shutil.rmtree(out, ignore_errors=True)
    aux, last = _states(hidden)
    ids = torch.zeros(BATCH_TOKENS, dtype=torch.int32)
    mask = torch.ones(BATCH_TOKENS, dtype=torch.uint8)
    per_batch = (aux.numel() + last.numel()) * 2
    batches = max(1, total_bytes // per_batch)
    # Around the writer's whole life: its shard buffers are part of what it holds.
    with _PeakRSS() as rss:
        created = time.perf_counter()
        run = RunInfo(layer_ids=tuple(range(K)), store=encoding.store, compress=encoding.compress)
        writer = ShardWriter(
            out,
            run,
            shard_bytes=shard_bytes,
            writers=writers,
            widths=encoding.widths(K, hidden) if preallocate else None,
        )
        n = BATCH_TOKENS // samples
        lengths = [n] * (samples - 1) + [BATCH_TOKENS - n * (samples - 1)]
        start = time.perf_counter()
        for b in range(batches):
            writer.add_batch(_infos(b * samples, lengths), ids, mask, aux, last, lengths=lengths)
        fed = time.perf_counter()
        writer.close()
        done = time.perf_counter()
    written = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out, ignore_errors=True)
    data = batches * per_batch
    return {
        "hidden": hidden,
        "samples_per_batch": samples,
        "preallocate": preallocate,
        "shard_bytes": shard_bytes,
        "writers": writers,
        "bf16_state_bytes_over_file_bytes": data / written,
        "peak_rss_above_baseline_bytes": rss.peak - rss.baseline,
        "bytes": data,
        "setup_s": start - created,
        "add_batch_bytes_s": data / (fed - start),
        "end_to_end_bytes_s": data / (done - start),
        "tail_s": done - fed,
    }


def _infos(first: int, lengths: list[int]) -> list[SampleInfo]:
    """A batch's samples, numbered from `first`."""
    return [
        SampleInfo(
            index=first + i,
            id=f"s{first + i}",
            source="synthetic",
            line=first + i + 1,
            source_len=length,
            truncated=False,
        )
        for i, length in enumerate(lengths)
    ]


def _record(suffix: str, measured: dict) -> None:
    """Writes benchmarks/runs/writer_throughput_<host><suffix>.json, the command and machine first."""
    result = {
        "command": command_line("python benchmarks/writer_throughput.py"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        **measured,
    }
    path = RUNS / f"writer_throughput_{platform.node() or 'host'}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


@program(__doc__)
@click.option("--out", default="/dev/shm/oe-writer", show_default=True)
@click.option("--gb", default=4.0, show_default=True, help="Hidden-state bytes to push through each writer.")
@click.option(
    "--store",
    type=click.Choice(choices("store")),
    default=None,
    help="Measure this store only (with --compress), at 512 MB shards, preallocated.",
)
@click.option("--compress", type=click.Choice(choices("compress")), default=default("compress"), show_default=True)
@click.option("--writers", default=DEFAULT_WRITERS, show_default=True)
@click.option("--hidden", default=H, show_default=True, help="Hidden size of the states (576: SmolLM2-135M).")
@click.option("--samples", "samples", default=8, show_default=True, help="Samples a 16,384-token batch.")
def main(out: str, gb: float, store: str | None, compress: str, writers: int, hidden: int, samples: int) -> None:
    total = int(gb * (1 << 30))
    if store is not None:
        encoding = Encoding(store=store, compress=compress)
        suffix = f"_{store}_{compress}" + (f"_h{hidden}_s{samples}" if (hidden, samples) != (H, 8) else "")
        _record(suffix, {"writer": _writer_rate(Path(out), total, True, 512 << 20, encoding, writers, hidden, samples)})
        return
    _record(
        "",
        {
            "torch_threads": torch.get_num_threads(),
            "first_touch_copy_bytes_s": _copy_rate(1 << 30, warm=False),
            "resident_copy_bytes_s": _copy_rate(1 << 30, warm=True),
            "writer": [
                _writer_rate(Path(out), total, preallocate, shard_bytes)
                for shard_bytes in (1 << 30, 512 << 20)
                for preallocate in (False, True)
            ],
        },
    )


if __name__ == "__main__":
    main()
