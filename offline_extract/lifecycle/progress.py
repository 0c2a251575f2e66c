"""What a run shows while it works: a bar or heartbeat lines (samples, tokens/s, bytes written, ETA),
and nothing of what the libraries it loads print unless asked."""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from offline_extract.formatting import for_terminal, human_bytes, number
from offline_extract.lifecycle import interrupts


def note(message: str) -> None:
    """One of our own lines, on stderr and at once (before a long phase starts, not after it)."""
    print(for_terminal(message, sys.stderr), file=sys.stderr, flush=True)


class _Done(ProgressColumn):
    """'15/24', or '15' while the total is unknown (a pipe, or before the count is in): not '15/?'."""

    def render(self, task) -> Text:
        total = f"/{number(int(task.total))}" if task.total is not None else ""
        return Text(f"{number(int(task.completed))}{total}", style="progress.download")


class RunProgress:
    """One bar per process; only the process that shows it draws (others pass enabled=False).

    With `heartbeat` (seconds) it prints a line that often instead of drawing a bar: a bar's redraws
    turn a log file or a cluster's captured output into noise. The total comes from `count_total`, run
    on a background thread: counting a terabyte corpus's lines takes minutes, and extraction need not
    wait for it (no ETA until then). It is counted whether or not the bar is shown: a run without progress
    still sets its output's growth against the free space (planning.OutputWatch), which needs the total.
    """

    def __init__(
        self,
        count_total: Callable[[], int | None] | None,
        label: str,
        enabled: bool = True,
        heartbeat: float | None = None,
    ):
        self.enabled = enabled
        self.label = label
        self.start = time.perf_counter()
        self.tokens = 0
        self.done = 0
        self.total: int | None = None
        self.heartbeat = heartbeat if enabled else None
        self._last_beat = self.start
        console = Console(stderr=True)
        bar = [BarColumn()]
        if not console.is_terminal and not console.is_jupyter:
            # A file or a pipe gets the bar's last frame only, which rich cuts at 80 columns ("0:00:…"): there
            # the counts and times are given the room they need, and the bar, always full by then, is left out.
            console, bar = Console(stderr=True, width=200), []
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            *bar,
            _Done(),
            TextColumn("samples  {task.fields[rate]} tok/s  {task.fields[written]} written"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled or heartbeat is not None,
        )
        self._task = self._progress.add_task(label, total=None, rate="0", written="0 B")
        if count_total is not None:
            # Named for the run's report of where its cores went (`host_use`).
            threading.Thread(target=lambda: self._set_total(count_total()), name="count-records", daemon=True).start()

    def _set_total(self, total: int | None) -> None:
        self.total = total
        self._progress.update(self._task, total=total)

    def __enter__(self) -> "RunProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def advance(self, samples: int, tokens: int, bytes_written: int) -> None:
        self.tokens += tokens
        self.done += samples
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self._progress.update(self._task, advance=samples, rate=number(round(rate)), written=human_bytes(bytes_written))
        if self.heartbeat and now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            print(self.beat(now, rate, bytes_written), file=sys.stderr, flush=True)

    def beat(self, now: float, rate: float, bytes_written: int) -> str:
        elapsed = now - self.start
        if self.total is None or not self.done:
            eta = "ETA unknown"
        else:
            eta = f"ETA {_clock(max(self.total - self.done, 0) * elapsed / self.done)}"
        of = f"/{number(self.total)}" if self.total is not None else ""
        return (
            f"{self.label}: {number(self.done)}{of} samples, {number(self.tokens)} tokens, {number(round(rate))} tok/s, "
            f"{human_bytes(bytes_written)} written, {_clock(elapsed)} elapsed, {eta}"
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class _Diverted(io.TextIOBase):
    """A stand-in for sys.stdout or sys.stderr that writes to `sink` while set, and to the stream it
    stands in for once the sink is gone. Libraries keep the stream they found at import (a logging
    handler does): one imported while output was hidden must not keep writing to the hidden file's
    descriptor number, which the next file opened takes over (a journal, say)."""

    def __init__(self, stream, sink):
        self._stream = stream
        self._sink = sink

    def release(self) -> None:
        self._sink.flush()
        self._sink = None

    def _target(self):
        return self._stream if self._sink is None else self._sink

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self._target().fileno()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._sink is None and self._stream.isatty()

    # TextIOBase declares encoding a plain attribute; here it is the encoding of the stream written to now.
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target(), "encoding", "utf-8")

    def __getattr__(self, name: str):
        # Whatever else a library reaches for (`buffer`, `errors`, ...), from the stream written to now.
        return getattr(self._target(), name)


@contextmanager
def foreign_output_hidden(hide: bool = True) -> Iterator[None]:
    """What SGLang, torch and HF print while a model loads (warnings, log lines, loading bars), sent to
    a temporary file instead of the terminal. It is redirected at the file-descriptor level, since part
    of it comes from C++ and from threads. If the block fails, it is printed after all: it may say why.
    """
    if not hide:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr

    with tempfile.TemporaryFile() as sink, open(sink.fileno(), "w", closefd=False) as text:
        # Python-level writes too, where sys.stdout or sys.stderr is not a file descriptor's (notebooks).
        diverted = _Diverted(streams[0], text), _Diverted(streams[1], text)

        @interrupts.held_back()
        def restore() -> None:
            for stream in (*diverted, *streams):
                stream.flush()
            for stream in diverted:
                stream.release()
            sys.stdout, sys.stderr = streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)

        for fd in saved:
            os.dup2(sink.fileno(), fd)
        sys.stdout, sys.stderr = diverted
        try:
            yield
        except Exception:
            restore()
            sink.seek(0)
            os.write(2, sink.read())
            raise
        except BaseException:  # a stop (Ctrl-C, SIGTERM): no failure the output could explain; the caller says it
            restore()
            raise
        restore()
