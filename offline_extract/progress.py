"""Progress display for long runs: samples, tokens/s, bytes written and ETA, drawn with rich."""
from __future__ import annotations

import threading
import time
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def plural(n: int, noun: str) -> str:
    """'1 shard', '3 shards': counts in messages are often 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


class RunProgress:
    """One bar per process; only the process that shows it draws (others pass enabled=False).

    The total comes from `count_total`, run on a background thread: counting a terabyte corpus's lines
    takes minutes, and extraction need not wait for it (the bar shows no ETA until then).
    """

    def __init__(self, count_total: Callable[[], int] | None, label: str, enabled: bool = True):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.tokens = 0
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples  {task.fields[rate]} tok/s  {task.fields[written]} written"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task(label, total=None, rate="0", written="0 B")
        if enabled and count_total is not None:
            threading.Thread(target=lambda: self._progress.update(self._task, total=count_total()), daemon=True).start()

    def __enter__(self) -> "RunProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def advance(self, samples: int, tokens: int, bytes_written: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self._progress.update(
            self._task, advance=samples, rate=f"{rate:,.0f}", written=human_bytes(bytes_written)
        )
