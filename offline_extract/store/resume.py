"""Taking over an output directory: one run at a time, a crashed attempt's leftovers cleared, and what
is already done found, so that re-running the same command finishes the job.

Work is resumed by sample index (the record's position in the corpus): a sample in any complete shard
is done, whatever DP size or batch budget wrote it, so a run may finish on a different number of GPUs.
Everything else is redone, rejects included: a record's rejection follows from the corpus and the
identity alone, and a sample dropped for non-finite states is simply extracted and judged again. So
the earlier attempt's partial lists are discarded and the new attempt lists each record exactly once.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from offline_extract.data import images
from offline_extract.data.corpus import Reject, read_corpus
from offline_extract.formatting import listing, plural
from offline_extract.store import manifest
from offline_extract.store.atomic import final_name, temporary_name
from offline_extract.store.journal import replicas_files
from offline_extract.store.lock import LOCK_NAME, holder
from offline_extract.store.index import index_differences, not_shards, read_index, scan, shard_paths, write_index
from offline_extract.store.schema import INDEX_NAME, REJECTS_FILE, RunInfo, ShardError, is_shard_name, shard_number
from offline_extract.store.shard import read_header

REJECTS_PART = ".rejects.dp{}.jsonl"  # a replica's rejects, by its DP rank, merged into REJECTS_FILE at the end
# The files besides shards that a run writes into --out through atomic_write; a new one joins the tuple.
WRITTEN_WHOLE = (INDEX_NAME, manifest.MANIFEST_NAME, REJECTS_FILE)


def _leftovers(out: Path) -> list[Path]:
    """The files in `out` that only a live run owns: the temporaries of the files it writes there (half-written
    shards, index, manifest or merged rejects) and the replicas' reject lists. These names only: a hidden file of
    the user's in --out (a .notes.tmp, a .shard_mine.safetensors.tmp) is not ours to delete."""
    written = [p for p in out.glob(temporary_name("*")) if _ours(final_name(p.name))]
    return sorted({*written, *replicas_files(out, REJECTS_PART)})


def _ours(name: str | None) -> bool:
    return name is not None and (is_shard_name(name) or name in WRITTEN_WHOLE)


class TakeoverError(ValueError):
    """This run may not write into the output directory as it is."""


class OutputLock:
    """An exclusive flock on OUT/.lock, held by the run's leader from take-over to the end.

    The kernel drops it when the holder dies, however it dies, so a crash never leaves a stale lock.
    Other ranks of the leader's own run do not lock: they only write once the leader, reached through
    their run's own store, has taken the directory, and a second run's ranks hear from its own leader,
    who found the lock taken. The file holds the holder's pid, host and torchrun run id for the error
    a second run reports; a run that ends removes it.
    """

    def __init__(self, out: Path):
        self.path = out / LOCK_NAME
        while True:
            self._file = open(self.path, "a+")
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.seek(0)
                holder = self._file.read()
                self._file.close()
                raise TakeoverError(_in_use(out, holder)) from None
            except OSError as e:
                self._file.close()
                raise TakeoverError(_cannot_lock(self.path, e)) from e
            # A holder that ended between our open and our flock removed the file we opened: a lock on that
            # orphan would exclude no one, so lock the file now at the path instead.
            if self._holds_the_file_at_path():
                break
            self._file.close()
        self._file.truncate(0)
        self._file.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            )
        )
        self._file.flush()

    def _holds_the_file_at_path(self) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(self._file.fileno())
        return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        # Removed while still locked, so no one can lock this file after us and think they hold the directory.
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing the only descriptor drops the flock


def _in_use(out: Path, holder: str) -> str:
    return (
        f"{out} is in use by another extraction ({holder.strip() or 'unknown holder'}); two runs writing one "
        f"directory would interleave their shards. Wait for it to end, or choose another --out"
    )


def _cannot_lock(path: Path, e: OSError) -> str:
    return f"cannot lock {path} ({e}); this filesystem may not support flock"


