"""Feeding batches to the engine and its states to the writer: the hot loop of an extraction.

Each batch is one forward (or a long sample's chunks, one forward each); its states are encoded on the
device and copied to pinned host rows on a side stream (`engine.offload`) while the next forward runs,
then handed to the `ShardWriter`, screened for NaN/Inf on the way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from offline_extract.data.batching import Batch
from offline_extract.data.tokenization import Sample
from offline_extract.engine.nonfinite import NonFiniteGuard, batch_flag
from offline_extract.engine.offload import HostOffload, pinned_buffers
from offline_extract.engine.sglang_adapter import Captured, Engine
from offline_extract.lifecycle import host_use
from offline_extract.store.schema import FINAL_STATE_TENSOR, STATE_TENSORS, Encoding, SampleInfo
from offline_extract.store.writer import ShardWriter, shard_buffers


def _info(s: Sample) -> SampleInfo:
    images = None if s.images is None else s.images.fingerprint
    return SampleInfo(s.index, s.id, s.source, s.line, s.source_len, s.truncated, images)


def _image_mask(samples) -> np.ndarray | None:
    """The packed samples' image-token mask (None where none has images)."""
    if all(s.images is None for s in samples):
        return None
    return np.concatenate(
        [
            np.zeros(s.num_tokens, np.uint8) if s.images is None else s.images.token_mask.astype(np.uint8)
            for s in samples
        ]
    )


@dataclass(frozen=True)
class _Piece:
    """Rows start:stop of a batch's packed tokens, as one forward returned them (all of a batch, or one
    chunk of a long sample), with their non-finite flag."""

    batch: Batch
    start: int
    stop: int
    flag: torch.Tensor
    ending: bool  # of the run's last ENDING_BATCHES batches: their writes are waited for (ShardWriter.add_staged's)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.batch.num_tokens


def _forwards(engine: Engine, batch: Batch) -> Iterator[tuple[int, int, Captured]]:
    """A batch's forwards, each with the rows it covers: the batch in one, or a long sample's chunks."""
    seqs = [s.input_ids for s in batch.samples]
    images = [s.images for s in batch.samples]
    # A sequence with images is never chunked: capture refuses one over the budget.
    if engine.is_chunked(seqs) and images[0] is None:
        yield from engine.chunks(seqs[0], engine.chunk_tokens)
    else:
        yield 0, batch.num_tokens, engine.capture(seqs, images)


class _WriterFeed:
    """The offload's consumer: hands each piece's host rows to the writer. A long sample's chunks go
    straight into its rows in the shard buffer as they arrive, so its states are never held on the host
    twice, and are screened for NaN/Inf once all of them are there. Its shard is written as the chunks
    arrive, unless non-finite samples are dropped: a streamed sample can no longer be left out."""

    def __init__(self, writer: ShardWriter, guard: NonFiniteGuard):
        self.writer = writer
        self.guard = guard
        self._rows: dict[str, torch.Tensor] | None = None  # the long sample being filled, per staged tensor
        self._flagged = False

    # The flag travels with its piece, so it is read only once the copy event says the states (and the
    # flag, enqueued before them) are on the host.
    def __call__(self, piece: _Piece, staged: dict[str, torch.Tensor]) -> None:
        if piece.whole:
            self._batch(piece, staged)
            return
        (sample,) = piece.batch.samples
        if piece.start == 0:
            widths = {name: t.shape[1] for name, t in staged.items()}
            stream = self.guard.policy != "drop"
            self._rows = self.writer.begin_sample(
                _info(sample), sample.input_ids, sample.loss_mask, widths, stream=stream
            )
            self._flagged = False
        rows = self._rows
        assert rows is not None, "begun at the sample's first piece"
        for name, t in staged.items():
            rows[name][piece.start : piece.stop].copy_(t)
        self.writer.filled(piece.stop)
        self._flagged |= bool(piece.flag)
        if piece.stop == sample.num_tokens:
            kept = self._screen([sample], rows)[0] if self._flagged else [sample]
            self._rows = None
            self.writer.end_sample(keep=bool(kept), ending=piece.ending)

    def _screen(self, samples, staged: dict[str, torch.Tensor]):
        """The guard's verdict on the decoded states: kept samples and their rows (None: all)."""
        states = self.writer.encoding.decode(staged)
        return self.guard.screen(samples, states[STATE_TENSORS[0]], states.get(FINAL_STATE_TENSOR))

    def _batch(self, piece: _Piece, staged: dict[str, torch.Tensor]) -> None:
        samples = piece.batch.samples
        if piece.flag:
            samples, rows = self._screen(samples, staged)
            if not samples:
                return
            if rows is not None:
                staged = {name: t[rows] for name, t in staged.items()}
        self.writer.add_staged(
            [_info(s) for s in samples],
            np.concatenate([s.input_ids for s in samples]),
            np.concatenate([s.loss_mask for s in samples]),
            staged,
            lengths=[s.num_tokens for s in samples],
            ending=piece.ending,
            image_mask=_image_mask(samples),
        )


