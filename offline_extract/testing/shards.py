"""Synthetic output directories: shards of random or given states written through the real ShardWriter, the
one way tests and benchmarks make an output directory without running a model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from offline_extract.store.index import write_index
from offline_extract.store.schema import RunInfo, SampleInfo
from offline_extract.store.writer import ShardWriter, WrittenShard

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
    lengths: Sequence[int],
    *,
    hidden_size: int,
    num_aux: int = 3,
    shard_bytes: int = 1 << 30,
    seed: int = 0,
    indices: Sequence[int] | None = None,
    index: bool = True,
    shard_numbers: Iterator[int] | None = None,
    on_written: Callable[[WrittenShard], None] | None = None,
    **facts,
) -> list[Path]:
    """`write_samples` of random tokens, loss mask and bf16 states, generated a few thousand rows at a time;
    `facts` set the run's fields (`synthetic_run`), e.g. store="fp8"."""
    layer_ids = tuple(facts.pop("layer_ids", range(num_aux)))
    run = synthetic_run(layer_ids, hidden_size, **facts)
    positions = list(range(len(lengths)))
    indices = positions if indices is None else list(indices)
    gen = torch.Generator().manual_seed(seed)

    def batch(group: list[int]) -> _Batch:
        total = sum(lengths[i] for i in group)
        return _Batch(
            [indices[i] for i in group],
            [lengths[i] for i in group],
            torch.randint(0, 128_000, (total,), generator=gen, dtype=torch.int32),
            torch.rand(total, generator=gen) < 0.7,
            torch.randn(total, len(layer_ids) * hidden_size, generator=gen).to(torch.bfloat16),
            torch.randn(total, hidden_size, generator=gen).to(torch.bfloat16)
            if run.encoding.keeps_final_state
            else None,
        )

    def groups() -> Iterator[list[int]]:
        pending: list[int] = []
        for i in positions:
            if pending and sum(lengths[j] for j in pending) + lengths[i] > _GENERATE_ROWS:
                yield pending
                pending = []
            pending.append(i)
        if pending:
            yield pending

    return _write(out_dir, run, map(batch, groups()), shard_bytes, index, shard_numbers, on_written)


def write_samples(
    out_dir: str | os.PathLike,
    run: RunInfo,
    lengths: Sequence[int],
    input_ids: np.ndarray | torch.Tensor,
    loss_mask: np.ndarray | torch.Tensor,
    aux: torch.Tensor,
    last: torch.Tensor | None = None,
    *,
    shard_bytes: int = 1 << 30,
    indices: Sequence[int] | None = None,
    index: bool = True,
    shard_numbers: Iterator[int] | None = None,
    on_written: Callable[[WrittenShard], None] | None = None,
    image_mask: np.ndarray | torch.Tensor | None = None,
) -> list[Path]:
    """Writes the given rows as `run`'s output through the real ShardWriter: sample i has lengths[i] tokens,
    packed in order along dim 0 of every tensor, and corpus index indices[i] (default i), which names it
    (id "s{index}", line index + 1 of "synthetic"). The states are stored as the run's encoding says (`last`
    is dropped where it keeps no final state). Then index.json, unless `index` is False: a run still
    writing, or one rank of several. `shard_numbers` and `on_written` are the writer's; `image_mask` (1 at
    image tokens; None: no image) the tokens' as the writer takes it."""
    indices = range(len(lengths)) if indices is None else indices
    rows = _Batch(list(indices), list(lengths), input_ids, loss_mask, aux, last, image_mask)
    return _write(out_dir, run, [rows], shard_bytes, index, shard_numbers, on_written)


class _Batch(NamedTuple):
    indices: list[int]
    lengths: list[int]
    input_ids: np.ndarray | torch.Tensor
    loss_mask: np.ndarray | torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor | None
    image_mask: np.ndarray | torch.Tensor | None = None


def _write(
    out_dir, run: RunInfo, batches: Iterable[_Batch], shard_bytes: int, index: bool, shard_numbers, on_written
) -> list[Path]:
    writer = ShardWriter(out_dir, run, shard_bytes=shard_bytes, shard_numbers=shard_numbers, on_written=on_written)
    for b in batches:
        samples = [SampleInfo(i, f"s{i}", "synthetic", i + 1, n, False) for i, n in zip(b.indices, b.lengths)]
        last = b.last if run.encoding.keeps_final_state else None
        writer.add_batch(samples, b.input_ids, b.loss_mask, b.aux, last, lengths=b.lengths, image_mask=b.image_mask)
    paths = writer.close()
    if index:
        write_index(out_dir)
    return paths
