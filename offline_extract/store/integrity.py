"""`inspect --verify`: an output directory checked against its manifest, its index and itself.

Every problem is reported, not only the first, so that a damaged directory is mended in one pass:
delete the shards named, and re-running the extraction redoes exactly their samples.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from offline_extract.store import manifest
from offline_extract.store.index import read_index, shard_paths
from offline_extract.store.schema import INDEX_NAME, TENSORS, ShardError
from offline_extract.store.shard import ShardHeader, read_header


@dataclass
class Verification:
    shards: int
    samples: int
    problems: list[str]


def verify(out: str | os.PathLike, threads: int = 8) -> Verification:
    out = Path(out)
    paths = shard_paths(out)
    problems = []
    recorded = manifest.load(out)
    if recorded is None:
        problems.append(f"no {manifest.MANIFEST_NAME}: shard checksums cannot be checked")
    else:
        problems += _check_checksums(out, paths, recorded, threads)

    headers: dict[str, ShardHeader] = {}
    for path in paths:
        header, found = _check_shard(path, recorded)
        problems += found
        if header is not None:
            headers[path.name] = header
    seen: dict[int, str] = {}
    for name, header in headers.items():
        for info in header.samples:
            if info.index in seen:
                problems.append(f"sample index {info.index} (id {info.id!r}) is in both {seen[info.index]} and {name}")
            seen.setdefault(info.index, name)
    problems += _check_index(out, [p.name for p in paths], headers)
    return Verification(len(paths), len(seen), problems)


def _check_checksums(out: Path, paths: list[Path], recorded: dict, threads: int) -> list[str]:
    problems = []
    if recorded.get("status") != "complete":
        problems.append(f"{manifest.MANIFEST_NAME} says the run is {recorded.get('status')!r}, not complete")
    listed = recorded.get("shards", {})
    on_disk = {p.name for p in paths}
    problems += [f"{name}: listed in {manifest.MANIFEST_NAME} but missing" for name in listed if name not in on_disk]
    problems += [f"{p.name}: not listed in {manifest.MANIFEST_NAME}" for p in paths if p.name not in listed]
    checked = [p for p in paths if p.name in listed]
    # hashlib releases the GIL, so threads hash several shards at disk speed.
    with ThreadPoolExecutor(threads) as pool:
        digests = pool.map(manifest.sha256_file, checked)
        for path, digest in zip(checked, digests):
            entry = listed[path.name]
            size = path.stat().st_size
            if size != entry["bytes"]:
                problems.append(f"{path.name}: {size} bytes, but {manifest.MANIFEST_NAME} says {entry['bytes']}")
            if digest != entry["sha256"]:
                problems.append(f"{path.name}: sha256 {digest} differs from {manifest.MANIFEST_NAME}'s {entry['sha256']}")
    return problems


def _check_shard(path: Path, recorded: dict | None) -> tuple[ShardHeader | None, list[str]]:
    """The shard's header (None when unreadable) and what is wrong inside it."""
    try:
        header = read_header(path)
        with safe_open(path, framework="pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
            offsets = f.get_tensor("offsets").tolist()
            sample_index = f.get_tensor("sample_index").tolist()
    except ShardError as e:
        return None, [str(e)]
    name, shapes, run = path.name, header.shapes, header.run
    problems = [
        f"{name}: {t.name} is {dtypes.get(t.name)}, expected {t.safetensors_dtype}"
        for t in TENSORS
        if dtypes.get(t.name) != t.safetensors_dtype
    ]
    tokens, n, k = header.num_tokens, len(header.samples), len(run.get("layer_ids", []))
    for t in TENSORS:
        shape, found = t.shape(tokens, n, k, run.get("hidden_size") or None), shapes[t.name]
        if len(found) != len(shape) or any(w is not None and w != s for w, s in zip(shape, found)):
            problems.append(f"{name}: {t.name} has shape {list(found)}, expected {list(shape)}")
    if offsets[:1] != [0] or offsets[-1:] != [tokens] or any(a > b for a, b in zip(offsets, offsets[1:])):
        problems.append(f"{name}: offsets do not rise from 0 to its {tokens} tokens")
    if sample_index != [s.index for s in header.samples]:
        problems.append(f"{name}: sample_index disagrees with the samples in its metadata")
    identity = (recorded or {}).get("identity", {})
    for key in manifest.IDENTITY_KEYS:
        if key in identity and run.get(key) != identity[key]:
            problems.append(f"{name}: run {key} {run.get(key)!r} differs from the manifest's {identity[key]!r}")
    return header, problems


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
    total = sum(len(h.samples) for h in headers.values())
    if index.get("num_samples") != total:
        problems.append(f"{INDEX_NAME}: num_samples is {index.get('num_samples')}, the shards hold {total}")
    return problems
