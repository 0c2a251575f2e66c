"""Writing shards: samples buffered into shards of about a target size, serialized by writer threads."""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from offline_extract.options import DEFAULT_WRITERS, default
from offline_extract.store.atomic import atomic_write
from offline_extract.store import shard_file
from offline_extract.store.shard import ShardHeader
from offline_extract.store.schema import (
    FORMAT_VERSION,
    FRAMES_SUFFIX,
    METADATA_KEY,
    SPECS,
    STATE_TENSORS,
    TOKEN_TENSORS,
    Encoding,
    RunInfo,
    SampleInfo,
    ShardError,
    shard_name,
    shard_number,
)

# The shard still buffered when a writer closes is written after the last forward, where nothing overlaps
# it: it is cut into up to one shard a writer thread, each of at least this many state bytes (a part takes
# tens of milliseconds), so that all threads write it at once (a file is written by one thread: a write
# holds the file's inode lock).
LAST_SHARD_PART_BYTES = 64 << 20


# A sample of no tokens has no states to train on (the tokenizer rejects such records), and under zstd its
# empty frame would not say its width: it would read back as [0, 0] and break a read of several samples.
_NO_TOKENS = "samples {ids} have no tokens (lengths {lengths}): every sample needs at least one"


def _as_tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _state_widths(encoding: Encoding, widths: dict[str, int]) -> dict[str, int]:
    """The widths of a batch's staged tensors, checked against what `encoding` stages."""
    want = [t.name for t in encoding.staged]
    if sorted(widths) != sorted(want):
        raise ShardError(f"states {sorted(widths)} given, but the encoding {encoding.to_json()} stores {want}")
    widths = {name: int(w) for name, w in widths.items()}
    # In state elements, of which a stored column may hold several (two e2m1 codes a byte).
    aux_values, last_values = (encoding.staged_of(name)[0] for name in STATE_TENSORS)
    aux = widths[aux_values.name] * aux_values.per
    hidden = widths[last_values.name] * last_values.per if last_values.name in widths else None
    if hidden is not None and (hidden == 0 or aux % hidden != 0):
        raise ShardError(f"aux width {aux} is not a multiple of hidden size {hidden}")
    return widths


