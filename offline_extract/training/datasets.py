"""PyTorch datasets over an output directory of shards, for training on the extracted hidden states.

`HiddenStateDataset` is map-style: item i is the i-th sample in sample-index (corpus) order, and
`get_by_id` finds a sample by its id. `HiddenStateIterableDataset` streams every sample once per epoch
in a seeded order shuffled across shards, split without overlap across distributed ranks and
DataLoader workers.

Each item is a dict:

    input_ids          int64    [T]       (widened from the shard's int32: nn.Embedding, cross-entropy
                                           targets and SpecForge all take int64)
    loss_mask          uint8    [T]       (0/1, as stored)
    image_mask         uint8    [T]       (1 at image tokens, never in the loss; zeros for a text sample and
                                           for shards written before format version 3)
    aux_hidden_states  bfloat16 [T, k*H]  (EAGLE-3 layers in run.layer_ids order)
    hidden_states      bfloat16 [T, H]    (the final state, run.final_state; absent when the recipe
                                           keeps none)
    id                 str

States are decoded to bf16 whatever the shards store (fp8 values times their per-token scales, nvfp4's
times their block and token scales, zstd frames decompressed). Under zstd each sample's states are one frame
per tensor, so an item decompresses exactly its own bytes, once, and memory stays one sample's worth whatever
the order of reading.

Before serving anything, every shard is checked against the checksum its manifest records, once per file as it
is (`store/verdicts.py`; `verify_checksums=False` opts out), and samples are located from the shards' own
headers, which index.json only repeats. Shards are opened lazily, once per process, through safetensors'
memory map, and an item reads only its own rows. Every tensor in an item owns a storage of exactly its size:
safetensors' slices are views of the whole memory-mapped tensor, and handing such a view to torch.save or to a
DataLoader worker's result queue would write or copy the entire shard tensor, not the sample.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from offline_extract.store import manifest, verdicts
from offline_extract.store.index import index_mismatch, not_shards, read_index, scan, shard_paths
from offline_extract.store.schema import RunInfo, ShardError
from offline_extract.store.shard import encoding_of, read_samples, sample_bounds


@dataclass
class Catalog:
    """Where every sample of an output directory lives, in sample-index order."""

    out_dir: Path
    run: RunInfo
    shard_files: list[Path]
    ids: list[str]
    # numpy rather than lists of ints: forked DataLoader workers share these pages instead of copying
    # them as reference counts change.
    shard: np.ndarray
    row: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def load_catalog(out_dir: str | os.PathLike, allow_partial: bool = False, verify_checksums: bool = True) -> Catalog:
    """Where each sample lives, from the shards' headers; index.json only repeats them, and is named in
    a warning where it disagrees.

    An extraction that has not finished (or lost shards since) is refused: training on it as if it were
    whole would silently miss samples. allow_partial=True reads what is there, with a warning.
    Every shard manifest.json (or an unfinished run's journal) lists is first checked against its
    checksum there, and a damaged one refused: a flipped byte in a state is otherwise served as it is
    (zstd frames carry their own checksum, but raw states none). That reads the whole output
    once; the verdict is kept beside the shards (`store/verdicts.py`), so a later dataset pays a stat per
    shard. Without manifest.json there is nothing to check against, which a warning says.
    verify_checksums=False reads without the check (and without that warning).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        what = "is a file" if out_dir.exists() else "does not exist"
        raise ShardError(f"{out_dir} {what}: give an extraction's output directory (its --out)")
    reason = manifest.unfinished(out_dir)
    if reason and not allow_partial:
        raise ShardError(f"{reason}, or allow a partial read (allow_partial=True, --allow-partial)")
    if reason:
        warnings.warn(reason)
    ignored = not_shards(out_dir)
    if ignored:
        warnings.warn(ignored)
    if verify_checksums:
        _check_checksums(out_dir)
    if not shard_paths(out_dir) and (read_index(out_dir) or {}).get("num_samples") == 0:
        raise ShardError(f"{out_dir} holds no samples: its extraction extracted none")
    headers, order = scan(out_dir)
    mismatch = None if reason else index_mismatch(out_dir, headers, order)  # an unfinished run's is stale by nature
    if mismatch:
        warnings.warn(mismatch)
    return Catalog(
        out_dir=out_dir,
        run=headers[0].run,
        shard_files=[h.path for h in headers],
        ids=[headers[s].samples[row].id for _, s, row in order],
        shard=np.asarray([s for _, s, _ in order], dtype=np.int64),
        row=np.asarray([row for _, _, row in order], dtype=np.int64),
    )


def _check_checksums(out_dir: Path) -> None:
    recorded = manifest.load(out_dir)
    if recorded is None:
        # Shards written through the library have no manifest; an extraction's output has lost its own.
        warnings.warn(
            f"{out_dir} has no {manifest.MANIFEST_NAME}, which records its shards' checksums: damage in "
            f"them cannot be told, and would be served as it is"
        )
        return
    damaged = verdicts.damaged_shards(out_dir, recorded)
    if damaged:
        raise ShardError(
            f"{out_dir} holds damaged shards:\n  "
            + "\n  ".join(damaged)
            + "\nDelete them and re-run the extraction: it extracts exactly their samples again"
        )


class _ShardHandles:
    """This process's open shards, each with its encoding and sample bounds; reopened after a fork,
    dropped when pickled."""

    def __init__(self, files: list[Path]):
        self._files = files
        self._pid = os.getpid()
        self._open: dict[int, tuple] = {}

    def __getstate__(self) -> dict:
        # safe_open handles cannot be pickled; a spawned DataLoader worker opens its own.
        return {"_files": self._files, "_pid": None, "_open": {}}

    def _handle(self, shard: int) -> tuple:
        if self._pid != os.getpid():
            # A forked worker inherits the parent's mappings; its own keep the parent's state out of it.
            self._open = {}
            self._pid = os.getpid()
        entry = self._open.get(shard)
        if entry is None:
            handle = safe_open(self._files[shard], framework="pt")
            encoding = encoding_of(handle, self._files[shard])
            entry = (handle, encoding, sample_bounds(handle, encoding))
            self._open[shard] = entry
        return entry

    def read(self, shard: int, row: int, names=None, decode: bool = True) -> dict[str, torch.Tensor]:
        handle, encoding, bounds = self._handle(shard)
        samples = len(bounds["offsets"]) - 1
        if row >= samples:
            raise ShardError(f"{self._files[shard]} has {samples} samples; row {row} was asked for")
        item = read_samples(
            handle, encoding, bounds, row, row + 1, names or encoding.sample_tensors, self._files[shard], decode
        )
        # Slices of the memory map share its storage; decoded tensors are the sample's own already.
        item = {k: t.clone() if t.untyped_storage().nbytes() != t.nbytes else t for k, t in item.items()}
        item["input_ids"] = item["input_ids"].long()
        return item


class HiddenStateDataset(Dataset):
    """Map-style: item i is the i-th sample in sample-index order (see the module docstring)."""

    def __init__(self, out_dir: str | os.PathLike, *, allow_partial: bool = False, verify_checksums: bool = True):
        self.catalog = load_catalog(out_dir, allow_partial, verify_checksums)
        self._handles = _ShardHandles(self.catalog.shard_files)
        self._position_of_id: dict[str, int] | None = None

    @property
    def run(self) -> RunInfo:
        return self.catalog.run

    @property
    def ids(self) -> list[str]:
        return self.catalog.ids

    def __len__(self) -> int:
        return len(self.catalog)

    def __getitem__(self, i: int | str) -> dict:
        """Item i by position, or by sample id (a str)."""
        if isinstance(i, str):
            i = self.index_of(i)
        n = len(self.catalog)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i %= n
        item: dict = self._handles.read(int(self.catalog.shard[i]), int(self.catalog.row[i]))
        item["id"] = self.catalog.ids[i]
        return item

    def stored(self, i: int) -> dict:
        """Item i with its states as the shards store them, decompressed but not decoded (under --store fp8:
        e4m3 values and their float32 `<state>_scale` tensors; nvfp4 adds `<state>_block_scale`), for an export
        that keeps the run's store."""
        item: dict = self._handles.read(int(self.catalog.shard[i]), int(self.catalog.row[i]), decode=False)
        item["id"] = self.catalog.ids[i]
        return item

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item i's input_ids and loss_mask alone, without reading its states."""
        item = self._handles.read(int(self.catalog.shard[i]), int(self.catalog.row[i]), ("input_ids", "loss_mask"))
        return item["input_ids"], item["loss_mask"]

    def index_of(self, sample_id: str) -> int:
        if self._position_of_id is None:
            self._position_of_id = {sid: i for i, sid in enumerate(self.catalog.ids)}
        try:
            return self._position_of_id[sample_id]
        except KeyError:
            raise KeyError(
                f"no sample with id {sample_id!r} in {self.catalog.out_dir}: items are ds[position] or ds[sample id] "
                f"(ds.ids lists the ids), and each item is a dict with its id under 'id'"
            ) from None

    def get_by_id(self, sample_id: str) -> dict:
        return self[self.index_of(sample_id)]


def pad_collate(items: list[dict], pad_token_id: int = 0) -> dict:
    """A DataLoader's collate_fn for items of different lengths: each tensor padded at the end to the
    batch's longest sample ([B, T_max, ...]; input_ids with `pad_token_id`, the rest with zeros, so the
    loss mask is 0 on padding), plus `attention_mask` [B, T_max] (1 on real tokens), `lengths` [B] and
    `id` as a list. torch's default collate stacks and so needs equal lengths."""
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    batch = {"id": [item["id"] for item in items], "lengths": lengths}
    for name in items[0]:
        if name == "id":
            continue
        value = pad_token_id if name == "input_ids" else 0
        batch[name] = torch.nn.utils.rnn.pad_sequence(
            [item[name] for item in items], batch_first=True, padding_value=value
        )
    batch["attention_mask"] = (torch.arange(int(lengths.max())) < lengths[:, None]).to(torch.uint8)
    return batch


class HiddenStateIterableDataset(IterableDataset):
    """Every sample once per epoch, in an order shuffled across shards by (seed, epoch).

    Rank r of world_size takes positions r, r + world_size, ... of the epoch's order, and DataLoader
    worker w of W takes every W-th of those, so no sample is read twice. With drop_last the order is
    cut to a multiple of world_size, giving every rank the same count (which data-parallel training
    needs to stay in step) at the cost of up to world_size - 1 samples per epoch.

    Samples are read in random order rather than shard by shard: one sample is many megabytes of
    contiguous rows per tensor, so a random order costs little over a sequential one even from disk.

    Call set_epoch before each epoch's iterator is created; workers copy the dataset when the iterator
    starts, so persistent_workers=True would keep the first epoch's order.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        shuffle: bool = True,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        allow_partial: bool = False,
        verify_checksums: bool = True,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        self.catalog = load_catalog(out_dir, allow_partial, verify_checksums)
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self._handles = _ShardHandles(self.catalog.shard_files)

    @property
    def run(self) -> RunInfo:
        return self.catalog.run

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _rank_positions(self) -> np.ndarray:
        n = len(self.catalog)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        if self.drop_last:
            order = order[: n - n % self.world_size]
        return order[self.rank :: self.world_size]

    def __len__(self) -> int:
        """Samples this rank yields per epoch, over all of its DataLoader workers."""
        return len(self._rank_positions())

    def __iter__(self) -> Iterator[dict]:
        positions = self._rank_positions()
        worker = get_worker_info()
        if worker is not None:
            positions = positions[worker.id :: worker.num_workers]
        for i in positions:
            item = self._handles.read(int(self.catalog.shard[i]), int(self.catalog.row[i]))
            item["id"] = self.catalog.ids[i]
            yield item
