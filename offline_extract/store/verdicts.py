"""Which shards a reader has already checked against their recorded checksums, so that the check is paid once.

The datasets (and so the exports) check every shard against the checksum that manifest.json, or a running
run's journal, records before serving a byte of it: a flipped byte in a state is otherwise served as it is.
That is one read of the whole output (docs/training.md gives its rates). The verdict is kept in
OUT/.verified.json, per shard, under what changes when the file does: its size, mtime, ctime and inode, and
the checksum it matched. A second epoch's dataset, a second process or another rank then pays one stat per
shard. What that key cannot see is damage that leaves the file's metadata alone (a failing disk's bit rot):
`inspect --verify` re-hashes every shard, always.

Where OUT cannot take the file (read-only, or not the reader's to write), every reader checks in full.
Readers that start together (the ranks of one job) take the file's lock in turn: one hashes, and the
others find its verdict.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from offline_extract.store import checksum, manifest
from offline_extract.store.schema import ShardError

VERDICTS_NAME = ".verified.json"


def damaged_shards(out: str | os.PathLike, recorded: dict, threads: int = 8) -> list[str]:
    """`manifest.damaged_shards` of the shards on disk that `recorded` (a manifest) or a running run's
    journal lists, hashing only those not already found good as they are now; those found good are kept so."""
    out = Path(out)
    listed = recorded.get("shards", {})
    entries = {**_journaled(out, recorded), **listed}
    # Taken before hashing: a file written to meanwhile no longer matches what is kept for it.
    states = {name: _state(out / name, entry) for name, entry in entries.items() if (out / name).is_file()}
    problems = []
    with _kept(out) as kept:
        todo = [out / name for name, state in states.items() if kept.get(name) != state]
        for path, digest in zip(todo, manifest.checksums(todo, [entries[p.name] for p in todo], threads)):
            where = manifest.MANIFEST_NAME if path.name in listed else "the run's journal"
            found = manifest.differences(path, digest, entries[path.name], where)
            problems += found
            if not found:
                kept[path.name] = states[path.name]
        for name in [name for name in kept if kept[name] != states.get(name)]:
            del kept[name]  # gone, changed or damaged since
    return problems


def _journaled(out: Path, recorded: dict) -> dict[str, dict]:
    """The shards an unfinished run's journals list (a finished run has folded them into its manifest)."""
    if recorded.get("status") == "complete":
        return {}
    try:
        return manifest.journal_entries(out)
    except ValueError as e:  # a line damaged before the last one: the message names the journal and the line
        raise ShardError(str(e)) from e


def _state(path: Path, entry: dict) -> dict:
    st = path.stat()
    return {
        "bytes": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "checksum": checksum.recorded(entry)[1],
    }


@contextmanager
def _kept(out: Path) -> Iterator[dict]:
    """The verdicts kept in `out`, locked against other readers, saved as the caller left them. An unreadable
    file keeps nothing (each shard is checked again); where none can be written, nothing is kept."""
    try:
        f = open(out / VERDICTS_NAME, "a+")
    except OSError:
        yield {}
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass  # a filesystem without flock: concurrent readers may both hash, which is only slower
        f.seek(0)
        try:
            kept = json.loads(f.read() or "{}")
        except ValueError:  # cut short by a crash mid-write, or damaged: nothing is taken from it
            kept = {}
        if not isinstance(kept, dict):
            kept = {}
        before = dict(kept)
        yield kept
        if kept != before:
            f.truncate(0)  # "a+" writes at the end, which is now the start
            f.write(json.dumps(kept))
            f.flush()
