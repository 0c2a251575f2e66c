"""A directory of shards as one collection: listing, scanning headers, index.json (written and read
here only), and iterating every sample."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from offline_extract.formatting import listing, plural
from offline_extract.store.atomic import atomic_write
from offline_extract.store.journal import load_json
from offline_extract.store.schema import (
    FORMAT_VERSION,
    INDEX_NAME,
    SHARD_GLOB,
    RunInfo,
    SampleInfo,
    ShardError,
    check_format_version,
    is_shard_name,
    shard_number,
)
from offline_extract.store.shard import ShardHeader, open_shard, read_header

# Shards from different runs must never be indexed together; these run keys identify a run's output
# (by content: the same model resumed from another mount point is still the same model).
RUN_KEYS_THAT_MUST_AGREE = ("config_sha256", "weights", "layer_ids")


def shard_paths(out_dir: str | os.PathLike) -> list[Path]:
    """The directory's shards in shard-number order (numeric, so shard_1000 sorts after shard_999); a file the
    shards' glob matches under another name is none of them (`not_shards`)."""
    return sorted((p for p in Path(out_dir).glob(SHARD_GLOB) if is_shard_name(p.name)), key=shard_number)


def not_shards(out_dir: str | os.PathLike) -> str | None:
    """One line naming the files of out_dir named like shards but not as one (shard_<digits>.safetensors: a copy
    "shard_000 - Copy.safetensors"), which every reader, check and run leaves alone; None where there are none."""
    names = sorted(p.name for p in Path(out_dir).glob(SHARD_GLOB) if not is_shard_name(p.name))
    if not names:
        return None
    return (
        f"ignored {plural(len(names), 'file')} in {out_dir} named like a shard but not shard_<digits>.safetensors, "
        f"so no run's shard: {listing(names)}"
    )


def _check_run_agrees(first: ShardHeader, other: ShardHeader) -> None:
    for key in RUN_KEYS_THAT_MUST_AGREE:
        theirs, ours = getattr(other.run, key), getattr(first.run, key)
        if theirs != ours:
            raise ShardError(
                f"{other.path.name} and {first.path.name} come from different runs: run {key} is {theirs!r} vs {ours!r}"
            )


def scan(
    out_dir: str | os.PathLike, known: Iterable[ShardHeader] = ()
) -> tuple[list[ShardHeader], list[tuple[int, int, int]]]:
    """Headers of all shards plus (sample index, shard position, row) sorted by sample index. The
    directory decides which shards there are; those among `known` are not read again."""
    paths = shard_paths(out_dir)
    if not paths:
        raise ShardError(f"no {SHARD_GLOB} files in {out_dir}")
    by_name = {h.path.name: h for h in known}
    headers = [by_name.get(p.name) or read_header(p) for p in paths]
    where: dict[int, tuple[int, int]] = {}
    for s_pos, h in enumerate(headers):
        _check_run_agrees(headers[0], h)
        for row, info in enumerate(h.samples):
            if info.index in where:
                other = headers[where[info.index][0]].path.name
                raise ShardError(f"sample index {info.index} (id {info.id!r}) is in both {other} and {h.path.name}")
            where[info.index] = (s_pos, row)
    return headers, sorted((index, s_pos, row) for index, (s_pos, row) in where.items())


def index_document(headers: list[ShardHeader], order: list[tuple[int, int, int]]) -> dict:
    """The index of shards `headers` whose samples `scan` put in `order`: what index.json holds."""
    return {
        "format_version": FORMAT_VERSION,
        "run": headers[0].run.to_json() if headers else None,
        "num_samples": len(order),
        "num_tokens": sum(h.num_tokens for h in headers),
        "shards": [
            {
                "file": h.path.name,
                "num_samples": len(h.samples),
                "num_tokens": h.num_tokens,
                "bytes": h.path.stat().st_size,
            }
            for h in headers
        ],
        "samples": {
            "id": [headers[s].samples[row].id for _, s, row in order],
            "shard": [s for _, s, _ in order],
            "row": [row for _, _, row in order],
            "index": [index for index, _, _ in order],
        },
    }


