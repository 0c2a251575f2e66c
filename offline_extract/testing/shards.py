"""Synthetic output directories: shards of random states written through the real ShardWriter, for tests
and benchmarks that need an output directory without running a model."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from offline_extract.store.index import write_index
from offline_extract.store.schema import RunInfo, SampleInfo
from offline_extract.store.writer import ShardWriter

# Rows generated per add_batch call: bounds the float32 temporaries of random generation.
_GENERATE_ROWS = 8192


def synthetic_run(layer_ids=(0, 1, 2), hidden_size: int | None = None, **facts) -> RunInfo:
    """A run of a synthetic model that captured `layer_ids`; `facts` set any other RunInfo field (or
    override num_layers, the model's depth: by default one past the last captured layer, which is never
    an aux layer)."""
    layer_ids = tuple(layer_ids)
    made = {"model": "synthetic", "num_layers": max(layer_ids, default=0) + 2}
    return RunInfo(**{**made, "layer_ids": layer_ids, "hidden_size": hidden_size, **facts})


def write_synthetic(
    out_dir: str | os.PathLike,
    lengths: list[int],
    *,
    hidden_size: int,
    num_aux: int = 3,
    shard_bytes: int = 1 << 30,
    seed: int = 0,
    **facts,
) -> list[Path]:
    """Writes samples of the given lengths (ids "sample-{i}", random bf16 states, stored as the run's
    encoding says) plus index.json; `facts` set the run's fields (`synthetic_run`), e.g. store="fp8"."""
    run = synthetic_run(facts.pop("layer_ids", range(num_aux)), hidden_size, **facts)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out_dir, run, shard_bytes=shard_bytes)

    def add(indices: list[int]) -> None:
        batch = [lengths[i] for i in indices]
        total = sum(batch)
        samples = [SampleInfo(i, f"sample-{i}", "synthetic", i + 1, n, False) for i, n in zip(indices, batch)]
        writer.add_batch(
            samples,
            torch.randint(0, 128_000, (total,), generator=gen, dtype=torch.int32),
            torch.rand(total, generator=gen) < 0.7,
            torch.randn(total, num_aux * hidden_size, generator=gen).to(torch.bfloat16),
            torch.randn(total, hidden_size, generator=gen).to(torch.bfloat16) if run.encoding.keeps_final_state else None,
            lengths=batch,
        )

    pending: list[int] = []
    for i, n in enumerate(lengths):
        if pending and sum(lengths[j] for j in pending) + n > _GENERATE_ROWS:
            add(pending)
            pending = []
        pending.append(i)
    if pending:
        add(pending)
    paths = writer.close()
    write_index(out_dir)
    return paths