def _packed(
    samples: Sequence[SampleInfo],
    lengths: Sequence[int],
    tensors: dict[str, torch.Tensor],
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The lengths and the tensors of a batch of `samples` packed along dim 0, checked against each other."""
    lengths = [int(n) for n in lengths]
    if len(lengths) != len(samples):
        raise ShardError(f"{len(samples)} samples but {len(lengths)} lengths")
    empty = [s.id for s, n in zip(samples, lengths) if n <= 0]
    if empty:
        raise ShardError(_NO_TOKENS.format(ids=empty, lengths=lengths))
    total = sum(lengths)
    for name, t in tensors.items():
        want_dims = 1 if name in TOKEN_TENSORS else 2
        if t.dim() != want_dims or t.shape[0] != total:
            raise ShardError(
                f"{name} has shape {tuple(t.shape)}; expected {want_dims} dims with sum(lengths)={total} rows"
            )
    return lengths, tensors


def _token_tensors(input_ids, loss_mask, image_mask) -> dict[str, torch.Tensor]:
    """The tokens' own tensors (TOKEN_TENSORS) of packed samples; an image_mask of None is one of zeros."""
    ids = _as_tensor(input_ids)
    mask = torch.zeros(ids.shape, dtype=SPECS["image_mask"].dtype) if image_mask is None else _as_tensor(image_mask)
    return dict(zip(TOKEN_TENSORS, (ids, _as_tensor(loss_mask), mask), strict=True))


class _ShardBuffer:
    """Host memory for one shard in the making; reused from shard to shard to avoid page faults."""

    def __init__(self, encoding: Encoding, widths: dict[str, int], tokens: int):
        self.encoding, self.widths = encoding, widths
        self.tensors = {name: torch.empty(tokens, dtype=SPECS[name].dtype) for name in encoding.token_tensors}
        self.tensors.update({t.name: torch.empty(tokens, widths[t.name], dtype=t.dtype) for t in encoding.staged})
        self.clear()

    @property
    def capacity(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def clear(self) -> None:
        self.writes_left = 0  # of the shards handed to writer threads from this buffer, still being written
        self.samples: list[SampleInfo] = []
        self.lengths: list[int] = []
        self.tokens = 0
        # Under zstd, each recorded sample's frames as they are being compressed: {state: Future[bytes]}
        self.frames: list[dict[str, Future]] = []

    def reserve(self, n: int) -> dict[str, torch.Tensor]:
        """Views of the next `n` rows of every tensor, to be filled and then `record`ed."""
        need = self.tokens + n
        if need > self.capacity:  # the sample that crosses the shard target: grow (see _Buffers.written)
            grown = _ShardBuffer(self.encoding, self.widths, max(need, self.capacity + self.capacity // 16))
            for name, t in self.tensors.items():
                grown.tensors[name][: self.tokens].copy_(t[: self.tokens])
            self.tensors = grown.tensors
        return {name: t[self.tokens : need] for name, t in self.tensors.items()}

    def record(self, samples, lengths) -> None:
        """The samples whose rows were reserved and filled, in order."""
        self.samples.extend(samples)
        self.lengths.extend(lengths)
        self.tokens += sum(lengths)

    def append(self, samples, lengths, tensors: dict[str, torch.Tensor], start: int, stop: int) -> None:
        for name, rows in self.reserve(stop - start).items():
            rows.copy_(tensors[name][start:stop])
        self.record(samples, lengths)

    def contents(
        self, pending: tuple[SampleInfo, int] | None = None, parts: int = 1
    ) -> list[tuple[list[SampleInfo], dict[str, torch.Tensor], list[dict[str, Future]]]]:
        """The samples, the shard's tensors (views of this buffer) and the samples' frames (under zstd),
        with the `pending` (sample, tokens) whose rows are reserved after the recorded ones, if given; cut
        into up to `parts` shards of about equal tokens, whole samples each."""
        samples, lengths = list(self.samples), list(self.lengths)
        if pending is not None:
            samples.append(pending[0])
            lengths.append(pending[1])
        bounds = np.cumsum([0, *lengths])
        targets = bounds[-1] * np.arange(1, parts) / parts
        above = np.searchsorted(bounds, targets)  # the first sample boundary at or past each target
        nearest = above - (targets - bounds[above - 1] < bounds[above] - targets)
        cuts = sorted({0, len(samples), *nearest.tolist()})
        shards = []
        for first, stop in zip(cuts, cuts[1:]):
            rows = slice(int(bounds[first]), int(bounds[stop]))
            out = {name: t[rows] for name, t in self.tensors.items()}
            out["offsets"] = torch.tensor(bounds[first : stop + 1] - bounds[first], dtype=SPECS["offsets"].dtype)
            out["sample_index"] = torch.tensor(
                [s.index for s in samples[first:stop]], dtype=SPECS["sample_index"].dtype
            )
            shards.append((samples[first:stop], out, self.frames[first:stop]))
        return shards


def shard_buffers(
    encoding: Encoding, widths: dict[str, int], shard_bytes: int, count: int, touch: bool = True
) -> list[_ShardBuffer]:
    """`count` buffers of one shard of `shard_bytes` each, for the encoding's staged tensors of `widths`.

    Touched (written once) by default: a first-touch copy runs several times slower than one into resident
    memory. A caller may prepare them ahead, e.g. while the model loads, and hand them to ShardWriter.
    """
    rows = max(1, -(-shard_bytes // encoding.state_bytes(widths)))
    # The sample that takes a shard past its target closes it and goes in with it: room for it up front, since
    # a buffer that grows copies every row it holds into memory not yet touched.
    buffers = [_ShardBuffer(encoding, widths, rows + rows // 16) for _ in range(count)]
    for buf in buffers if touch else ():
        for t in buf.tensors.values():
            t.zero_()
    return buffers


@dataclass(frozen=True)
class WrittenShard:
    """A shard that is complete under its final name, with the checksum of its bytes."""

    name: str
    block_xxh3_128: str  # checksum.KEY, the journal's and manifest's name for it
    bytes: int
    num_samples: int
    num_tokens: int


class _Buffers:
    """A writer's shard buffers of `shard_bytes`: at most `count` ever exist, so that host memory is bounded
    whatever the corpus size. Made as first needed, for the `widths` fixed by then (`fix`), or given up front,
    each goes back (`written`) once a writer thread has written it; a caller that outpaces the disk waits for
    one in `take` (back-pressure)."""

    def __init__(
        self, encoding: Encoding, shard_bytes: int, count: int, widths: dict[str, int] | None, given: list[_ShardBuffer]
    ):
        self._encoding, self._shard_bytes = encoding, shard_bytes
        self.widths = widths  # of each staged tensor: given, the given buffers', or fixed by the first batch
        # Whether made buffers are touched: given ones were, or the widths were known ahead.
        self._touch = widths is not None or bool(given)
        self.free: queue.Queue[_ShardBuffer] = queue.Queue()
        self.left = count  # how many may still be made or given
        self.waited_s = 0.0  # for the bench: the writes were behind
        # All shard buffers up front, touched, so that first-touch copies stay off the hot path during the
        # first shards: given (`shard_buffers`, prepared ahead), or allocated now for `widths`.
        for buf in given[:count]:
            self.left -= 1
            self.free.put(buf)
            self.widths = buf.widths
        if widths is not None and not given:
            while self.left:
                self.left -= 1
                self.free.put(self._make())

    def fix(self, widths: dict[str, int]) -> int:
        """Checks the staged tensors' widths against the encoding (`_state_widths`) and the buffers'; returns the
        state bytes a token."""
        widths = _state_widths(self._encoding, widths)
        if self.widths is None:
            self.widths = widths
        elif widths != self.widths:
            raise ShardError(f"state widths changed from {self.widths} to {widths}")
        return self._encoding.state_bytes(widths)

    def fixed(self) -> dict[str, int]:
        """The widths, once given or fixed by the first batch (`fix`)."""
        if self.widths is None:
            raise ShardError("no batch has fixed the state widths yet")
        return self.widths

    def _make(self) -> _ShardBuffer:
        return shard_buffers(self._encoding, self.fixed(), self._shard_bytes, 1, touch=self._touch)[0]

    def take(self) -> _ShardBuffer:
        """A buffer to fill: a new one while fewer than `count` exist, else the next one handed back."""
        if self.left:
            self.left -= 1
            return self._make()
        start = time.perf_counter()
        buf = self.free.get()
        self.waited_s += time.perf_counter() - start
        return buf

    def written(self, buf: _ShardBuffer, closed: bool) -> None:
        """A writer thread has written the last shard of `buf`: it goes back. One grown past twice a shard, for
        a sample longer than a shard, would stay that size for the rest of the run, and up to `count` of them
        could: it is swapped for a standard one, touched here, off the hot path. One grown less, for a sample
        that crossed the target, keeps its room, or every shard closed by such a sample would grow it again.
        Once the writer is `closed`, no buffer is needed any more, and touching one would only delay the end."""
        buf.clear()
        row_bytes = self._encoding.state_bytes(buf.widths)
        try:
            if buf.capacity * row_bytes > 2 * self._shard_bytes and not closed:
                buf = self._make()
        finally:
            # The grown one goes back when no standard one could be had (out of memory): the error is this
            # write's, and a caller waiting for a buffer would otherwise wait for ever.
            self.free.put(buf)


class _Writes:
    """A writer's threads: each shard handed over (`submit`) is written by one of `writers` threads, one file
    each, whose blocks `writers` more threads hash while it is written (`shard_file.write`); under zstd the
    writer threads also compress each sample's states once it is buffered (`compress_recorded`). A failed write
    is raised by the next `raise_failed`. `done` is called from a writer thread with a buffer whose every shard
    is written; `on_written` with each shard complete under its final name."""

    def __init__(
        self,
        run: RunInfo,
        writers: int,
        on_written: Callable[[WrittenShard], None] | None,
        done: Callable[[_ShardBuffer], None],
    ):
        # Serialized now, not after the first shard's worth of GPU work.
        self._run_document = run.to_json()
        json.dumps(self._run_document)
        self._run, self._encoding = run, run.encoding
        self._on_written, self._done = on_written, done
        self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="shard-writer")
        # The hashes of the blocks the writer threads write (shard_file.write): tasks that never wait, so a writer
        # thread can wait for them.
        self._blocks = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="shard-block")
        self._encoders = threading.local()
        self._lock = threading.Lock()
        self.pending: list[Future] = []
        self.paths: list[Path] = []
        self.failed: BaseException | None = None  # the first write that failed, raised again by close()
        self.bytes = self.samples = self.tokens = 0
        self.headers: list[ShardHeader] = []
        self.timed: list[tuple[float, float, int]] = []

    def submit(
        self,
        path: Path,
        buf: _ShardBuffer,
        samples: list[SampleInfo],
        tensors: dict[str, torch.Tensor],
        frames: list[dict[str, Future]],
        filling: shard_file.Filling | None,
    ) -> None:
        self.pending.append(self._pool.submit(self._write, path, buf, samples, tensors, frames, filling))

    def _write(
        self,
        path: Path,
        buf: _ShardBuffer,
        samples: list[SampleInfo],
        tensors: dict[str, torch.Tensor],
        frames: list[dict[str, Future]],
        filling: shard_file.Filling | None,
    ) -> Path:
        start = time.perf_counter()
        try:
            compressed = self._compressed(tensors, frames)
            stored = {name: compressed[name] for name in self._encoding.file_order}
            document = {
                "format_version": FORMAT_VERSION,
                "run": self._run_document,
                "samples": [s.to_json() for s in samples],
            }
            metadata = {METADATA_KEY: json.dumps(document)}
            digest = atomic_write(path, lambda tmp: shard_file.write(tmp, stored, metadata, self._blocks, filling))
            size, tokens = path.stat().st_size, stored["input_ids"].shape[0]
            header = ShardHeader(
                path, self._run, samples, {name: tuple(t.shape) for name, t in stored.items()}, self._encoding
            )
            with self._lock:
                self.bytes += size
                self.samples += len(samples)
                self.tokens += tokens
                self.headers.append(header)
                self.timed.append((start, time.perf_counter() - start, size))
            if self._on_written is not None:
                self._on_written(WrittenShard(path.name, digest, size, len(samples), tokens))
            return path
        finally:
            with self._lock:
                buf.writes_left -= 1
                last = buf.writes_left == 0
            if last:
                self._done(buf)

    def _compressed(
        self, tensors: dict[str, torch.Tensor], frames: list[dict[str, Future]]
    ) -> dict[str, torch.Tensor | shard_file.Frames]:
        """Under zstd, each compressed state as its samples' `frames`, and their byte offsets."""
        out: dict[str, torch.Tensor | shard_file.Frames] = dict(tensors)
        for name in self._encoding.compressed:
            data = [sample[name].result() for sample in frames]
            out[name] = shard_file.Frames(data)
            out[name + FRAMES_SUFFIX] = torch.tensor(np.cumsum([0, *map(len, data)]), dtype=torch.int64)
        return out

    def compress_recorded(self, buf: _ShardBuffer) -> None:
        """Under zstd, starts compressing the frames of the samples just recorded in `buf`, each state of
        each sample a task of the writer threads. A shard's frames are then ready about when its last batch
        arrives; compressed only once the shard was complete, by the one thread that writes it, the last
        shard's took most of a second after the last forward. The write waits for them: submitted before
        it, they are running or done by the time a thread takes the write (the pool is first in, first
        out), so that wait cannot starve."""
        if not self._encoding.compressed:
            return
        new = buf.lengths[len(buf.frames) :]
        start = buf.tokens - sum(new)
        for n in new:
            buf.frames.append(
                {
                    name: self._pool.submit(self._compress_frame, buf.tensors[name][start : start + n])
                    for name in self._encoding.compressed
                }
            )
            start += n

    def _compress_frame(self, rows: torch.Tensor) -> bytes:
        if not hasattr(self._encoders, "encode"):
            self._encoders.encode = self._encoding.frame_codec.encoder()  # an encoder serves one thread at a time
        return self._encoders.encode(rows)

    def raise_failed(self) -> None:
        done = [f for f in self.pending if f.done()]
        for f in done:
            self.pending.remove(f)
            if f.exception() is not None:
                self.failed = self.failed or f.exception()
            self.paths.append(f.result())  # re-raises a writer thread's error here

    def wait(self) -> None:
        """Until every write has ended, raising the first that failed."""
        for f in self.pending:
            f.exception()  # wait for all, so no thread still writes when we raise
        self.raise_failed()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._blocks.shutdown(wait=True)


@dataclass
class _Begun:
    """A sample begun (`ShardWriter.begin_sample`) and not ended: its `tokens` rows of `row_bytes` each in the
    shard buffer `buf`; with `filling`, its rows still arriving while that shard is already being written."""

    sample: SampleInfo
    tokens: int
    row_bytes: int
    buf: _ShardBuffer
    filling: shard_file.Filling | None = None


class _OpenShard:
    """The shard being filled: a buffer taken from `buffers` for its first sample (`buffer`), full once its state
    bytes reach `shard_bytes` (`full`), then handed to `writes` under the next shard names of `numbers` that are
    not on disk (`flush`): whole, or where the caller is about to wait for it, cut into up to one part a writer
    thread (`tail_parts`)."""

    def __init__(
        self,
        out_dir: Path,
        numbers: Iterator[int],
        shard_bytes: int,
        writers: int,
        buffers: _Buffers,
        writes: _Writes,
    ):
        self._out_dir, self._numbers, self._shard_bytes, self._writers = out_dir, numbers, shard_bytes, writers
        self._buffers, self._writes = buffers, writes
        self._current: _ShardBuffer | None = None

    @property
    def tokens(self) -> int:
        return self._current.tokens if self._current is not None else 0

    def full(self, tokens: int, row_bytes: int) -> bool:
        """Whether a shard of `tokens` rows of `row_bytes` state bytes each is complete."""
        return tokens * row_bytes >= self._shard_bytes

    def buffer(self) -> _ShardBuffer:
        if self._current is None:
            waits = not self._buffers.left
            self._current = self._buffers.take()
            if waits:
                self._writes.raise_failed()
        return self._current

    def tail_parts(self) -> int:
        """Into how many shards the current buffer is cut when the caller waits for its write: one a writer
        thread, each LAST_SHARD_PART_BYTES or more."""
        buf = self._current
        size = buf.tokens * buf.encoding.state_bytes(buf.widths) if buf is not None else 0
        return max(1, min(self._writers, size // LAST_SHARD_PART_BYTES))

    def flush(
        self, pending: tuple[SampleInfo, int] | None = None, filling: shard_file.Filling | None = None, parts: int = 1
    ) -> None:
        """Hands the current buffer to a writer thread, with the `pending` sample whose rows are `filling`;
        or, cut into up to `parts` shards, to as many threads."""
        buf, self._current = self._current, None
        if buf is None or not (buf.samples or pending):
            return
        shards = buf.contents(pending, parts)
        paths = _new_shard_paths(self._out_dir, self._numbers, len(shards))
        buf.writes_left = len(shards)
        for path, (samples, tensors, frames) in zip(paths, shards):
            self._writes.submit(path, buf, samples, tensors, frames, filling)

    def drop(self) -> None:
        """Leaves the shard being filled unwritten."""
        self._current = None


class ShardWriter:
    """Assembles batches of extracted samples into shards of about `shard_bytes` and writes them.

    A shard is closed as soon as its hidden-state bytes (aux + last as the run's encoding stores them, before any
    compression) reach `shard_bytes` (`_OpenShard`), so it exceeds that size by less than one sample; samples are
    never split across shards. What is still buffered at `close` is written by every thread at once, as up to
    `writers` smaller shards (LAST_SHARD_PART_BYTES), since the caller waits for it; so is a shard that one of the
    run's last batches completes, when the caller says the end is near (`ending`). `add_batch` copies its input into
    a shard buffer and returns, so callers may reuse their (pinned) staging memory at once. Complete shards are
    written by `writers` threads (`_Writes`) from at most `writers + 1` shard buffers (`_Buffers`): host memory is
    bounded whatever the corpus size, and a caller that outpaces the disk blocks in `add_batch`. A failed write
    (disk full, I/O error) is raised from the next `add_batch` or from `close`, and leaves no file under a shard's
    final name. `on_written` is called from a writer thread once a shard is complete under its final name.

    A sample whose states arrive in pieces (a long sample, chunk by chunk) goes in with `begin_sample`, which hands
    out its rows in the shard buffer to fill, and `end_sample`: its states are then copied into host memory once,
    never assembled elsewhere first. Under zstd a sample's frame needs all of its rows (`_Writes.compress_recorded`),
    so a long sample's shard is written once the sample is complete, not while it fills.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        run: RunInfo,
        *,
        shard_bytes: int = default("shard_bytes"),
        shard_numbers: Iterator[int] | None = None,
        writers: int = DEFAULT_WRITERS,  # it holds at most one more shard buffer than threads
        on_written: Callable[[WrittenShard], None] | None = None,
        widths: dict[str, int] | None = None,
        buffers: list[_ShardBuffer] | None = None,
    ):
        _check_writer(run, shard_bytes, writers)
        self._writes = _Writes(run, writers, on_written, lambda buf: self._buffers.written(buf, self._closed))
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.encoding = run.encoding
        self.shard_bytes = shard_bytes
        self._closed = False
        self._open: _Begun | None = None
        self._buffers = _Buffers(run.encoding, shard_bytes, writers + 1, widths, buffers or [])
        numbers = shard_numbers if shard_numbers is not None else itertools.count()
        self._shard = _OpenShard(self.out_dir, numbers, shard_bytes, writers, self._buffers, self._writes)

    # What the writer threads wrote (`_Writes`): shards, samples, tokens and bytes, the shards' headers as
    # read_header would read them back, and for the bench each write as (perf_counter at its start, seconds,
    # bytes); and the seconds add_batch waited for a shard buffer (the writes are behind).
    bytes_written = property(lambda self: self._writes.bytes)
    samples_written = property(lambda self: self._writes.samples)
    tokens_written = property(lambda self: self._writes.tokens)
    headers = property(lambda self: self._writes.headers)
    writes = property(lambda self: self._writes.timed)
    buffer_wait_s = property(lambda self: self._buffers.waited_s)

    def add_batch(
        self,
        samples: Sequence[SampleInfo],
        input_ids: np.ndarray | torch.Tensor,
        loss_mask: np.ndarray | torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor | None,
        *,
        lengths: Sequence[int],
        ending: bool = False,
        image_mask: np.ndarray | torch.Tensor | None = None,
    ) -> None:
        """Adds `samples`, whose tokens are packed in order along dim 0 of every tensor, encoding their
        states here (the extraction encodes on the GPU instead and calls add_staged).

        `lengths[i]` is the token count of `samples[i]`; the packed tensors must have sum(lengths) rows.
        `last` is the final state, None when the encoding keeps none. `image_mask`: 1 at image tokens (None: none).
        """
        aux, last = _as_tensor(aux), None if last is None else _as_tensor(last)
        self.add_staged(
            samples,
            input_ids,
            loss_mask,
            self.encoding.encode(aux, last, self.run.num_aux_layers),
            lengths=lengths,
            ending=ending,
            image_mask=image_mask,
        )

    def add_staged(
        self,
        samples: Sequence[SampleInfo],
        input_ids: np.ndarray | torch.Tensor,
        loss_mask: np.ndarray | torch.Tensor,
        staged: dict[str, torch.Tensor],
        *,
        lengths: Sequence[int],
        ending: bool = False,
        image_mask: np.ndarray | torch.Tensor | None = None,
    ) -> None:
        """add_batch for states already encoded: `staged` holds the encoding's staged tensors.

        ending=True says that the caller will soon wait for the writes (the feed says so of the run's last few
        batches, `feed.ENDING_BATCHES`): a shard these samples complete is cut into parts for every writer
        thread at once, as what is left at `close` is (written whole, it would be one file written at one
        stream's rate after the last forward: a write into a file holds its inode lock)."""
        self._check_open("add_batch")
        lengths, tensors = _packed(samples, lengths, {**_token_tensors(input_ids, loss_mask, image_mask), **staged})
        row_bytes = self._buffers.fix({name: t.shape[1] for name, t in staged.items()})

        first_sample = first_row = row = 0
        for i, n in enumerate(lengths):
            row += n
            if self._shard.full(self._shard.tokens + row - first_row, row_bytes):
                self._append(samples[first_sample : i + 1], lengths[first_sample : i + 1], tensors, first_row, row)
                self._shard.flush(parts=self._shard.tail_parts() if ending else 1)
                first_sample, first_row = i + 1, row
        if first_sample < len(samples):
            self._append(samples[first_sample:], lengths[first_sample:], tensors, first_row, row)

    def _append(self, samples, lengths, tensors: dict[str, torch.Tensor], start: int, stop: int) -> None:
        buf = self._shard.buffer()
        buf.append(samples, lengths, tensors, start, stop)
        self._writes.compress_recorded(buf)

    def begin_sample(
        self,
        sample: SampleInfo,
        input_ids: np.ndarray | torch.Tensor,
        loss_mask: np.ndarray | torch.Tensor,
        widths: dict[str, int],
        *,
        stream: bool = False,
        image_mask: np.ndarray | torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows for one sample whose states arrive in pieces: returns its rows of each staged tensor, of
        `widths` columns, in the shard it goes to. The caller fills them in order, reports each filled prefix with
        `filled`, then calls `end_sample`; nothing else may be added in between.

        stream=True, when the sample completes its shard, starts writing that shard at once: every row is
        written (and hashed) as soon as it is filled, so that the write after the last row is short. Such a
        sample cannot then be left out (end_sample(keep=False)). A compressed shard is not streamed."""
        self._check_open("begin_sample")
        row_bytes = self._buffers.fix(widths)
        tokens = _sample_tokens(sample, input_ids, loss_mask, image_mask)
        n = tokens["input_ids"].shape[0]
        buf = self._shard.buffer()
        rows = buf.reserve(n)
        for name, t in tokens.items():
            rows[name].copy_(t)
        self._open = begun = _Begun(sample, n, row_bytes, buf)
        if stream and not self.encoding.compressed and self._shard.full(buf.tokens + n, row_bytes):
            begun.filling = shard_file.Filling(buf.tokens, buf.tokens + n)
            self._shard.flush(pending=(sample, n), filling=begun.filling)
        return {t.name: rows[t.name] for t in self.encoding.staged}

    def filled(self, rows: int) -> None:
        """The begun sample's first `rows` rows hold their final states."""
        if self._open is not None and self._open.filling is not None:
            self._open.filling.advance(self._open.filling.end - self._open.tokens + rows)

    def end_sample(self, keep: bool = True, ending: bool = False) -> None:
        """Completes the sample begun last, whose rows are now filled; keep=False leaves it out. `ending` as
        for add_staged."""
        if self._open is None:
            raise ShardError("end_sample called with no sample begun")
        begun, self._open = self._open, None
        if begun.filling is not None:  # its shard, handed to a writer thread at begin_sample, may now complete
            _end_streamed(begun.sample, begun.filling, keep)
            return
        if keep:
            begun.buf.record([begun.sample], [begun.tokens])
            self._writes.compress_recorded(begun.buf)
            if self._shard.full(begun.buf.tokens, begun.row_bytes):
                self._shard.flush(parts=self._shard.tail_parts() if ending else 1)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ShardError(f"{call} called on a closed ShardWriter")
        if self._open is not None:
            raise ShardError(f"{call} called while sample {self._open.sample.id!r} is begun and not ended")
        self._writes.raise_failed()

    def close(self) -> list[Path]:
        """Writes the buffered tail, waits for every write, and returns the shards written."""
        if self._open is not None:
            raise ShardError(f"close called while sample {self._open.sample.id!r} is begun and not ended")
        if not self._closed:
            self._closed = True
            try:
                self._shard.flush(parts=self._shard.tail_parts())
                self._writes.wait()
            finally:
                self._writes.shutdown()
            # A caller that caught a failed write from add_batch and closes (rather than abort) would otherwise
            # get the shards written as if they were all: the failed shard's samples are on no disk.
            failed = self._writes.failed
            if failed is not None:
                raise ShardError(
                    f"a shard write failed earlier ({failed!r}): its samples are not in {self.out_dir}"
                ) from failed
        return sorted(self._writes.paths, key=shard_number)

    def abort(self) -> None:
        """Stops after a failure elsewhere: drops the shard still being filled and waits for the complete
        ones already handed to writer threads.

        Each of those ends complete or leaves nothing, like any write; their own errors (the same full
        disk, usually) are dropped, since the failure that made the caller abort is the one to report.
        """
        if not self._closed:
            self._closed = True
            begun, self._open = self._open, None
            self._shard.drop()
            if begun is not None and begun.filling is not None:
                begun.filling.abort()
            self._writes.shutdown()


def _check_writer(run: RunInfo, shard_bytes: int, writers: int) -> None:
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    if writers < 1:
        raise ValueError(f"writers must be at least 1, got {writers}")
    if run.encoding.scales and run.num_aux_layers is None:
        raise ValueError(f"a run stored as {run.store} must record its layer_ids: each layer gets its own scales")


def _sample_tokens(sample: SampleInfo, input_ids, loss_mask, image_mask) -> dict[str, torch.Tensor]:
    """The token tensors of one sample begun alone (`ShardWriter.begin_sample`), checked: [T] alike, T > 0."""
    tokens = _token_tensors(input_ids, loss_mask, image_mask)
    ids = tokens["input_ids"]
    if ids.dim() != 1 or any(t.shape != ids.shape for t in tokens.values()):
        shapes = " and ".join(f"{name} {tuple(t.shape)}" for name, t in tokens.items())
        raise ShardError(f"{shapes} must be [T] alike")
    if not ids.shape[0]:
        raise ShardError(_NO_TOKENS.format(ids=[sample.id], lengths=[ids.shape[0]]))
    return tokens


def _end_streamed(sample: SampleInfo, filling: shard_file.Filling, keep: bool) -> None:
    """Ends a sample streamed into its shard, which a writer thread is writing: its shard completes once every
    row is filled; one left out or short aborts that write."""
    if not keep or filling.final != filling.end:
        filling.abort()
        raise ShardError(
            f"sample {sample.id!r} was streamed into its shard; it cannot be "
            + ("left out" if not keep else f"ended with {filling.end - filling.final} of its rows unfilled")
        )
    filling.confirm()


def _new_shard_paths(out_dir: Path, numbers: Iterator[int], count: int) -> list[Path]:
    """The next `count` shards' paths, none of them already on disk."""
    paths = [out_dir / shard_name(next(numbers)) for _ in range(count)]
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} already exists; refusing to overwrite another run's shard")
    return paths
