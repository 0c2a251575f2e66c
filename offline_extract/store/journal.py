"""The output directory's JSON files: append-only JSON-lines files that several threads write and that a
crash may cut short, and whole JSON documents read back with errors that name the file.

A kill can leave the last line half written; readers drop such a line instead of failing, so a file is
always good up to its last complete record. Errors name the file: a bare "[Errno 28] No space left on
device" from a buffered write would not say which of the run's files hit it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Journal:
    def __init__(self, path: str | os.PathLike, durable: bool = False):
        """`durable` fsyncs every line, for records whose loss would cost more than the fsync."""
        self.path = Path(path)
        self.durable = durable
        self._lock = threading.Lock()
        with naming_errors(self.path):
            self._file = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock, naming_errors(self.path):
            self._file.write(line)
            self._file.flush()
            if self.durable:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock, naming_errors(self.path):
            self._file.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def replicas_files(folder: Path, template: str) -> list[Path]:
    """The files of `folder` named `template` with a replica's rank (digits) in its {}, in name order: only those,
    since the names a glob also matches (a user's `.rejects.dpnotes.jsonl`) are not a run's to read or delete."""
    before, _, after = template.partition("{}")
    name = re.compile(re.escape(before) + "[0-9]+" + re.escape(after))
    return sorted(p for p in folder.glob(template.format("*")) if name.fullmatch(p.name))


def read_journal(path: str | os.PathLike) -> list[dict]:
    """The complete records of a journal, in order; a torn last line is left out."""
    records = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                records.append(json.loads(raw))
            except ValueError:
                if raw.endswith(b"\n"):
                    raise ValueError(f"{path}: corrupt line {len(records) + 1}: {raw[:80]!r}") from None
    return records


@contextmanager
def naming_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raises an OSError that does not name its file as one that names `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def load_json(path: str | os.PathLike, advice: str = "delete or restore it"):
    """A JSON document; a missing, unreadable or damaged file (invalid JSON, or not UTF-8 text) is an error
    that names it. `advice` says what to do about a damaged one: the default fits the files we write, which a
    re-run writes again; a file of the user's own (a model's) says otherwise."""
    with naming_errors(Path(path)):
        data = Path(path).read_bytes()
    try:
        # Decoded here, not by read_text, whose UnicodeDecodeError would name no file.
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # json's error gives the line and column; the decoder's, the byte that is not UTF-8
        raise ValueError(f"{path} is not valid JSON ({e}): {advice}") from e