def write_index(out_dir: str | os.PathLike, known: Iterable[ShardHeader] = ()) -> Path:
    """Writes out_dir/index.json describing every shard and where each sample lives, from headers only:
    those `known` already (a writer's own shards, `ShardWriter.headers`) are not read back from disk,
    which at the end of a run would read every shard it just wrote.

    A directory without shards (a run whose every record was rejected) gets an index of no samples.
    """
    out_dir = Path(out_dir)
    index = index_document(*(scan(out_dir, known) if shard_paths(out_dir) else ([], [])))
    path = out_dir / INDEX_NAME
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(index)))
    return path


def index_differences(
    index: dict, headers: list[ShardHeader], order: list[tuple[int, int, int]], out_dir: str | os.PathLike
) -> list[str]:
    """How `index` (as read_index gives it) differs from what the shards' headers say, one line per key;
    none when it describes them. An index of an earlier format version describes them when it records
    the same facts."""
    want = json.loads(json.dumps(index_document(headers, order)))
    found = []
    for key, value in want.items():
        there = index.get(key)
        if key == "format_version":
            continue  # read_index refused one it cannot read
        if key == "run":
            run = None if there is None else index_run(index, out_dir)
            there = None if run is None else run.to_json()
            if there != value:
                found.append("its run differs from the shards' run")
        elif key == "samples":
            if there != value:
                found.append(_first_sample_difference(there, value))
        elif key == "shards":
            if there != value:
                found.append(_first_shard_difference(there, value))
        elif there != value:
            found.append(f"its {key} is {there!r}, the shards hold {value!r}")
    return found


def index_mismatch(
    out_dir: str | os.PathLike, headers: list[ShardHeader], order: list[tuple[int, int, int]]
) -> str | None:
    """Words for a warning where out_dir/index.json does not describe the shards `headers` (whose samples
    `scan` put in `order`); None where it does, or where there is none. A reader that believes it over the
    headers would serve one sample under another's id."""
    index = read_index(out_dir)
    wrong = [] if index is None else index_differences(index, headers, order, out_dir)
    if not wrong:
        return None
    return (
        f"{Path(out_dir) / INDEX_NAME} does not match the shards in {out_dir} ({'; '.join(wrong)}): read from "
        f"the shards' headers instead"
    )


def _first_shard_difference(there, want: list[dict]) -> str:
    if not isinstance(there, list) or len(there) != len(want):
        return f"it lists {len(there) if isinstance(there, list) else 'no'} shards, the directory holds {len(want)}"
    position, a, b = next((i, a, b) for i, (a, b) in enumerate(zip(there, want)) if a != b)
    return f"its shard entry {position} is {a}, where the shard is {b}"


def _first_sample_difference(there, want: dict) -> str:
    try:
        listed = list(zip(*(there[column] for column in want)))
    except (KeyError, TypeError):
        return "its samples are not laid out as an index's"
    for position, (a, b) in enumerate(zip(listed, zip(*want.values()))):
        if a != b:
            return (
                f"sample position {position} is id {a[0]!r} at row {a[2]} of shard {a[1]} there, where the "
                f"shards' headers have id {b[0]!r} at row {b[2]} of shard {b[1]}"
            )
    return f"it lists {len(listed)} samples, the shards hold {len(want['id'])}"


def iter_samples(out_dir: str | os.PathLike) -> Iterator[tuple[SampleInfo, dict[str, torch.Tensor]]]:
    """Every sample in the directory with its tensors, in sample-index order."""
    headers, order = scan(out_dir)
    shards = [open_shard(h.path) for h in headers]
    for _, s, row in order:
        yield shards[s].samples[row], shards[s].sample(row)


def read_index(out_dir: str | os.PathLike) -> dict | None:
    """out_dir/index.json, or None when there is none; an index of a format version this one cannot read
    is an error."""
    path = Path(out_dir) / INDEX_NAME
    if not path.is_file():
        return None
    try:
        index = load_json(path)
    except ValueError as e:  # invalid JSON, or not UTF-8: refused as the directory's other faults are, in one line
        raise ShardError(str(e)) from e
    check_format_version(index.get("format_version"), path)
    return index


def index_run(index: dict, out_dir: str | os.PathLike) -> RunInfo | None:
    """The run an index records; None for a directory without shards."""
    return None if index["run"] is None else RunInfo.from_json(index["run"], str(Path(out_dir) / INDEX_NAME))
