"""Records tokenized on processes of their own, beside the one that runs the forwards.

A text record's tokenization holds the GIL for much of its cost: the chat template's rendering (jinja, once for
the whole chat and once for each assistant turn's bounds), transformers' wrapping of the Rust tokenizer's
output, the lists of ids and offsets turned into arrays; so does reading the record itself (its JSON, its
checks). On a thread of the process that launches the forwards, that Python competes with the launches for the
GIL: a small model's forwards, each done in milliseconds, ran at half their rate beside it while the forwards
never waited for a batch. On processes of their own only the corpus's rows (read here, unparsed) and the samples
(made there) cross, pickled.

Each worker is `python -m offline_extract.data.tokenizer_processes`, reading pickles on its stdin (the tokenizer,
then chunks of rows) and writing one pickle of results on its stdout for each chunk, in order: not
multiprocessing's, whose spawned children run the parent's main script again (a user's script, unguarded).
A worker imports what an HF tokenizer's unpickling needs before its tokenizer arrives: started before the
parent has loaded the tokenizer, its seconds of imports pass beside the parent's own.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Sequence, TypeVar

from offline_extract.data.corpus import Row
from offline_extract.data.tokenization import SampleTokenizer, from_rows

Key = TypeVar("Key")

# Chunks in flight for each process: one being tokenized, one waiting in its pipe.
AHEAD_PER_PROCESS = 2


class _Worker:
    """One process, with a thread sending it chunks (a chunk's pickle fills the pipe: written on the caller's
    thread while the worker writes its last result, both would wait on each other)."""

    def __init__(self, env: dict):
        # A session of its own: Ctrl-C reaches every process of the terminal's group, a worker still importing
        # would print its traceback; the parent stops its workers itself (`stop`), and a parent gone ends
        # them through their stdin's end.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None, "both piped"
        self._to, self._from = self.proc.stdin, self.proc.stdout
        self._sending: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send, name="tokenizing-apart", daemon=True)
        self._sender.start()

    def _send(self) -> None:
        try:
            while (data := self._sending.get()) is not None:
                self._to.write(data)
                self._to.flush()
        except (BrokenPipeError, ValueError):  # it died, or was stopped: its reader says which
            pass
        finally:
            try:
                self._to.close()
            except OSError:
                pass

    def submit(self, data: bytes) -> None:
        self._sending.put(data)

    def result(self) -> list:
        try:
            kind, value = pickle.load(self._from)
        except (EOFError, pickle.UnpicklingError):
            raise RuntimeError(
                f"a tokenizing process (--tokenizer-processes) ended with exit status {self.proc.wait()} "
                "(killed from outside: out of memory?)"
            ) from None
        if kind == "error":
            raise value
        return value

    def stop(self) -> None:
        """Killed, not asked to end: where its results went unread (a run stopped) it waits to write one, and
        its sender to write the next chunk, and neither would end. It holds nothing to keep."""
        self.proc.kill()
        self._sending.put(None)
        self._sender.join()
        self.proc.wait()


class TokenizerProcesses:
    """`tokenization.from_rows` of each chunk of rows on `processes` processes, `AHEAD_PER_PROCESS` chunks each ahead
    of the caller, the chunks' results in their order (chunk k goes to process k mod processes). The workers
    start at once and import while the caller loads the tokenizer and then the model; they tokenize once
    `hand`ed the tokenizer (given here, at once). A text-only tokenizer's: an image chat's images are prepared on
    the tokenizer's image threads, which release the GIL themselves."""

    def __init__(self, processes: int, tokenizer: SampleTokenizer | None = None):
        if processes < 1:
            raise ValueError(f"TokenizerProcesses needs at least one process, got {processes}")
        # A bin/ script finds this package through the checkout it puts on sys.path, which a child does not get.
        here = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        self._workers = [_Worker(env) for _ in range(processes)]
        self._handed = False
        if tokenizer is not None:
            try:
                self.hand(tokenizer)
            except ValueError:
                self.close()
                raise

    def hand(self, tokenizer: SampleTokenizer) -> None:
        """The tokenizer every worker tokenizes with, once, before any chunk."""
        if self._handed:
            raise RuntimeError("the tokenizing processes were handed their tokenizer already")
        if tokenizer.processor is not None:
            raise ValueError(
                f"--tokenizer-processes {self.processes}: {tokenizer.model} prepares image chats with its HF "
                "processor, on --image-threads threads of the run's own process; give --tokenizer-processes 0"
            )
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            worker.submit(data)
        self._handed = True

    @property
    def processes(self) -> int:
        return len(self._workers)

    def many_ahead(
        self, chunks: Iterable[tuple[Key, tuple[Sequence[Row], Sequence[bool]]]]
    ) -> Iterator[tuple[Key, list]]:
        """(key, `from_rows(tokenizer, rows, wanted)`) for each (key, (rows, wanted)) of `chunks`, in order; an error
        a chunk's tokenizing raised (a configuration problem: `SampleTokenizer`) is raised here, where its results
        would have come. Once `close`d, or after an error, no more."""
        if not self._handed:
            raise RuntimeError("the tokenizing processes have no tokenizer yet: `hand` it to them first")
        keys: deque = deque()  # of the chunks in flight, the oldest first
        taken = 0
        for given, (key, work) in enumerate(chunks):
            self._workers[given % len(self._workers)].submit(pickle.dumps(work, protocol=pickle.HIGHEST_PROTOCOL))
            keys.append(key)
            if len(keys) >= AHEAD_PER_PROCESS * len(self._workers):
                yield keys.popleft(), self._workers[taken % len(self._workers)].result()
                taken += 1
        while keys:
            yield keys.popleft(), self._workers[taken % len(self._workers)].result()
            taken += 1

    def ready(self) -> None:
        """Returns once every process has started and holds the tokenizer: a bench starts its clock after their
        start-up, which a run spends beside the model's load."""
        for _ in self.many_ahead((None, ([], [])) for _ in self._workers):
            pass

    def close(self) -> None:
        """The workers stopped, chunks not yet tokenized dropped: they are only ever read ahead of a run."""
        for worker in self._workers:
            worker.stop()

    def __enter__(self) -> TokenizerProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve() -> None:
    """A worker: the tokenizer, then for each chunk of rows their ids and samples or rejects, or the error raised."""
    given, made = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # what a library prints must not land among the results
    _import_what_a_tokenizer_needs()
    try:
        tokenizer = pickle.load(given)
    except EOFError:  # the parent ended before it had a tokenizer to hand (a run stopped while starting up)
        return
    while True:
        try:
            work = pickle.load(given)
        except EOFError:  # the parent is done, or gone
            return
        out: tuple[str, list | Exception]
        try:
            rows, wanted = work
            out = ("ok", from_rows(tokenizer, rows, wanted))
        except Exception as e:
            out = ("error", e)
        try:
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an error that does not pickle, in words
            kind, value = out
            words = [(id_, _in_words(item)) for id_, item in value] if isinstance(value, list) else _in_words(value)
            data = pickle.dumps((kind, words), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            made.write(data)
            made.flush()
        except BrokenPipeError:
            return


def _import_what_a_tokenizer_needs() -> None:
    """transformers' tokenizer classes and what they import (torch among them): most of a worker's start-up,
    which an HF tokenizer's unpickling would otherwise pay once the tokenizer arrives. The tokenizer's own
    class module is left to the unpickling."""
    import transformers

    transformers.AutoTokenizer  # noqa: B018 (transformers imports its modules when first touched)
    transformers.PreTrainedTokenizerFast  # noqa: B018


def _in_words(item):
    """An exception as a RuntimeError of its type and words, which pickles whatever it held; anything else as it is."""
    return RuntimeError(f"{type(item).__name__}: {item}") if isinstance(item, Exception) else item


if __name__ == "__main__":
    _serve()
