"""Ctrl-C, taken where the process can stop cleanly.

A command runs inside `guard`. Until a run has anything of its own to clean up (`at_once`), and where
the command runs as the program, Ctrl-C ends the process at once with one line: nothing has been written,
so nothing is lost, and no exception lands in code that cannot take one. What little a run has to undo by
then (its lock on --out, the empty --out it made) is undone on the way (`undo_at_once`). That holds through
SGLang's import and model load, which take seconds, so that Ctrl-C is never kept waiting for them. From
`clean_up_from_here` on (an extraction about to write into its --out) it is a KeyboardInterrupt, so that
the run drops its unfinished shard, keeps its journals and releases its lock on the way out. It is raised:

- not while the main thread imports a module (nor inside `held_back`), but as soon as the import
  returns (a timer looks again every POLL_S): raised inside an import it leaves torch, numpy or SGLang half-imported, so that their
  next import fails with a traceback of its own, or a library's `except:` around an optional import
  swallows it and the run goes on as if nothing had been asked;
- again at every safe point once asked for (`check`: each phase of a run, each batch), in case a library
  swallowed it all the same;

and an error raised after Ctrl-C, or a command that returns all the same, ends as the stop (`as_stop`):
it is the stop's doing, not a fault of its own.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

# The shell's status for a command stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED = 128 + signal.SIGINT
STOPPED = "stopped (Ctrl-C)"
POLL_S = 0.05
_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


class _State:
    def __init__(self, exits_at_once: bool = False) -> None:
        self.requested = False  # Ctrl-C came, during this command
        self.unraised = False  # ... and its KeyboardInterrupt is still to be raised
        self.failure = False  # a thread asks the main thread to stop (`interrupt_main`), not the user
        self.exits_at_once = exits_at_once  # the command runs as the program: it may end the process itself
        self.at_once: str | None = None  # the line to end the process with, while nothing needs cleaning up
        self.undo: list[Callable[[], None]] = []  # what a stop at once undoes first (`undo_at_once`)
        self.terminal: int | None = None  # the stderr the command started with, duplicated (`guard`)
        self.holding = 0  # `held_back` sections the main thread is in


_state = _State()


def _on_sigint(signum, frame) -> None:
    _state.requested = _state.unraised = True
    _deliver(frame)


def _on_alarm(signum, frame) -> None:
    _deliver(frame)


def _deliver(frame) -> None:
    if not (_state.unraised or _state.failure):
        return
    if _state.holding:
        signal.setitimer(signal.ITIMER_REAL, POLL_S)
        return
    if _state.unraised and _state.at_once is not None and _state.exits_at_once:
        _exit_at_once(_state.at_once)
    if _importing(frame):
        signal.setitimer(signal.ITIMER_REAL, POLL_S)
        return
    _state.unraised = _state.failure = False
    raise KeyboardInterrupt


def _exit_at_once(line: str) -> None:
    for step in reversed(_state.undo):
        try:
            step()
        except OSError:  # what it leaves is named by the line, or harmless (a lock file the kernel unlocked)
            pass
    # To the terminal the command started with: the model's load may have diverted fd 2 to hide its libraries' output.
    os.write(2 if _state.terminal is None else _state.terminal, (line + "\n").encode())
    os._exit(INTERRUPTED)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


@contextmanager
def guard(exits_at_once: bool) -> Iterator[None]:
    """Ctrl-C as this module says, for what runs inside (on the main thread: signal handlers are its own);
    the handlers found are put back on the way out. `exits_at_once`: the command runs as the program,
    whose process it may end (never a test's or a caller's)."""
    global _state
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state = _State(exits_at_once)
    if exits_at_once:
        _state.terminal = os.dup(2)
    found = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGALRM)}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in found.items():
            signal.signal(number, handler)
        if _state.terminal is not None:
            os.close(_state.terminal)
        _state = _State()


@contextmanager
def held_back() -> Iterator[None]:
    """Ctrl-C waits until the block is done, as it does for an import: a step that must not be left half
    done (a lock taken but not yet held by the run that releases it, the terminal given back to the
    process's own output)."""
    _state.holding += 1
    try:
        yield
    finally:
        _state.holding -= 1


def at_once(line: str) -> None:
    """Until `clean_up_from_here`: nothing of this command needs cleaning up beyond its `undo_at_once` steps, and
    Ctrl-C ends the process at once, printing `line` (where the command runs as the program), even inside an
    import."""
    _state.at_once = line


def undo_at_once(step: Callable[[], None]) -> None:
    """Until `clean_up_from_here`, a stop at once runs `step` before its line, the steps last given first: a
    lock released, an empty directory removed. It runs in the signal handler, between any two bytecodes of
    the main thread, so it must be quick, import nothing (the import it interrupts may hold a module's lock)
    and take no lock; an OSError it raises is passed over."""
    _state.undo.append(step)


def clean_up_from_here() -> None:
    """The run is about to write: from here Ctrl-C is a KeyboardInterrupt, for its cleanup to run."""
    _state.at_once = None
    _state.undo.clear()


def requested() -> bool:
    return _state.requested


def check() -> None:
    """A safe point: raises KeyboardInterrupt (on the main thread) once Ctrl-C came."""
    if _state.requested and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt


@contextmanager
def as_stop(*kept: type[Exception]) -> Iterator[None]:
    """Once Ctrl-C came, what runs inside ends in KeyboardInterrupt: an error it raises then (a library's
    own, after the interrupt reached it half-way), or its return all the same. Errors of the kinds `kept`
    pass as they are (the stop's own report, say)."""
    try:
        yield
    except kept:
        raise
    except Exception:
        if _state.requested:
            raise KeyboardInterrupt from None
        raise
    check()


def guarded() -> bool:
    """Whether this thread may ask the main thread to stop (`interrupt_main`): a guard is installed."""
    return signal.getsignal(signal.SIGALRM) is _on_alarm


def interrupt_main() -> None:
    """From another thread: a KeyboardInterrupt in the main thread as soon as it may take one, as for
    Ctrl-C, though no stop was asked for (a thread beside the model load failed). `withdraw` takes it back."""
    _state.failure = True
    main = threading.main_thread().ident
    assert main is not None, "the main thread runs"
    signal.pthread_kill(main, signal.SIGALRM)


def withdraw() -> None:
    """An `interrupt_main` not raised yet is not raised."""
    _state.failure = False