def in_use(out: Path) -> str | None:
    """The words a run taking `out` now would be refused with because another live run holds its lock;
    None when none does. It only looks (`holder`): the dry run's check, which writes nothing."""
    try:
        record = holder(out)
    except OSError as e:
        return _cannot_lock(out / LOCK_NAME, e)
    return None if record is None else _in_use(out, record)


@dataclass(frozen=True)
class Existing:
    """What the leader found in the directory: complete shards and the first free shard number. Nothing
    in it is rewritten before the run is known to belong there (`claim`)."""

    shards: list[str]
    first_number: int
    notes: list[str]


def take_over(out: Path) -> tuple[OutputLock, Existing]:
    """The leader's side: lock the directory and clear a crashed run's leftovers (files only a live run
    owns); the manifest is left as it is until `claim`."""
    out.mkdir(parents=True, exist_ok=True)
    lock = OutputLock(out)
    try:
        left = _leftovers(out)
        for p in left:
            p.unlink()
        notes = []
        if left:
            notes.append(
                f"removed {plural(len(left), 'file')} left by an interrupted run: {listing([p.name for p in left])}"
            )
        stray = not_shards(out)
        if stray:
            notes.append(stray)
        paths = shard_paths(out)
        first = shard_number(paths[-1]) + 1 if paths else 0
        return lock, Existing([p.name for p in paths], first, notes)
    except BaseException:
        lock.release()
        raise


def finished(out: Path, known: RunInfo, data: Sequence[str | os.PathLike]) -> dict | None:
    """The manifest of `out` if it holds a complete run that this one would only repeat, else None.

    `known` is the run's facts before its model loads; what only SGLang decides (default layer ids, an
    "auto" compute dtype: None in `known`) is taken as recorded, and so are the tokenizer's hashes when
    `known` has none but names the same `tokenizer_files` as recorded. The corpus `data` must be the
    recorded one, every recorded shard still on disk at its size, and the counts recorded those of the directory.
    """
    current = _complete(out)
    if current is None or tokenizer_decides(out, known, current):
        return None
    recorded = current["identity"]
    expected = manifest.identity_of(_taken_as_recorded(known, recorded), data)
    if manifest.run_differences(recorded, expected) or manifest.corpus_differences(recorded, expected):
        return None
    for name, entry in current["shards"].items():
        if not (out / name).is_file() or (out / name).stat().st_size != entry["bytes"]:
            return None
    # Counts that the shards contradict are not the run's: a resume reads the corpus again and counts it.
    return None if manifest.contradicted(out, current) else current


def _taken_as_recorded(known: RunInfo, recorded: dict) -> dict:
    """`known`'s identity facts, those that only the engine or the tokenizer decide (None in `known`) taken as
    `recorded` has them. The quantization is the config's (config_sha256 covers it), read only as the model loads."""
    undecided = ["layer_ids", "compute_dtype", "quantization"]
    if known.tokenizer_sha256 is None:
        undecided += ["tokenizer_sha256", "chat_template_sha256", "image_processor_sha256"]
    facts = known.identity()
    facts.update({key: recorded.get(key) for key in undecided if facts[key] is None})
    return facts


def check_before_loading(
    out: Path, known: RunInfo, data: Sequence[str | os.PathLike], force: bool, other_sglang: bool = False
) -> dict:
    """`check_identity` as far as a run's facts are known before its model loads (`known`; the rest taken as
    recorded), for --dry-run into a directory holding shards: raises as the real run will once its model is loaded.
    Returns the identity checked."""
    current = manifest.load(out) or {}
    recorded = current.get("identity") or read_header(shard_paths(out)[0]).run.identity()
    identity = manifest.identity_of(_taken_as_recorded(known, recorded), data)
    check_identity(out, identity, force, other_sglang)
    return identity


