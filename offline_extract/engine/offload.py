"""Moving captured states off the GPU without making the GPU wait for the host.

Each batch's states are encoded (cast to bf16, or quantized to fp8 with their scales) and copied on a
side CUDA stream into one of a few reused pinned host buffers, so the copy, host memory and the disk
carry only the stored bytes; a background thread waits for the copy and hands the host rows to the
consumer (the shard writer). The
main loop only blocks when every pinned buffer is still in flight, which is the back-pressure that keeps
host memory bounded when the disk is slower than the GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Generic, TypeVar

import torch

from offline_extract.store.schema import Encoding

B = TypeVar("B")
# Called with whatever the caller submitted as its batch, then the host copies of the staged tensors.
Consumer = Callable[[B, dict[str, torch.Tensor]], None]


def pinned_buffers(
    device: torch.device | str, max_tokens: int, encoding: Encoding, widths: dict[str, int], depth: int = 3
) -> list:
    """Host staging for `depth` batches in flight, one buffer per staged tensor. Allocate once and
    reuse: pinning half a gigabyte takes about 0.1 s. On CPU there is nothing to stage, only the depth
    to bound."""
    if torch.device(device).type != "cuda":
        return [None] * depth
    return [
        {t.name: torch.empty(max_tokens, widths[t.name], dtype=t.dtype, pin_memory=True) for t in encoding.staged}
        for _ in range(depth)
    ]


class HostOffload(Generic[B]):
    """`encode(aux, last)` turns a batch's captured states into the staged tensors the buffers hold; `at_end`
    is called last on the drain thread."""

    def __init__(
        self,
        consume: Consumer[B],
        device: torch.device | str,
        buffers: list,
        encode: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
        at_end: Callable[[], None] = lambda: None,
    ):
        self._consume = consume
        self._at_end = at_end
        self._encode = encode
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(self._device)
        self._free: queue.Queue = queue.Queue()
        for b in buffers:
            self._free.put(b)
        self._ready: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        # Where the host's time went (the bench and the manifest report it): the caller's wait for a free
        # buffer, i.e. for the copy and the consumer (the writer); the drain thread's wait for the copies;
        # and its time in the consumer.
        self.times = {"writer_wait_s": 0.0, "copy_wait_s": 0.0, "consume_s": 0.0}
        self._thread = threading.Thread(target=self._drain, name="host-offload", daemon=True)
        self._thread.start()

    def submit(self, batch: B, aux: torch.Tensor, last: torch.Tensor) -> None:
        """Start moving one batch's states to the host; returns before the copy is done."""
        self._raise_error()
        start = time.perf_counter()
        buffers = self._free.get()
        self.times["writer_wait_s"] += time.perf_counter() - start
        if not self._cuda:
            self._ready.put((batch, None, self._encode(aux, last), buffers))
            return
        t = aux.shape[0]
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            for src in (aux, last):
                # The caching allocator must not hand this memory to the next forward while we read it.
                src.record_stream(self._stream)
            # Encoded here, on the side stream: the next forward does not wait for it, and only the
            # stored bytes cross to the host.
            staged = self._encode(aux, last)
            host = {name: buffers[name][:t] for name in staged}
            for name, src in staged.items():
                host[name].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._ready.put((batch, done, host, buffers))

    def _drain(self) -> None:
        try:
            self._drain_all()
        finally:
            self._at_end()

    def _drain_all(self) -> None:
        while (item := self._ready.get()) is not None:
            batch, done, host, buffers = item
            try:
                if self._error is None:
                    start = time.perf_counter()
                    if done is not None:
                        done.synchronize()
                    copied = time.perf_counter()
                    self._consume(batch, host)
                    self.times["copy_wait_s"] += copied - start
                    self.times["consume_s"] += time.perf_counter() - copied
            except BaseException as e:  # surfaced to the main thread on its next submit or close
                self._error = e
            finally:
                self._free.put(buffers)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait until every submitted batch reached the consumer; re-raise the consumer's failure."""
        self._ready.put(None)
        self._thread.join()
        self._raise_error()

    def __enter__(self) -> "HostOffload":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._ready.put(None)
            self._thread.join()