# The run's last batches, whose shards are written as parts for every writer thread at once (`_Piece.ending`).
# A whole shard is one file written by one thread, about 1.5-2 GB/s to tmpfs: 0.3-0.65 s for a shard of 512 MiB
# or more, longer than a MoE shape's last two forwards at 16k tokens take: a whole shard that any of the last
# three batches completes is still being written after the last forward, on the run's critical path.
ENDING_BATCHES = 3
_END = object()


def prepared_ahead(batches: Iterable[Batch], engine: Engine | None = None, depth: int = 8) -> Iterator[Batch]:
    """`batches`, made on a thread of their own up to `depth` ahead of the caller: the records' reading,
    tokenizing and batching run beside the forwards instead of between them, and with `engine` the host's work
    on each batch's images that its forward would do (`Engine.prepare_images`: every image's pixels hashed).
    The tokenizer's Rust code, the file reads and the hashing release the GIL; on the main thread they sat
    between two forwards, where a small model's GPU, done in milliseconds, waited for them. An error there (a
    bad record under --strict) is raised here, to the caller, as it was raised; a caller that stops early stops
    the thread."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if engine is not None:
                    engine.prepare_images([s.input_ids for s in batch.samples], [s.images for s in batch.samples])
                if not put(batch):
                    return
        except BaseException as e:  # raised to the caller, in order after the batches before it
            put(e)
            return
        finally:
            host_use.ending()
        put(_END)

    thread = threading.Thread(target=produce, name="batches-ahead", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


class _Input:
    """The feed's batches, with the seconds it waited for each one after the first (`waited_s`): the records'
    reading, tokenizing and batching behind the forwards, which the GPU may have waited for too. The first
    batch's wait is the run's start-up."""

    def __init__(self, batches: Iterable[Batch]):
        self._batches = iter(batches)
        self._first = True
        self.waited_s = 0.0

    def next(self) -> Batch | None:
        start = time.perf_counter()
        batch = next(self._batches, None)
        if not self._first:
            self.waited_s += time.perf_counter() - start
        self._first = False
        return batch


def extract_batches(
    engine: Engine,
    batches: Iterable[Batch],
    writer: ShardWriter | None,
    on_batch=lambda b: None,
    staging=None,
    nonfinite: NonFiniteGuard | None = None,
) -> dict:
    """The hot loop: forward each batch and hand its states to the writer without waiting for the host.

    A long sample's chunks are handed over one by one, so that copying the earlier ones overlaps the later
    ones' compute. `staging` (from `staging_buffers`) may be passed in to reuse pinned memory across
    calls. Ranks that do not write (tp_rank > 0) still take part in every forward: TP needs all of them.
    Batches with NaN or Inf go through `nonfinite` (default: fail on the first such sample).
    Returns where the host's time went around the forwards: `input_wait_s`, its wait for the next batch
    (`_Input`), with a writer `HostOffload.times`, and `host_use`, the host's threads on its cores (`HostUse`).
    """
    incoming = _Input(batches)
    use = host_use.HostUse()
    if writer is None:
        while (batch := incoming.next()) is not None:
            for _ in _forwards(engine, batch):
                pass
            on_batch(batch)
        return {"input_wait_s": incoming.waited_s, "host_use": use.report()}
    feed = _WriterFeed(writer, nonfinite or NonFiniteGuard("fail", engine.layer_ids))

    def encode(aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
        return encode_states(engine, writer.encoding, aux, last)

    buffers = staging or staging_buffers(engine, writer.encoding)
    ahead = deque([incoming.next()])  # the batches after the current one; None where the run ends
    with HostOffload(feed, engine.device, buffers, encode, at_end=host_use.ending) as offload:
        while (batch := ahead.popleft()) is not None:
            for i, (start, stop, captured) in enumerate(_forwards(engine, batch)):
                if not i:
                    # Read while the batch's first forward computes: how near the run's end the batch is
                    # decides how its shards are written.
                    while len(ahead) < ENDING_BATCHES and (not ahead or ahead[-1] is not None):
                        ahead.append(incoming.next())
                ending = ahead[-1] is None
                piece = _Piece(batch, start, stop, batch_flag(captured.aux, captured.last), ending)
                offload.submit(piece, captured.aux, captured.last)
            on_batch(batch)
    return {"input_wait_s": incoming.waited_s, **offload.times, "host_use": use.report()}


def encode_states(
    engine: Engine, encoding: Encoding, aux: torch.Tensor, last: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A forward's captured states in `encoding`'s staged tensors, on the device."""
    return encoding.encode(aux, last, len(engine.layer_ids))


