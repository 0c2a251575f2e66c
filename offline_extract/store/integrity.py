"""`inspect --verify`: an output directory checked against its manifest, its index and itself.

Every problem is reported, not only the first, so that a damaged directory is mended in one pass:
delete the shards named as damaged, and re-running the extraction redoes exactly their samples.
An interrupted run is not damage: its complete shards that manifest.json does not list yet (their
checksums sit in the run's journals, or were never logged when the kill came right after a rename)
and its index.json (written when a run completes) are reported apart, as what a re-run finishes.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from offline_extract.store import manifest
from offline_extract.store.index import index_run, not_shards, read_index, shard_paths
from offline_extract.store.lock import running
from offline_extract.store.schema import (
    FRAMES_SUFFIX,
    IDENTITY_KEYS,
    INDEX_NAME,
    SPECS,
    Encoding,
    ShardError,
)
from offline_extract.formatting import listing, plural
from offline_extract.store.shard import ShardHeader, read_header


@dataclass
class Verification:
    shards: int
    samples: int = 0
    problems: list[str] = field(default_factory=list)  # damage or inconsistency, each line naming what
    damaged: list[str] = field(default_factory=list)  # the shard files among them: delete these and re-run
    # Shards of no part of the run (another's samples again, or not listed by its complete manifest): move these out
    strays: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # an interrupted run's state: a re-run finishes it
    manifest: bool = True  # whether manifest.json was there: without it a re-run needs --force
    running: str | None = None  # the live run writing the directory now, in words (`lock.running`)
    refused: str | None = None  # a run refused before extracting (manifest.refusal): a re-run refuses it again
    ignored: str | None = None  # the files named like shards but not as one, which nothing reads (`not_shards`)

    def stray(self, name: str) -> None:
        if name not in self.strays:
            self.strays.append(name)

    def damage(self, name: str, problems: list[str]) -> None:
        self.problems += problems
        if problems and name not in self.damaged:
            self.damaged.append(name)


def verify(out: str | os.PathLike, threads: int = 8) -> Verification:
    out = Path(out)
    paths = shard_paths(out)
    report = Verification(len(paths), running=running(out), ignored=not_shards(out))
    recorded = manifest.load(out)
    unrecorded: dict[str, str] = {}
    if recorded is None:
        report.manifest = False
        report.problems.append(f"no {manifest.MANIFEST_NAME}: shard checksums cannot be checked")
    else:
        _check_checksums(out, paths, recorded, threads, report, unrecorded)

    headers: dict[str, ShardHeader] = {}
    for path in paths:
        header, found = _check_shard(path, recorded)
        report.damage(path.name, found)
        if header is not None:
            headers[path.name] = header
    listed = set((recorded or {}).get("shards", {}))
    _check_repeats(headers, listed, report)
    if recorded is not None:
        # The run's result over some of the shards alone would add a false problem to the one that names the others.
        whole = len(headers) == len(paths) and set(headers) == listed
        report.problems += _count_differences(out, recorded, list(headers.values()), whole)
    # One line per way of checking, not per shard: a killed run may leave hundreds of them.
    by_how: dict[str, list[str]] = {}
    for name, how in unrecorded.items():
        if name not in report.damaged:
            by_how.setdefault(how, []).append(name)
    why = "the run is still writing" if report.running else "the run stopped"
    report.unfinished += [
        f"{plural(len(names), 'shard')} complete, not yet recorded in {manifest.MANIFEST_NAME} because {why} "
        f"({how}): {listing(names)}"
        for how, names in by_how.items()
    ]
    stale = _check_index(out, [p.name for p in paths], headers)
    if report.unfinished and stale:
        report.unfinished.append(f"{INDEX_NAME} does not describe the shards yet: a run writes it when it completes")
    elif not report.refused:  # a refused run writes no index, and its refusal says why
        report.problems += stale
    return report


def _check_repeats(headers: dict[str, ShardHeader], listed: set[str], report: Verification) -> None:
    """One problem for each pair of shards that hold samples of the same records, and of each pair the shard to
    move out (`Verification.strays`): the one manifest.json does not list (a copy under a new number), else the
    later. Counts the samples held once."""
    seen: dict[int, str] = {}
    shared: dict[tuple[str, str], list[int]] = {}
    for name, header in headers.items():
        for info in header.samples:
            first = seen.setdefault(info.index, name)
            if first != name:
                shared.setdefault((first, name), []).append(info.index)
    report.samples = len(seen)
    for (first, later), indices in shared.items():
        extra = first if first not in listed and later in listed else later
        report.problems.append(
            f"{later} holds {plural(len(indices), 'sample')} that {first} holds too (sample_index "
            f"{listing([str(i) for i in indices])})"
        )
        report.stray(extra)


def _count_differences(out: Path, recorded: dict, headers: list[ShardHeader], whole: bool) -> list[str]:
    """How the counts manifest.json records differ from what the shards `headers` and rejects.jsonl hold; the run's
    result only where `headers` are all the shards it lists."""
    try:
        rejects = manifest.read_rejects(out) if whole else None
    except ValueError as e:  # a damaged line: named, and the counts it would give are not checked
        return [str(e)]
    return manifest.count_differences(recorded, manifest.counts_held(headers, rejects))


def _check_checksums(
    out: Path, paths: list[Path], recorded: dict, threads: int, report: Verification, unrecorded: dict[str, str]
) -> None:
    """Checks each shard against the checksum manifest.json or a journal records; fills `unrecorded` with
    an interrupted run's shards that manifest.json does not list yet, and how each was checked."""
    status = recorded.get("status")
    report.refused = manifest.refusal(recorded)
    if status not in ("complete", manifest.REFUSED):
        report.unfinished.append(f"the run has not finished ({manifest.MANIFEST_NAME} status {status!r})")
    listed = recorded.get("shards", {})
    logged = manifest.journal_entries(out)
    on_disk = {p.name for p in paths}
    report.problems += [
        f"{name}: listed in {manifest.MANIFEST_NAME} but missing (re-running the extraction redoes its samples)"
        for name in listed
        if name not in on_disk
    ]
    unlogged = (
        "its journal line not written yet" if report.running else "written just before the stop; a re-run checksums it"
    )
    for path in paths:
        if path.name in listed:
            continue
        if status == "complete":
            report.problems.append(f"{path.name}: not listed in {manifest.MANIFEST_NAME}, so no shard of its run")
            report.stray(path.name)
        else:
            unrecorded[path.name] = "checked against the run's journal" if path.name in logged else unlogged
    found = {p: listed.get(p.name) or logged.get(p.name) for p in paths}
    entries = {p: entry for p, entry in found.items() if entry is not None}
    checked = list(entries)
    for path, digest in zip(checked, manifest.checksums(checked, list(entries.values()), threads)):
        where = manifest.MANIFEST_NAME if path.name in listed else "the run's journal"
        report.damage(path.name, manifest.differences(path, digest, entries[path], where))


