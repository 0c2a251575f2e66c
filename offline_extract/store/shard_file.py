"""A shard's safetensors file, written straight from the tensors' memory and checksummed block by block as it is
written (`write`), a compressed state frame by frame (`Frames`), and the rows of a state still arriving while
its file is written (`Filling`). `ShardWriter` decides what goes into which shard; this is how one is written.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

import torch

from offline_extract.store import checksum
from offline_extract.store.schema import SAFETENSORS_DTYPES, ShardError


class Filling:
    """State rows of a shard still arriving while the shard is written: its last sample's, chunk by chunk.

    The writing thread hands out each block of the file to be written and hashed as soon as its rows are
    final, and waits here for the rest;
    the file becomes the shard only once the sample is `confirm`ed, after the caller has checked it whole
    (a NaN found then must not leave a complete shard behind). `abort` makes the thread give up, and the
    partial file goes like any failed write's."""

    def __init__(self, final: int, end: int):
        self._cond = threading.Condition()
        self.final = final  # rows [0, final) of the state tensors hold their final values
        self.end = end
        self._confirmed = self._aborted = False

    def advance(self, final: int) -> None:
        with self._cond:
            self.final = final
            self._cond.notify_all()

    def confirm(self) -> None:
        with self._cond:
            self._confirmed = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def wait(self, beyond: int) -> int:
        """How many rows are final, once that is more than `beyond`."""
        return self._wait(lambda: self.final > beyond)

    def wait_confirmed(self) -> None:
        self._wait(lambda: self._confirmed)

    def _wait(self, ready) -> int:
        with self._cond:
            self._cond.wait_for(lambda: ready() or self._aborted)
            if self._aborted:
                raise ShardError("a shard being written as its last sample arrived was abandoned")
            return self.final


def _as_bytes(t: torch.Tensor) -> memoryview:
    return t.view(torch.uint8).reshape(-1).numpy().data


class Frames:
    """A compressed state's zstd frames as the uint8 tensor they make in the file, written frame by frame.
    Joining them first (and copying the join into a tensor) held two more copies of the shard's compressed
    bytes per writer thread while it wrote."""

    dtype = torch.uint8

    def __init__(self, frames: list[bytes]):
        self.frames = frames
        self.shape = (sum(map(len, frames)),)

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return 1


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _layout(
    tensors: dict[str, torch.Tensor | Frames],
    metadata: dict[str, str],
    filling: Filling | None,
) -> tuple[list[tuple[int, memoryview]], list[tuple[int, int, int]], int]:
    """The file's bytes as (file offset, bytes) in file order, the header first, then the tensors' own memory; the
    (start, stop, row bytes) in the file of each tensor whose rows `filling` fills; and the file's size."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = len(blob).to_bytes(8, "little") + blob
    pieces = [(0, memoryview(head))]
    rows = []
    offset = len(head)
    for t in tensors.values():
        data = (
            [memoryview(frame) for frame in t.frames]
            if isinstance(t, Frames)
            else [_as_bytes(t.contiguous())]
            if t.numel()
            else []
        )
        if filling is not None and not isinstance(t, Frames) and t.dim() == 2 and t.numel():
            rows.append((offset, offset + len(data[0]), len(data[0]) // t.shape[0]))
        for piece in data:
            pieces.append((offset, piece))
            offset += len(piece)
    return pieces, rows, offset


def _between(
    pieces: list[tuple[int, memoryview]], starts: list[int], a: int, b: int
) -> Iterator[tuple[int, memoryview]]:
    """The file's bytes [a, b), as (file offset, bytes) in file order, from its `pieces` (which start at `starts`)."""
    i = bisect.bisect_right(starts, a) - 1
    while i < len(pieces) and pieces[i][0] < b:
        start, data = pieces[i]
        yield max(a, start), data[max(a, start) - start : min(b, start + len(data)) - start]
        i += 1


def _blocks(rows: list[tuple[int, int, int]], size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The file's checksum blocks, each (start, stop) in the file, and for each the state rows that must be final
    before its bytes are (`rows` as `_layout` gives them)."""
    blocks = [(a, min(a + checksum.BLOCK_BYTES, size)) for a in range(0, size, checksum.BLOCK_BYTES)]
    needs = [
        max([(min(b, stop) - start - 1) // row + 1 for start, stop, row in rows if start < b and a < stop], default=0)
        for a, b in blocks
    ]
    return blocks, needs


def write(
    path: Path,
    tensors: dict[str, torch.Tensor | Frames],
    metadata: dict[str, str],
    pool: ThreadPoolExecutor,
    filling: Filling | None = None,
) -> str:
    """Write a safetensors file straight from the tensors' memory, without an intermediate bytes copy,
    and return its checksum (`store/checksum.py`), hashed from memory so the file is never read back.

    The file is written in blocks of checksum.BLOCK_BYTES, each at its offset, by the calling thread alone,
    and each block is hashed by one of the `pool`'s threads while it is written. A write into a file holds
    the file's inode lock (tmpfs, ext4, xfs): several threads writing one file go one at a time, and while
    they wait, no other shard is written. With one thread a file, the writer threads write their shards
    side by side (blocks of one shard handed to the pool's threads would write one file at a time, at one
    stream's rate, below what TP=2 hands over; docs/start-up.md, "The tail after the last forward").
    With `filling`, the state rows from `filling.final` on are still arriving: a block goes as soon as
    every row it holds is final, and is flushed to disk, so that once the last row is, only the blocks it
    lands in are left (with one hash over the file, its second state tensor, a gigabyte for a
    131,072-token sample, could only be hashed after the last row).

    The layout is safetensors' own (u64 header length, JSON header padded to 8 bytes, raw data in the
    dict's order), so the reference reader opens it; the tests read every shard back through it.
    """
    pieces, rows, size = _layout(tensors, metadata, filling)
    starts = [start for start, _ in pieces]
    blocks, needs = _blocks(rows, size)
    digests = [b""] * len(blocks)

    def parts(k: int) -> Iterator[tuple[int, memoryview]]:
        return _between(pieces, starts, *blocks[k])

    def hash_block(k: int) -> None:
        digest = checksum.new_block_hash()
        for _, part in parts(k):
            digest.update(part)
        digests[k] = digest.digest()

    order = sorted(range(len(blocks)), key=needs.__getitem__)
    hashing: list[Future] = []
    # A file we create gets the mode the process umask allows (safetensors' own writer leaves 0600, which
    # other users' training jobs could not read).
    with open(path, "wb") as f:
        try:
            final = filling.final if filling is not None else 0
            for k in order:
                while filling is not None and needs[k] > final:  # without it every row is final: needs are 0
                    final = filling.wait(final)
                hashing.append(pool.submit(hash_block, k))
                for offset, part in parts(k):
                    _pwrite(f.fileno(), part, offset)
                if filling is not None and final < filling.end:
                    os.fdatasync(f.fileno())  # on a disk, the final fsync would otherwise flush it all at once
            for block in hashing:
                block.result()
            if filling is not None:
                filling.wait_confirmed()
        finally:
            wait(hashing)  # no block may still be hashed once the tensors' memory can go back to the writer
    return checksum.combine(digests)