def tokenizer_decides(out: Path, known: RunInfo, current: dict | None = None) -> bool:
    """Whether only the tokenizer itself can tell if `out` holds a complete run that this one would repeat:
    it does hold a complete run, and `known` has no tokenizer hashes and other `tokenizer_files` than the
    recorded ones. `current`: the manifest of `out`, when read already."""
    current = current or _complete(out)
    return (
        current is not None
        and known.tokenizer_sha256 is None
        and known.tokenizer_files != current["identity"].get("tokenizer_files")
    )


def _complete(out: Path) -> dict | None:
    """The manifest of `out` where it records a complete run and its identity."""
    current = manifest.load(out) if out.is_dir() else None
    return current if current is not None and current.get("status") == "complete" and "identity" in current else None


def settle_finished(out: Path, recorded: dict) -> list[str]:
    """The leader's side of a rerun that `finished` let through: a shard whose bytes differ from its checksum, or
    one that the manifest does not list, refuses the run, saying what to do, and an index.json that is missing or
    does not describe the shards' headers (stale, edited or damaged) is rebuilt from them (the model is not needed
    for that). Returns notes on what was rebuilt."""
    damaged = manifest.damaged_shards(out, recorded)
    if damaged:
        raise TakeoverError(
            f"{out} holds this run's finished output, but damaged:\n  "
            + "\n  ".join(damaged)
            + "\nDelete the damaged shards and re-run the same command: it extracts exactly their samples again"
        )
    extra = manifest.unlisted(out, recorded)
    if extra:
        raise TakeoverError(
            f"{out} holds this run's finished output and {listing(extra)}, which its {manifest.MANIFEST_NAME} does "
            f"not list: no shard of this run (a copy, or another run's). Move them out of {out} and re-run the same "
            f"command"
        )
    try:
        index = read_index(out)
    except ValueError:  # not JSON, or another format version: rebuilt like a missing one
        index = None
    if index is not None and not index_differences(index, *(scan(out) if shard_paths(out) else ([], [])), out):
        return []
    lock = OutputLock(out)
    try:
        write_index(out)
    finally:
        lock.release()
    return [f"rebuilt {INDEX_NAME}, which was missing or did not describe the shards"]


def to_resume(data: Sequence[str]) -> str:
    """What resumes a run of the corpus `data` (the --data entries) from the complete shards it leaves, in words: the
    same command, or where a pipe is among them, whose records cannot be compared with theirs, the same with --force."""
    pipes = [name for name in data if manifest.streamed(name)]
    if not pipes:
        return "re-running the same command resumes from them"
    return (
        f"re-running the same command with --force resumes from them: --data {listing(pipes)} "
        f"{'is a pipe' if len(pipes) == 1 else 'are pipes'}, whose records cannot be compared with theirs (right "
        f"where it gives the same records in the same order)"
    )


