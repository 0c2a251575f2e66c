"""Where the host's cores went while the forwards ran: each thread's seconds on a core and waiting in the
kernel's run queue for one, the same for the processes this one started (the tokenizing ones), and the garbage
collector's pauses.

A small model's forwards are bound by the host: whatever slows the thread that launches them slows the run.
Its time outside the forwards' own work is spent on a core (Python, launches), queued for a core that other
threads or processes hold, or asleep (the GIL, a wait for the GPU or for the next batch). Linux counts the
first two for every thread (/proc/self/task/TID/schedstat); the collector's pauses hold the GIL against every
thread. Elsewhere only the collector's pauses are reported.

A thread gone by the report has taken its counts with it: a thread of ours that ends inside the span (the
batches made ahead, the offload's drain) says `ending()` last, which keeps them.
"""

from __future__ import annotations

import gc
import itertools
import os
import re
import threading
import time

_TASKS = "/proc/self/task"
# The thread the forwards run on, whichever its Python name.
FORWARDS = "forwards"
# Threads Python did not start (torch's, CUDA's): by the kernel's name for them.
_NATIVE = "native {}"


def _schedstat(tid: int | str, tasks: str | None = None) -> tuple[float, float] | None:
    """A thread's (seconds on a core, seconds queued for one) since it started, of this process or the one
    whose `tasks` folder is given; None once it has ended."""
    try:
        with open(f"{tasks or _TASKS}/{tid}/schedstat") as f:
            on_core, queued, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_core) / 1e9, int(queued) / 1e9


def _comm(tid: int) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended between the listing and this
        return "(ended)"


# Each thread that said `ending()`, by its native id: when it said it (in `_order`), its Python name and last
# counts. A span takes those said since it began: a native id comes back for a later thread.
_ended: dict[int, tuple[int, str, tuple[float, float]]] = {}
_ended_lock = threading.Lock()
_order = itertools.count()


def ending() -> None:
    """Called last on a thread about to end: its counts so far are kept for the report it would miss."""
    tid = threading.get_native_id()
    stat = _schedstat(tid)
    if stat is not None:
        with _ended_lock:
            _ended[tid] = (next(_order), threading.current_thread().name, stat)


def _children() -> dict[int, str]:
    """The processes this one started and that still run, each by the module it runs (`-m`), else its name."""
    found: dict[int, str] = {}
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/children") as f:
                pids = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            module = args[args.index("-m") + 1] if "-m" in args[:-1] else None
            found[pid] = module.rsplit(".", 1)[-1] if module else os.path.basename(args[0])
    return found


def _process(pid: int) -> tuple[float, float]:
    """A process's counts, all its threads'."""
    on_core = queued = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tids:
        if (stat := _schedstat(tid, f"/proc/{pid}/task")) is not None:
            on_core += stat[0]
            queued += stat[1]
    return on_core, queued


def _group(name: str) -> str:
    """A pool's threads under one name: `shard-writer_3` is a `shard-writer`."""
    return re.sub(r"_\d+$", "", name)


class HostUse:
    """Counts from its making to `report`, made and read on the thread that runs the forwards."""

    def __init__(self):
        self._forwards = threading.get_native_id()
        self._wall = time.perf_counter()
        self._start = self._threads()
        with _ended_lock:
            self._since = next(_order)
        self._start_processes = self._processes()
        self.gc_s = 0.0
        self.gc_longest_s = 0.0
        self.collections = 0
        self._gc_since: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_since = time.perf_counter()
        elif self._gc_since is not None:
            pause = time.perf_counter() - self._gc_since
            self.gc_s += pause
            self.gc_longest_s = max(self.gc_longest_s, pause)
            self.collections += 1
            self._gc_since = None

    def _threads(self) -> dict[int, tuple[float, float]]:
        if not os.path.isdir(_TASKS):
            return {}
        return {tid: stat for tid in map(int, os.listdir(_TASKS)) if (stat := _schedstat(tid)) is not None}

    def _processes(self) -> dict[int, tuple[str, tuple[float, float]]]:
        if not os.path.isdir(_TASKS):
            return {}
        return {pid: (name, _process(pid)) for pid, name in _children().items()}

    def report(self) -> dict:
        """`host_s`, the seconds counted; `gc_*`, the collector's pauses; and per thread, or pool of threads
        (`threads` of them), `cpu_s` on a core and `queued_s` waiting for one, the forwards' own thread as
        `FORWARDS`; the same for the processes started here (`processes` of them, as `process NAME`). A thread
        that ended before this without saying `ending()` lost its seconds, as did a process."""
        gc.callbacks.remove(self._on_gc)
        end = self._threads()
        names = {t.native_id: t.name for t in threading.enumerate()}
        with _ended_lock:
            for tid, (said, name, stat) in list(_ended.items()):
                if said < self._since:  # of no span from here on
                    del _ended[tid]
                elif tid not in end:
                    end[tid] = stat
                    names[tid] = name
        threads: dict[str, dict] = {}

        def count(name: str, now: tuple[float, float], was: tuple[float, float], unit: str) -> None:
            row = threads.setdefault(name, {"cpu_s": 0.0, "queued_s": 0.0, unit: 0})
            row["cpu_s"] += now[0] - was[0]
            row["queued_s"] += now[1] - was[1]
            row[unit] += 1

        for tid, stat in end.items():
            if tid == self._forwards:
                name = FORWARDS
            else:
                name = _group(names[tid]) if tid in names else _NATIVE.format(_comm(tid))
            count(name, stat, self._start.get(tid, (0.0, 0.0)), "threads")
        for pid, (name, stat) in self._processes().items():
            was = self._start_processes.get(pid, (name, (0.0, 0.0)))[1]
            count(f"process {name}", stat, was, "processes")
        # Threads that did next to nothing (a pool's idle ones, the libraries' sleeping ones) are left out.
        rounded = {
            name: {k: round(v, 4) for k, v in row.items()}
            for name, row in threads.items()
            if name == FORWARDS or row["cpu_s"] + row["queued_s"] >= 0.001
        }
        return {
            "host_s": round(time.perf_counter() - self._wall, 4),
            "gc_s": round(self.gc_s, 4),
            "gc_longest_s": round(self.gc_longest_s, 4),
            "gc_collections": self.collections,
            "threads": dict(sorted(rounded.items(), key=lambda kv: -kv[1]["cpu_s"])),
        }


def host_use_line(use: dict) -> str:
    """`HostUse.report` in two lines: the forwards' thread, then the busiest others and the collector."""
    threads = use["threads"]
    lines = []
    if FORWARDS in threads:
        own = threads[FORWARDS]
        asleep = use["host_s"] - own["cpu_s"] - own["queued_s"]
        lines.append(
            f"the forwards' thread in {use['host_s']:.2f} s: {own['cpu_s']:.2f} s on a core, {own['queued_s']:.2f} s "
            f"queued for one, {asleep:.2f} s asleep (the GIL, the GPU, the next batch)"
        )
    others = [(name, row) for name, row in threads.items() if name != FORWARDS][:3]
    beside = ", ".join(f"{name} {row['cpu_s']:.2f} s" for name, row in others)
    collector = (
        f"garbage collection {use['gc_s']:.2f} s in {use['gc_collections']} (longest {use['gc_longest_s']:.3f} s)"
    )
    lines.append(f"beside it on a core: {beside}; {collector}" if others else collector)
    return "\n".join(lines)
