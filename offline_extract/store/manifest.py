"""OUT/manifest.json: what an output directory holds (its run identity) and which shards are complete.

The identity is written when a run takes a directory over; a later run may resume there only with the
same identity (`run_differences`, `corpus_differences`), since shards of two identities would not be one
data set. Each replica logs the shards it completes, with the checksum its writer threads computed
(`store/checksum.py`), to its own journal (`.manifest.dp{r}.jsonl`, fsynced per shard); the leader
folds the journals into manifest.json at the start of a run (a crashed attempt's) and at its end. Every
manifest.json update is an atomic replace.

A shard file on disk is authoritative, since it only appears under its name once complete: one that
no journal mentions (a crash between its rename and its journal line) has its checksum recomputed
from the file, and an entry whose file is gone is dropped, so its samples are extracted again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from offline_extract.formatting import listing, plural
from offline_extract.store import checksum
from offline_extract.store.atomic import atomic_write
from offline_extract.store.index import shard_paths
from offline_extract.store.journal import load_json, read_journal, replicas_files
from offline_extract.store.lock import running
from offline_extract.store.schema import (
    FORMAT_VERSION,
    IDENTITY_KEYS,
    READABLE_FORMAT_VERSIONS,
    REJECTS_FILE,
    RunInfo,
    ShardError,
    shard_number,
)
from offline_extract.store.shard import ShardHeader, read_header

MANIFEST_NAME = "manifest.json"
# The status of a run that a check refused (the parity gate; a corpus file that breaks off; kept samples that the
# corpus does not hold): its `result` holds who refused it, the verdict, which a re-run with the same command
# gives again, and what to do instead.
REFUSED = "refused"
# The kinds of record a run leaves out (rejects.jsonl's `kind`), each counted in a complete run's result.
LEFT_OUT = ("skipped", "rejected", "dropped")
JOURNAL = ".manifest.dp{}.jsonl"  # a replica's shards completed since manifest.json was written, by its DP rank
# A corpus file is identified by its name, size, and the sha256 of this many blocks spread evenly over
# it (the whole file when that covers it): a few milliseconds at start-up for a terabyte corpus, where
# a full hash would take an hour on every resume. Appending, truncating or replacing a file changes its
# size or its first or last block; the edit it can miss is one that keeps the size and touches no
# sampled block. Path and mtime are recorded but not compared: they change when a corpus is merely
# copied or remounted, and the sample indices depend only on content and order.
SAMPLED_BLOCKS = 16
BLOCK_BYTES = 1 << 20
CORPUS_KEYS = ("name", "bytes", "sampled_sha256")


def file_fingerprint(path: str | os.PathLike) -> dict:
    """A corpus file's, or a corpus folder's (a saved or downloaded data set: every file in it, by
    relative name), identity as CORPUS_KEYS says, plus where it was. A pipe has neither size nor
    sampled sha256: reading it here would take its records from the run."""
    path = Path(path)
    st = path.stat()
    if streamed(path):
        size = sampled = None
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file())
        size = sum(f.stat().st_size for f in files)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.relative_to(path)}\0{_sampled_sha256(f)}\0".encode())
        sampled = digest.hexdigest()
    else:
        size, sampled = st.st_size, _sampled_sha256(path)
    return {
        "name": path.name,
        "bytes": size,
        "sampled_sha256": sampled,
        "path": str(path.resolve()),
        "mtime_ns": st.st_mtime_ns,
    }


def streamed(path: str | os.PathLike) -> bool:
    """Whether the corpus at `path` is a pipe (neither a file nor a folder): its records are read once, as they
    stream, and cannot be compared with those a run recorded."""
    path = Path(path)
    return path.exists() and not path.is_file() and not path.is_dir()


def _sampled_sha256(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_BLOCKS * BLOCK_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()


def run_identity(run: RunInfo, data: Sequence[str | os.PathLike]) -> dict:
    """The identity of a run from its facts and corpus files (the identity facts: `RunInfo`'s fields so marked)."""
    return identity_of(run.identity(), data)


def identity_of(facts: dict, data: Sequence[str | os.PathLike]) -> dict:
    return {**facts, "corpus": [file_fingerprint(p) for p in data]}


def run_differences(old: dict, new: dict) -> list[str]:
    """How two identities' shards differ, one line per run fact; shards that differ are never one data set.
    Where they differ, the two model paths lead when they differ too: the hashes alone do not say which is
    which (a model copied elsewhere, same hashes, is no difference)."""
    diffs = [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in IDENTITY_KEYS if old.get(key) != new.get(key)]
    if diffs and old.get("model") != new.get("model"):
        diffs.insert(0, f"model: {old.get('model')!r} -> {new.get('model')!r}")
    return diffs


def corpus_differences(old: dict, new: dict, pipes: bool = True) -> list[str]:
    """How two identities' corpus files differ, one line per file; a pipe, whose records cannot be compared,
    is one unless `pipes` is False."""
    before, after = old.get("corpus", []), new.get("corpus", [])
    diffs = [f"corpus: {len(before)} files -> {len(after)} files"] if len(before) != len(after) else []
    for i, (a, b) in enumerate(zip(before, after)):
        if a.get("sampled_sha256") is None or b.get("sampled_sha256") is None:
            if pipes:
                diffs.append(
                    f"corpus file {i + 1} ({b['path']}): a pipe, whose records cannot be compared with the "
                    f"earlier run's"
                )
            continue
        changed = [key for key in CORPUS_KEYS if a.get(key) != b.get(key)]
        if changed:
            detail = ", ".join(f"{key} {a.get(key)!r} -> {b.get(key)!r}" for key in changed)
            diffs.append(f"corpus file {i + 1} ({b['path']}): {detail}")
    return diffs


class ForeignManifest(ShardError):
    """OUT/manifest.json is not one offline_extract wrote: another tool's file, or a damaged one."""


def load(out: str | os.PathLike) -> dict | None:
    """manifest.json of `out`, or None where there is none. One that offline_extract did not write (another
    tool's, where --out named an existing folder by mistake, or a damaged one: ours is always replaced
    whole) is refused, naming it and why: nothing may build on it, merge into it or overwrite it."""
    path = Path(out) / MANIFEST_NAME
    if not path.exists():
        return None
    why: str | None
    try:
        document = load_json(path)
    except ValueError as e:  # invalid JSON, or not UTF-8 text
        why = f"it is not valid JSON ({e.__cause__})"
    else:
        why = _not_ours(document)
    if why:
        raise ForeignManifest(f"{path} is not a manifest offline_extract wrote: {why}")
    return document


def _not_ours(document) -> str | None:
    """Why `document` is not a manifest that a run wrote (`consolidate`), or None when it is: every one holds a
    format_version and its shards."""
    if not isinstance(document, dict):
        return f"it holds a JSON {type(document).__name__}, not an object"
    missing = [key for key in ("format_version", "shards") if key not in document]
    if missing:
        return f"it has no {' and no '.join(missing)} key"
    if document["format_version"] not in READABLE_FORMAT_VERSIONS:
        readable = " or ".join(map(str, READABLE_FORMAT_VERSIONS))
        return f"its format_version is {document['format_version']!r}, where this version reads {readable}"
    if not isinstance(document["shards"], dict):
        return f"its shards are a JSON {type(document['shards']).__name__}, not an object"
    return None


def unfinished(out: str | os.PathLike) -> str | None:
    """Why `out` does not hold a finished extraction's every sample and those alone, or None when it does: its
    manifest says complete, every shard it lists is there, and no other, and its counts are theirs. A directory
    without manifest.json (shards written through the library) claims nothing, so nothing is held against it."""
    out = Path(out)
    recorded = load(out)
    if recorded is None:
        return None
    refused = refusal(recorded)
    if refused:
        return f"{out} {refused}"
    if recorded.get("status") != "complete":
        # Counted from the shards: an interrupted run's journals may list more than manifest.json does.
        held = sum(len(read_header(p).samples) for p in shard_paths(out))
        writer = running(out)
        then = (
            f"An extraction is writing it now ({writer}): wait for it to end"
            if writer
            else "Re-run the extraction to finish it"
        )
        return (
            f"{out} is an unfinished extraction ({MANIFEST_NAME} status {recorded.get('status')!r}): it holds "
            f"{plural(held, 'sample')} so far; how many are missing is unknown until the run completes. {then}"
        )
    listed = recorded.get("shards", {})
    gone = [name for name in listed if not (out / name).is_file()]
    extra = unlisted(out, recorded)
    if extra:
        return (
            f"{out} holds {listing(extra)}, which its finished run's {MANIFEST_NAME} does not list: "
            f"{'no shard' if len(extra) == 1 else 'none'} of that run (a copy, or another run's). Move "
            f"{'it' if len(extra) == 1 else 'them'} out of {out}"
        )
    if gone:
        lost = sum(listed[name]["num_samples"] for name in gone)
        return (
            f"{out} is missing {', '.join(gone)}, listed in {MANIFEST_NAME}: {plural(lost, 'sample')} of the "
            f"extraction are not there. Re-run the extraction to redo them"
        )
    wrong = contradicted(out, recorded)
    if wrong:
        return (
            f"{out} is complete by its {MANIFEST_NAME}, with counts that its shards and {REJECTS_FILE} contradict "
            f"({'; '.join(wrong)}). Re-run the extraction: it reads the corpus again and records what it holds"
        )
    return None


def unlisted(out: Path, recorded: dict) -> list[str]:
    """The shards in `out` that its complete manifest `recorded` does not list: no run's that finished there, since
    a run lists every shard on disk as it finishes."""
    return [p.name for p in shard_paths(out) if p.name not in recorded.get("shards", {})]


def refusal(recorded: dict) -> str | None:
    """What a refused run's manifest says of it, in words, ending with what to do (None: the run was not
    refused)."""
    if recorded.get("status") != REFUSED:
        return None
    result = recorded.get("result") or {}
    when = "" if recorded.get("shards") else " before it extracted anything"
    return (
        f"was refused by {result.get('refused_by', 'a check')}{when} ({MANIFEST_NAME} status {REFUSED!r}); "
        f"re-running the same command gives the same verdict:\n{result.get('verdict', '')}\n"
        + result.get("advice", "Fix what the verdict names, then re-run")
    )


def read_rejects(out: str | os.PathLike) -> list[dict] | None:
    """The rows of out/rejects.jsonl, None where there is none; a damaged line is an error naming it."""
    path = Path(out) / REJECTS_FILE
    return read_journal(path) if path.is_file() else None


def counts_held(headers: Sequence[ShardHeader], rejects: list[dict] | None) -> dict:
    """The counts a complete run's manifest records, as the directory holds them: each shard's samples and tokens
    (its header) and, where rejects.jsonl was read (`rejects`), the run's result: the samples in the shards, the
    records left out by kind, and the records read, which are their sum."""
    held: dict = {"shards": {h.path.name: {"num_samples": len(h.samples), "num_tokens": h.num_tokens} for h in headers}}
    if rejects is not None:
        kinds = Counter(row.get("kind") for row in rejects)
        result = {"extracted": sum(len(h.samples) for h in headers), **{kind: kinds[kind] for kind in LEFT_OUT}}
        held["result"] = {"records": sum(result.values()), **result}
    return held


def count_differences(recorded: dict, held: dict) -> list[str]:
    """How the counts that the manifest `recorded` holds differ from those the directory holds (`counts_held`),
    one line each: a shard's, and a complete run's result."""
    listed = recorded.get("shards", {})
    found = [
        f"{MANIFEST_NAME}: {name} {key} is {listed[name].get(key)!r}, the shard holds {value}"
        for name, counts in held["shards"].items()
        if name in listed
        for key, value in counts.items()
        if listed[name].get(key) != value
    ]
    result = recorded.get("result")
    if "result" in held and recorded.get("status") == "complete" and isinstance(result, dict):
        found += [
            f"{MANIFEST_NAME}: result {key} is {result.get(key)!r}, the shards and {REJECTS_FILE} hold {value}"
            for key, value in held["result"].items()
            if result.get(key) != value
        ]
    return found


def contradicted(out: str | os.PathLike, recorded: dict) -> list[str]:
    """How the counts of the complete manifest `recorded` differ from those its shards and rejects.jsonl in `out`
    hold (`count_differences`); none where a shard it lists is missing or unreadable, or rejects.jsonl is
    damaged, which other checks name."""
    out = Path(out)
    try:
        held = counts_held([read_header(out / name) for name in recorded.get("shards", {})], read_rejects(out))
    except ValueError:  # ShardError too
        return []
    return count_differences(recorded, held)


def recount(out: str | os.PathLike, held: dict) -> None:
    """manifest.json of `out` with each shard's counts the directory holds (`counts_held`) in place of those it
    records."""
    recorded = load(out)
    if recorded is None:
        raise ShardError(f"{Path(out) / MANIFEST_NAME} is gone: its counts cannot be rebuilt")
    for name, counts in held["shards"].items():
        if name in recorded["shards"]:
            recorded["shards"][name].update(counts)
    save(out, recorded)


def save(out: str | os.PathLike, manifest: dict) -> None:
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    atomic_write(Path(out) / MANIFEST_NAME, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))


