"""When a run reached each of its phases, counted from the moment its process started, so that what a
user waits for (interpreter start-up and imports included) is on record, not only what follows them."""
from __future__ import annotations

import os
import threading
import time


def process_age() -> float:
    """Seconds since this process started, from the kernel's record of its start (to 1/100 s); 0.0 where
    /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


# perf_counter's reading at the moment the process started (process_age: to 1/100 s).
_ORIGIN = time.perf_counter() - process_age()

# Points reached before any Timeline existed (mark_process), which every Timeline of the process starts with.
_PROCESS_MARKS: dict[str, float] = {}


def mark_process(name: str) -> None:
    """Records a point of the process's own start-up (a command's imports), before the run's Timeline
    exists; every Timeline made afterwards holds it."""
    _PROCESS_MARKS[name] = time.perf_counter() - _ORIGIN


class Timeline:
    """Named points of a run in seconds since its process started, in the order they were reached (a
    point may be marked from another thread)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = dict(_PROCESS_MARKS)
        self._lock = threading.Lock()  # points marked from two threads stay in the order they were reached

    def now(self) -> float:
        return time.perf_counter() - _ORIGIN

    def mark(self, name: str) -> float:
        """Records `name` as reached now; marked again, it moves to now (and to the end of the order)."""
        with self._lock:
            self.marks.pop(name, None)
            self.marks[name] = now = self.now()
        return now

    def between(self, first: str, then: str) -> float:
        return self.marks[then] - self.marks[first]
