"""Files that appear complete or not at all, for every file the output directory holds."""

from __future__ import annotations

import os
from pathlib import Path

from offline_extract.store.journal import naming_errors


def _fsync(path: Path) -> None:
    """fsync a file, or a directory (which makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(name: str) -> str:
    """The name `atomic_write` writes `name` under before renaming it into place, beside it and hidden; given a
    glob, the glob of those temporaries."""
    return f".{name}.tmp"


def final_name(name: str) -> str | None:
    """The name that the temporary `name` is renamed to (`temporary_name`'s inverse); None where `name` is none."""
    before, _, after = temporary_name("{}").partition("{}")
    inner = name[len(before) : -len(after)]
    return inner if name.startswith(before) and name.endswith(after) and inner else None


def atomic_write(final: Path, write, *, durable: bool = True):
    """Calls write(tmp_path), makes the bytes durable, then renames into place; returns what write returned.

    Readers (and a crashed run's resume) therefore see either no file or a complete one under `final`.
    `durable=False` skips the fsyncs, for many small files that can be rewritten after a power loss: the
    rename alone still keeps a partial file from ever appearing under `final`.
    """
    tmp = final.with_name(temporary_name(final.name))
    try:
        with naming_errors(tmp):
            result = write(tmp)
            if durable:
                _fsync(tmp)
            os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync(final.parent)
    return result