def journal_path(out: str | os.PathLike, dp_rank: int) -> Path:
    return Path(out) / JOURNAL.format(dp_rank)


def checksums(paths: Sequence[Path], entries: Sequence[dict], threads: int = 8) -> list[str]:
    """Each file's checksum, of the kind its entry records; both hashes release the GIL, so threads hash
    several files at disk speed."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(checksum.checksum, paths, entries))


def damaged_shards(out: str | os.PathLike, recorded: dict) -> list[str]:
    """One line for each shard on disk that the manifest `recorded` lists and whose file differs from its
    recorded size or checksum (e.g. a flipped byte, which only the checksum tells). Missing ones are
    `unfinished`'s business."""
    out = Path(out)
    listed = recorded.get("shards", {})
    present = [out / name for name in listed if (out / name).is_file()]
    problems = []
    for path, digest in zip(present, checksums(present, [listed[p.name] for p in present])):
        problems += differences(path, digest, listed[path.name])
    return problems


def differences(path: Path, digest: str, entry: dict, where: str = MANIFEST_NAME) -> list[str]:
    """How a shard file of checksum `digest` (of the kind `entry` records) differs from its `entry` in
    `where` (size and checksum)."""
    size = path.stat().st_size
    found = [f"{path.name}: {size} bytes, but {where} says {entry['bytes']}"] if size != entry["bytes"] else []
    key, want = checksum.recorded(entry)
    if digest != want:
        found.append(f"{path.name}: {key} {digest} differs from {where}'s {want}")
    return found


