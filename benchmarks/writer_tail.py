#!/usr/bin/env python
"""The writer's share of an extraction's tail, without a GPU: what is left to do after the last batch's
states reach the host, on 8B-shaped states (3 aux layers and the final state, hidden 4096).

Batches arrive `--pace` seconds apart, as forwards would hand them over, so the writer threads work while
the "GPU" computes; after the last one the clock runs until `close` returns. `batches` feeds 16,384-token
batches of 8 samples each; `long` feeds one sample of `--tokens` rows in 16,384-row chunks, as the
extraction feeds a long sample (`begin_sample(stream=True)`, `filled`, `end_sample`).

The development VM has two cores, so the tail's wall time there says little about a host with dozens:
the figures that carry over are the CPU seconds each thread spent after the last batch (sampled from
/proc, by thread name), the largest of which bounds the tail on a host with a core for every thread. The shards' sha256
are listed, to show that a change to the writer left the bytes alone.

\b
    python -m benchmarks.writer_tail --case batches --compress zstd --writers 12
    python -m benchmarks.writer_tail --case long --tokens 131072
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from pathlib import Path

import click
import psutil
import torch

from benchmarks import emit, program

from offline_extract.options import choices, default
from offline_extract.store.schema import Encoding, RunInfo, SampleInfo
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.states import residual_like

K, H = 3, 4096
BATCH_TOKENS = 16384


class _ThreadCPU:
    """CPU seconds each thread of this process spends inside the block (threads that end inside it are
    counted up to the last sample, taken every few milliseconds)."""

    def __enter__(self):
        self._proc, self._stop, self.names = psutil.Process(), threading.Event(), {}
        self._start = self._times()
        self._last = dict(self._start)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _times(self) -> dict[int, float]:
        self.names.update({t.native_id: t.name for t in threading.enumerate()})
        return {t.id: t.user_time + t.system_time for t in self._proc.threads()}

    def _sample(self):
        while not self._stop.wait(0.002):
            self._last.update(self._times())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._last.update(self._times())
        self._last.pop(self._thread.native_id, None)
        spent = {tid: v - self._start.get(tid, 0.0) for tid, v in self._last.items()}
        self.spent = sorted(((s, self.names.get(tid, "?")) for tid, s in spent.items()), reverse=True)


def _info(i: int, tokens: int) -> SampleInfo:
    return SampleInfo(index=i, id=f"s{i}", source="synthetic", line=i + 1, source_len=tokens, truncated=False)


def run(case: str, out: Path, store: str, compress: str, writers: int, pace: float, batches: int, tokens: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    encoding = Encoding(store, compress)
    states = residual_like(BATCH_TOKENS, K + 1, H).reshape(BATCH_TOKENS, K + 1, H)
    aux, last = states[:, :K].reshape(BATCH_TOKENS, K * H).contiguous(), states[:, K].contiguous()
    staged = encoding.encode(aux, last, K)
    ids = torch.arange(BATCH_TOKENS, dtype=torch.int32)
    mask = torch.ones(BATCH_TOKENS, dtype=torch.uint8)
    run = RunInfo(layer_ids=tuple(range(K)), store=store, compress=compress)
    writer = ShardWriter(out, run, writers=writers, widths=encoding.widths(K, H))
    per = BATCH_TOKENS // 8
    if case == "batches":
        steps = []
        for b in range(batches):
            samples = [_info(b * 8 + i, per) for i in range(8)]
            steps.append(lambda samples=samples: writer.add_staged(samples, ids, mask, staged, lengths=[per] * 8))
    else:
        rows = {}

        def chunk(start: int) -> None:
            stop = min(start + BATCH_TOKENS, tokens)
            if start == 0:
                n = torch.arange(tokens, dtype=torch.int32)
                rows.update(
                    writer.begin_sample(
                        _info(0, tokens),
                        n,
                        torch.ones(tokens, dtype=torch.uint8),
                        {name: t.shape[1] for name, t in staged.items()},
                        stream=True,
                    )
                )
            for name, t in staged.items():
                rows[name][start:stop].copy_(t[: stop - start])
            writer.filled(stop)
            if stop == tokens:
                writer.end_sample()

        steps = [lambda start=start: chunk(start) for start in range(0, tokens, BATCH_TOKENS)]
    for step in steps[:-1]:
        step()
        time.sleep(pace)
    with _ThreadCPU() as cpu:
        start = time.perf_counter()
        steps[-1]()
        handed = time.perf_counter()
        paths = writer.close()
        done = time.perf_counter()
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    written = sum(p.stat().st_size for p in paths)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "case": case,
        "store": store,
        "compress": compress,
        "writers": writers,
        "pace_s": pace,
        "tokens": tokens if case == "long" else batches * BATCH_TOKENS,
        "bytes_written": written,
        "last_batch_handover_s": handed - start,
        "close_s": done - handed,
        "tail_s": done - start,
        "tail_cpu_s": round(sum(s for s, _ in cpu.spent), 3),
        "tail_thread_cpu_s": [[name, round(s, 3)] for s, name in cpu.spent if s >= 0.005],
        "shard_sha256": digests,
    }


@program(__doc__)
@click.option("--case", type=click.Choice(("batches", "long")), default="batches", show_default=True)
@click.option("--out", default="/dev/shm/oe-writer-tail", show_default=True)
@click.option("--store", type=click.Choice(choices("store")), default=default("store"), show_default=True)
@click.option("--compress", type=click.Choice(choices("compress")), default=default("compress"), show_default=True)
@click.option("--writers", default=12, show_default=True)
@click.option("--pace", default=1.0, show_default=True, help="Seconds between batches (chunks), as forwards take.")
@click.option("--batches", default=6, show_default=True, help="Batches of 16,384 tokens (--case batches).")
@click.option("--tokens", default=131072, show_default=True, help="The long sample's length (--case long).")
@click.option("--json", "json_path", default=None, help="Also save the result to this file.")
def main(
    case: str,
    out: str,
    store: str,
    compress: str,
    writers: int,
    pace: float,
    batches: int,
    tokens: int,
    json_path: str | None,
) -> None:
    emit(run(case, Path(out), store, compress, writers, pace, batches, tokens), json_path)


if __name__ == "__main__":
    main()
