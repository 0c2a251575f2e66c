"""OUT/.lock as the directory's readers see it: whether a live run holds it, and who (the pid, host and
torchrun run id the holder wrote there). Taking the lock is `resume.OutputLock`'s."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK_NAME = ".lock"


def holder(out: str | os.PathLike) -> str | None:
    """What the live run holding `out`'s lock wrote in it; None when none holds it (no lock file, or one
    that a killed run left unheld). Raises OSError where the filesystem cannot flock. It only looks: its
    shared lock, held for the look, would turn away a run that tried to take the directory in that same
    instant, naming the last holder."""
    try:
        f = open(Path(out) / LOCK_NAME)
    except OSError:  # none, or unreadable: a run taking the directory names the latter itself
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read()
    return None


def described(record: str) -> str:
    """A holder's record in words: "pid 4242 on gpu-3, since 2026-12-01 21:40:00"."""
    try:
        facts = json.loads(record)
    except ValueError:
        facts = None
    if not isinstance(facts, dict) or "pid" not in facts:
        return record.strip() or "its holder unrecorded"
    words = f"pid {facts['pid']}" + (f" on {facts['host']}" if facts.get("host") else "")
    if facts.get("run_id"):
        words += f", torchrun run {facts['run_id']}"
    return words + (f", since {facts['since']}" if facts.get("since") else "")


def running(out: str | os.PathLike) -> str | None:
    """The live run writing `out` now, in words (`described`); None when none holds its lock, or where the
    filesystem cannot tell (no flock)."""
    try:
        record = holder(out)
    except OSError:
        return None
    return None if record is None else described(record)