# Token ids of the warm-up's one sequence: inside any vocabulary.
_WARM_UP_IDS = np.arange(1, 18, dtype=np.int64)


def warm_up_encoding(engine: Engine, encoding: Encoding) -> None:
    """A short sequence's states encoded as every batch's are (`encode_states`), so that a store whose
    quantizing compiles a kernel at its first call on the GPU (nvfp4's Triton kernel, specialized on each
    state's width and layer count) compiles it in the start-up rather than inside the first batches."""
    captured = engine.capture([_WARM_UP_IDS])
    encode_states(engine, encoding, captured.aux, captured.last)
    if torch.device(engine.device).type == "cuda":
        torch.cuda.synchronize(engine.device)


def staging_buffers(engine: Engine, encoding: Encoding) -> list:
    """Pinned host rows for a few forwards' states: a batch's, or one chunk's of a long sample."""
    widths = encoding.widths(len(engine.layer_ids), engine.hidden_size)
    return pinned_buffers(engine.device, engine.max_forward_tokens, encoding, widths)


class HostMemory:
    """A writing rank's hot-loop host memory on a GPU, prepared on a thread while the model loads: pinned
    staging for the forwards' states and the writer's touched shard buffers. Pinning and first
    touching a few gigabytes takes a second or more, which would otherwise sit between the loaded model
    and the first batch.

    The widths are predicted from the config before the model loads; should the loaded engine differ,
    the prepared memory is dropped and allocated anew.
    """

    def __init__(
        self, encoding: Encoding, widths: dict[str, int], forward_tokens: int, gpu: int, shard_bytes: int, writers: int
    ):
        self.encoding = encoding
        self.widths = widths
        self.forward_tokens = forward_tokens
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-memory")
        self._prepared = pool.submit(self._allocate, gpu, shard_bytes, writers)
        pool.shutdown(wait=False)

    def _allocate(self, gpu: int, shard_bytes: int, writers: int) -> tuple[list, list]:
        torch.cuda.set_device(gpu)  # pinned memory belongs to the current device's context, per thread
        staging = pinned_buffers("cuda", self.forward_tokens, self.encoding, self.widths)
        return staging, shard_buffers(self.encoding, self.widths, shard_bytes, writers + 1)

    def take(self, engine: Engine) -> tuple[list, list]:
        """(staging, shard buffers) for `engine`'s widths and forwards."""
        staging, buffers = self._prepared.result()
        widths = self.encoding.widths(len(engine.layer_ids), engine.hidden_size)
        if (self.widths, self.forward_tokens) != (widths, engine.max_forward_tokens):
            return staging_buffers(engine, self.encoding), []
        return staging, buffers