def _check_shard(path: Path, recorded: dict | None) -> tuple[ShardHeader | None, list[str]]:
    """The shard's header (None when unreadable) and what is wrong inside it."""
    try:
        header = read_header(path)
        with safe_open(path, framework="pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
            offsets = f.get_tensor("offsets").tolist()
            sample_index = f.get_tensor("sample_index").tolist()
            encoded = _check_encoding(path.name, f, header.encoding, offsets, dtypes)
            if header.encoding.image_mask and dtypes.get("image_mask") == SPECS["image_mask"].safetensors_dtype:
                encoded += _check_image_mask(path.name, f.get_tensor("image_mask"), f.get_tensor("loss_mask"))
    except ShardError as e:
        return None, [str(e)]
    name, shapes, run = path.name, header.shapes, header.run
    tensors = header.encoding.tensors
    problems = [
        f"{name}: {t.name} is {dtypes.get(t.name)}, expected {t.safetensors_dtype}"
        for t in tensors
        if dtypes.get(t.name) != t.safetensors_dtype
    ] + encoded
    tokens, n = header.num_tokens, len(header.samples)
    for t in tensors:
        shape, found = t.shape(tokens, n, run.num_aux_layers, run.hidden_size), shapes[t.name]
        if len(found) != len(shape) or any(w is not None and w != s for w, s in zip(shape, found)):
            problems.append(f"{name}: {t.name} has shape {list(found)}, expected {list(shape)}")
    if offsets[:1] != [0] or offsets[-1:] != [tokens] or any(a > b for a, b in zip(offsets, offsets[1:])):
        problems.append(f"{name}: offsets do not rise from 0 to its {tokens} tokens")
    if sample_index != [s.index for s in header.samples]:
        problems.append(f"{name}: sample_index disagrees with the samples in its metadata")
    identity, facts = (recorded or {}).get("identity", {}), run.identity()
    for key in IDENTITY_KEYS:
        if key in identity and facts[key] != identity[key]:
            problems.append(f"{name}: run {key} {facts[key]!r} differs from the manifest's {identity[key]!r}")
    return header, problems


def _check_image_mask(name: str, image_mask: torch.Tensor, loss_mask: torch.Tensor) -> list[str]:
    """image_mask is 0/1, and no image token is in the loss (the drafter predicts text, never an image)."""
    if image_mask.shape != loss_mask.shape:
        return []  # the shapes' own check names it
    if (image_mask > 1).any():
        return [f"{name}: image_mask holds {int((image_mask > 1).sum())} values other than 0 and 1"]
    both = int(((image_mask == 1) & (loss_mask != 0)).sum())
    return [f"{name}: {both} image tokens are in the loss (loss_mask 1 where image_mask is 1)"] if both else []


def _check_encoding(name: str, f, encoding: Encoding, offsets: list[int], dtypes: dict) -> list[str]:
    """Scales finite and positive (a block scale may be zero); compressed frames covering the byte stream, each
    holding its sample's bytes (read from the frame headers, without decompressing)."""
    problems = []
    for t in encoding.staged:
        scale = encoding.scales.get(t.name)
        if scale is not None and t.name not in encoding.compressed and dtypes.get(t.name) == t.safetensors_dtype:
            problems += _check_scales(name, t.name, f.get_tensor(t.name), scale.zero_taken, offsets)
    for state in encoding.compressed:
        frames = f.get_tensor(state + FRAMES_SUFFIX).tolist()
        blob = f.get_slice(state)
        size = blob.get_shape()[0]
        if frames[:1] != [0] or frames[-1:] != [size] or any(a > b for a, b in zip(frames, frames[1:])):
            problems.append(f"{name}: {state}{FRAMES_SUFFIX} do not rise from 0 to its {size} bytes")
            continue
        itemsize = next(t.dtype.itemsize for t in encoding.staged if t.name == state)
        for i, (a, b) in enumerate(zip(frames, frames[1:])):
            rows = offsets[i + 1] - offsets[i] if i + 1 < len(offsets) else -1
            codec = encoding.frame_codec
            content = codec.content_size(blob[a : min(b, a + codec.header_bytes)].numpy().tobytes())
            if content < 0 or content % max(rows * itemsize, 1) or (rows == 0) != (content == 0):
                problems.append(f"{name}: {state} frame of sample position {i} does not hold its {rows} rows")
    return problems


def _check_scales(name: str, tensor: str, scales: torch.Tensor, zero_taken: bool, offsets: list[int]) -> list[str]:
    values = scales.float()
    bad = ~(torch.isfinite(values) & ((values >= 0) if zero_taken else (values > 0)))
    if not bad.any():
        return []
    rows = bad.any(dim=-1).nonzero().flatten()
    samples = sorted({bisect.bisect_right(offsets, int(r)) - 1 for r in rows})
    return [
        f"{name}: {int(bad.sum())} {tensor} values are not finite and {'non-negative' if zero_taken else 'positive'}, "
        f"in samples at positions {samples[:10]}{' ...' if len(samples) > 10 else ''} (non-finite states, e.g. kept "
        f"under --nonfinite keep, or damage)"
    ]


def _check_index(out: Path, names: list[str], headers: dict[str, ShardHeader]) -> list[str]:
    try:
        index = read_index(out)
    except ShardError as e:
        return [str(e)]
    if index is None:
        return [f"no {INDEX_NAME}"]
    listed = [s["file"] for s in index["shards"]]
    problems = [f"{INDEX_NAME} lists {f}, which does not exist" for f in listed if f not in names]
    problems += [f"{INDEX_NAME} does not list {f}" for f in names if f not in listed]
    for entry in index["shards"]:
        header = headers.get(entry["file"])
        if header is None:
            continue
        facts = {
            "num_samples": len(header.samples),
            "num_tokens": header.num_tokens,
            "bytes": header.path.stat().st_size,
        }
        for key, value in facts.items():
            if entry.get(key) != value:
                problems.append(f"{INDEX_NAME}: {entry['file']} {key} is {entry.get(key)}, the shard has {value}")
    samples = index["samples"]
    for sid, shard, row, sample_index in zip(samples["id"], samples["shard"], samples["row"], samples["index"]):
        known = 0 <= shard < len(listed)
        if known and listed[shard] not in headers:
            continue  # a missing or unreadable shard, reported once above rather than once per sample
        info = headers[listed[shard]].samples[row] if known and 0 <= row < len(headers[listed[shard]].samples) else None
        if info is None or (info.id, info.index) != (sid, sample_index):
            problems.append(f"{INDEX_NAME}: sample {sid!r} (index {sample_index}) is not at row {row} of shard {shard}")
    if len(headers) < len(names):
        return problems  # totals over the readable shards alone would add a false problem to the real one
    totals = {
        "num_samples": sum(len(h.samples) for h in headers.values()),
        "num_tokens": sum(h.num_tokens for h in headers.values()),
    }
    problems += [
        f"{INDEX_NAME}: {key} is {index.get(key)}, the shards hold {total}"
        for key, total in totals.items()
        if index.get(key) != total
    ]
    if headers and index_run(index, out) != next(iter(headers.values())).run:
        problems.append(f"{INDEX_NAME}: its run differs from the one the shards record")
    return problems