def check_identity(out: Path, identity: dict, force: bool, other_sglang: bool = False) -> list[str]:
    """The leader's side, once the model is loaded: refuse to mix runs, writing nothing (`claim` records
    the identity once every check has passed).

    Shards of another model, tokenizer, layers, compute dtype or length policy are refused whatever
    --force says: a directory mixing them would not be one data set. --force only
    lets a changed corpus through (e.g. records appended), where the shards stay one data set; `other_sglang`
    (--allow-other-sglang) only shards of another SGLang version (`check_sglang`). A
    directory holding no complete shard has nothing to protect and is taken over. Returns notes on what
    was let through.
    """
    current = manifest.load(out) or {}
    paths = shard_paths(out)
    if not paths:
        # Judged as a resume is: where the corpus lies, or its mtime, does not make it another run.
        recorded = current.get("identity")
        taken = recorded is not None and bool(
            manifest.run_differences(recorded, identity) or manifest.corpus_differences(recorded, identity)
        )
        notes = [f"taking over {out} from a different run: it holds no complete shard"] if taken else []
    else:
        # Without a manifest, the shards' own metadata tell which run wrote them, but not from which corpus.
        recorded = current.get("identity") or read_header(paths[0]).run.identity()
        mixed = manifest.run_differences(recorded, identity)
        if mixed:
            raise TakeoverError(
                f"{out} holds shards of a different run, so this one cannot resume there:\n  "
                + "\n  ".join(mixed)
                + "\n--force cannot mix them: the directory would not be one data set. Choose another --out, or "
                "move its shards away to start over there"
            )
        # A manifest of an earlier version records no SGLang version; its shards always did.
        then = recorded.get("sglang_version") or read_header(paths[0]).run.sglang_version
        notes = check_sglang(out, then, identity.get("sglang_version"), other_sglang)
        if "identity" in current:
            diffs = manifest.corpus_differences(current["identity"], identity)
            what = "the output of another corpus"
        else:
            diffs = [f"no {manifest.MANIFEST_NAME} records the corpus of the shards here"]
            what = "shards of this run whose corpus is not recorded"
        if diffs and not force:
            raise TakeoverError(
                f"{out} holds {what}, so this run cannot resume there:\n  "
                + "\n  ".join(diffs)
                + "\nChoose another --out, or pass --force to resume anyway (right when the corpus is the same, or "
                "records were only appended: samples are matched to records by position)"
            )
        notes += [f"--force: resuming despite {d}" for d in diffs]
    return notes


def check_sglang(out: Path, then: str | None, now: str | None, allowed: bool) -> list[str]:
    """Refuses to resume shards extracted under SGLang `then` in a run under SGLang `now` unless `allowed`: their
    states differ in the last bits, so one data set would hold two engines' rounding. A version not known (None:
    a run's before its model loads, in a library caller's RunInfo) is not compared. Returns the note of a resume
    let through."""
    if then is None or now is None or then == now:
        return []
    if allowed:
        return [f"--allow-other-sglang: resuming shards of SGLang {then} under SGLang {now}"]
    raise TakeoverError(
        f"{out} holds shards extracted under SGLang {then}, and this run has SGLang {now}: their states differ in "
        f"the last bits, so the directory would mix two engines' states. Resume under SGLang {then}, choose "
        f"another --out, or pass --allow-other-sglang to resume anyway"
    )


def claim(out: Path, identity: dict) -> list[str]:
    """The leader's side, once the run may resume in `out`: the manifest brought up to date with the shards
    on disk (a crashed attempt's journals folded in, each shard's counts its header's) and this run's identity
    recorded, status running. Returns notes on what was repaired."""
    recorded, notes = manifest.consolidate(out, identity=identity, status="running", result=None)
    held = manifest.counts_held([read_header(out / name) for name in recorded["shards"]], None)
    wrong = manifest.count_differences(recorded, held)
    if wrong:
        manifest.recount(out, held)
        notes.append(f"rebuilt the counts in {manifest.MANIFEST_NAME} that the shards contradicted: {'; '.join(wrong)}")
    return notes


def refuse(out: Path, by: str, verdict: str, advice: str) -> None:
    """The leader's side, once `by` has refused the run: the manifest says so, with the verdict and what to do
    (`advice`), so that the directory does not read as an interrupted run that a re-run would finish. Its
    complete shards are recorded, as they are."""
    result = {"refused_by": by, "verdict": verdict, "advice": advice}
    manifest.consolidate(out, status=manifest.REFUSED, result=result)


def done_mask(out: Path, shards: Sequence[str]) -> np.ndarray:
    """mask[i] is True when record i is in one of `shards`; records past the end are not done."""
    indices = []
    for name in shards:
        try:
            indices += [info.index for info in read_header(out / name).samples]
        except ShardError as e:
            raise TakeoverError(f"{e}\nMove or delete it and re-run: its samples will be extracted again") from e
    mask = np.zeros(max(indices, default=-1) + 1, dtype=bool)
    mask[indices] = True
    return mask


