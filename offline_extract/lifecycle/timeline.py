"""When a run reached each of its phases, counted from the moment its interpreter started, so that what a
user waits for (interpreter start-up and imports included) is on record, not only what follows them.

The package's first import (`offline_extract/__init__.py`, before anything else of ours runs) fixes that
moment."""

from __future__ import annotations

import threading
import time

from offline_extract.lifecycle import interrupts


def interpreter_age() -> float:
    """Seconds since this process began to run its program, for a caller that has run nothing that waits yet
    (the package's first import).

    The kernel's start time of the process (/proc/self/stat) is not it: that is the fork, and a shell runs
    its last command in its own process (`bash -c 'pip install . && python bin/extract.py'` execs python in
    the shell's process), so it would count the install. Before our first line the interpreter runs, waits
    for a CPU or reads its own files, while that shell slept waiting for its children: the task's time on a
    CPU and in the run queue (/proc/self/schedstat, in ns) is the interpreter's start-up (less any reads
    from a cold disk), with the shell's own few milliseconds. Where the kernel keeps no such record, the
    process's CPU time stands in (low on a busy machine, but never the install's minutes)."""
    try:
        with open("/proc/self/schedstat") as f:
            on_cpu, queued = (int(x) for x in f.read().split()[:2])
        return (on_cpu + queued) / 1e9
    except (OSError, ValueError):
        return time.process_time()


# perf_counter's reading at the moment the interpreter started.
_ORIGIN = time.perf_counter() - interpreter_age()

# Points reached before any Timeline existed (mark_process), which every Timeline of the process starts with.
_PROCESS_MARKS: dict[str, float] = {}


def mark_process(name: str) -> None:
    """Records a point of the process's own start-up (a command's imports), before the run's Timeline
    exists; every Timeline made afterwards holds it."""
    _PROCESS_MARKS[name] = time.perf_counter() - _ORIGIN


class Timeline:
    """Named points of a run in seconds since its interpreter started, in the order they were reached (a
    point may be marked from another thread)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = dict(_PROCESS_MARKS)
        self._lock = threading.Lock()  # points marked from two threads stay in the order they were reached

    def now(self) -> float:
        return time.perf_counter() - _ORIGIN

    def mark(self, name: str) -> float:
        """Records `name` as reached now; marked again, it moves to now (and to the end of the order).

        A run's every phase and batch is marked, which makes each mark a safe point to stop at
        (`interrupts.check`): a Ctrl-C that a library swallowed is taken here."""
        interrupts.check()
        with self._lock:
            self.marks.pop(name, None)
            self.marks[name] = now = self.now()
        return now

    def between(self, first: str, then: str) -> float:
        return self.marks[then] - self.marks[first]
