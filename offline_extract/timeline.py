"""When a run reached each of its phases, counted from the moment its process started, so that what a
user waits for (interpreter start-up and imports included) is on record, not only what follows them."""
from __future__ import annotations

import os
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


class Timeline:
    """Named points of a run in seconds since its process started, in the order they were reached."""

    def __init__(self) -> None:
        self._origin = time.perf_counter() - process_age()
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def mark(self, name: str) -> float:
        self.marks[name] = self.now()
        return self.marks[name]

    def between(self, first: str, then: str) -> float:
        return self.marks[then] - self.marks[first]