def check_kept(out: Path, shards: Sequence[str], done: np.ndarray, records: int) -> None:
    """The leader's side at the end of a run that kept the samples of `shards` (`done`: their records): a kept
    sample of a record past the `records` the corpus held proves that the corpus is neither the one it was
    extracted from nor that one with records appended, which --force (or a directory without its manifest) took
    it for. The run is refused, recorded so (`refuse`), where it would be marked complete with counts that its
    shards contradict, and serve those samples as records they are not."""
    past = int(done[records:].sum())
    if not past:
        return
    holding = [name for name in shards if any(info.index >= records for info in read_header(out / name).samples)]
    verdict = (
        f"{out} holds {plural(past, 'sample')} of records past the {plural(records, 'record')} its corpus holds now, "
        f"in {listing(holding)}: the corpus is neither the one they were extracted from nor that one with records "
        f"appended, so the samples kept there cannot be taken for its records"
    )
    advice = (
        f"Choose another --out, or move out of {out} every shard holding a sample_index of {records} or more "
        f"({listing(holding)}) and re-run the same command: it extracts their samples of this corpus again"
    )
    refuse(out, "its kept samples, which the corpus does not hold", verdict, advice)
    raise TakeoverError(f"{verdict}\n{advice}")


# Kept samples whose changed images a refusal names one by one; the rest are counted.
CHANGED_IMAGES_SHOWN = 5


def check_images(
    out: Path, shards: Sequence[str], identity: dict, data: Sequence[str], force: bool, finished: bool = False
) -> list[str]:
    """The leader's side, beside `check_identity`: the kept samples with images were extracted from the images
    their records name now. Each recorded its images' fingerprint (SampleInfo.images_sha256); their bytes are
    read again (not decoded) and a change refuses the run, which --force lets through (the kept samples keep the
    states of the images they had). `identity` is the run's, as `check_identity` let it through: a text-only
    model's (no image processor) took no image, so not even the shards' headers are read, and nothing is read
    where no kept sample has images. `finished`: the shards are a finished run's, which --force keeps as it is
    (nothing is extracted again). Returns notes on what was let through."""
    if identity.get("image_processor_sha256") is None:
        return []
    recorded = {
        info.index: info.images_sha256
        for name in shards
        for info in read_header(out / name).samples
        if info.images_sha256 is not None
    }
    if not recorded:
        return []
    changed = []
    for item in read_corpus(data):
        if item.index not in recorded:
            continue
        where = f"{item.source}:{item.line} (id {item.id!r})"
        if isinstance(item, Reject):
            changed.append(f"{where}: the record is rejected now ({item.reason})")
        elif not item.images:
            changed.append(f"{where}: the record names no image now")
        else:
            try:
                if images.fingerprint(item.images) != recorded[item.index]:
                    changed.append(f"{where}: its images' bytes differ from those it was extracted from")
            except images.ImageError as e:
                changed.append(f"{where}: {e}")
    if not changed:
        return []
    listed = changed[:CHANGED_IMAGES_SHOWN] + (
        [f"... and {len(changed) - CHANGED_IMAGES_SHOWN} more"] if len(changed) > CHANGED_IMAGES_SHOWN else []
    )
    if not force:
        raise TakeoverError(
            f"{out} holds samples extracted from other images than their records name now, so this run cannot "
            f"resume there ({plural(len(changed), 'kept sample')}):\n  "
            + "\n  ".join(listed)
            + "\nPut the images back as they were, choose another --out, or pass --force to resume anyway (the kept "
            "samples keep the states of the images they were extracted from)"
        )
    if finished:
        return [
            f"--force: the finished run is kept as it is despite {plural(len(changed), 'sample')} whose images changed"
        ]
    return [f"--force: resuming despite {plural(len(changed), 'kept sample')} whose images changed"]


def shard_numbers(first: int, dp_rank: int, dp_size: int) -> Iterator[int]:
    """This replica's new shard numbers: above every existing one, interleaved by dp_rank so replicas
    never collide, whatever DP size wrote the existing ones."""
    return itertools.count(first + dp_rank, dp_size)