def journal_entries(out: str | os.PathLike) -> dict[str, dict]:
    """The replicas' journals by shard name: shards completed since manifest.json was last written."""
    entries = {}
    for journal in replicas_files(Path(out), JOURNAL):
        for entry in read_journal(journal):
            entries[entry.pop("name")] = entry
    return entries


def consolidate(out: str | os.PathLike, **updates) -> tuple[dict, list[str]]:
    """Folds every journal into manifest.json, reconciles it with the shard files on disk, applies
    `updates` to its top level, and saves it. Returns the manifest and notes on what was repaired."""
    out = Path(out)
    manifest = load(out) or {}
    journals = replicas_files(out, JOURNAL)
    recorded = {**manifest.get("shards", {}), **journal_entries(out)}
    notes = []
    on_disk = {p.name: p for p in shard_paths(out)}
    gone = sorted(set(recorded) - set(on_disk))
    if gone:
        notes.append(
            f"{plural(len(gone), 'shard')} listed in the manifest but gone, their samples will be redone: "
            f"{listing(gone)}"
        )
    unrecorded = sorted(set(on_disk) - set(recorded), key=lambda name: shard_number(on_disk[name]))
    for name in unrecorded:
        header = read_header(on_disk[name])
        recorded[name] = {
            checksum.KEY: checksum.file_checksum(on_disk[name]),
            "bytes": on_disk[name].stat().st_size,
            "num_samples": len(header.samples),
            "num_tokens": header.num_tokens,
        }
    if unrecorded:
        notes.append(
            f"checksummed {plural(len(unrecorded), 'complete shard')} the manifest did not list yet: "
            f"{listing(unrecorded)}"
        )
    manifest.pop("format_version", None)
    manifest.update(updates)
    manifest["shards"] = {name: recorded[name] for name in sorted(on_disk, key=lambda n: shard_number(on_disk[n]))}
    save(out, manifest)
    for journal in journals:
        journal.unlink()
    return manifest, notes
