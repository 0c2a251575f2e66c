"""Reading one shard: its header alone, or its samples with their states decoded (see schema.Encoding)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from offline_extract.store.schema import (
    FRAMES_SUFFIX,
    IMAGE_MASK_SINCE,
    METADATA_KEY,
    SPECS,
    STATE_TENSORS,
    Encoding,
    RunInfo,
    SampleInfo,
    ShardError,
    check_format_version,
)


@dataclass
class ShardHeader:
    """What a shard's header alone tells: enough to index a directory without reading tensor data."""

    path: Path
    run: RunInfo
    samples: list[SampleInfo]
    shapes: dict[str, tuple[int, ...]]
    encoding: Encoding

    @property
    def num_tokens(self) -> int:
        return self.shapes["input_ids"][0]


def _run_and_encoding(document: dict, path: Path) -> tuple[RunInfo, Encoding]:
    """The run a shard document records and the shard's encoding: the run's, or (format version 1) the
    encoding recorded beside it, or for a shard written before encodings existed plain bf16."""
    check_format_version(document.get("format_version"), path)
    run = RunInfo.from_json(document["run"], str(path))
    if document["format_version"] >= IMAGE_MASK_SINCE:
        return run, run.encoding
    if document["format_version"] == 2:
        return run, replace(run.encoding, image_mask=False)
    return run, Encoding.from_json(document["encoding"]) if "encoding" in document else Encoding(image_mask=False)


def read_header(path: str | os.PathLike) -> ShardHeader:
    path = Path(path)
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for non-safetensors files
        raise ShardError(f"{path} is not a readable safetensors file: {e}") from e
    if METADATA_KEY not in metadata:
        raise ShardError(f"{path} is not an offline_extract shard (no {METADATA_KEY!r} metadata)")
    try:
        document = json.loads(metadata[METADATA_KEY])
        run, encoding = _run_and_encoding(document, path)
        samples = [SampleInfo(**s) for s in document["samples"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ShardError):
            raise
        raise ShardError(f"{path} has damaged {METADATA_KEY!r} metadata: {e!r}") from e
    missing = [t.name for t in encoding.tensors if t.name not in shapes]
    if missing:
        raise ShardError(f"{path} lacks tensors {missing}")
    return ShardHeader(path, run, samples, shapes, encoding)


def encoding_of(f, path: Path) -> Encoding:
    """The encoding of the open shard `f` (at `path`)."""
    return _run_and_encoding(json.loads(f.metadata()[METADATA_KEY]), path)[1]


def sample_bounds(f, encoding: Encoding) -> dict[str, list[int]]:
    """An open shard's per-sample bounds: token offsets, and each compressed state's frame offsets."""
    names = ["offsets", *(name + FRAMES_SUFFIX for name in encoding.compressed)]
    return {name: f.get_tensor(name).tolist() for name in names}


def read_samples(
    f,
    encoding: Encoding,
    bounds: dict[str, list[int]],
    first: int,
    stop: int,
    names: Sequence[str],
    path: Path,
    decode: bool = True,
) -> dict:
    """Samples first:stop of the open shard `f` (at `path`), their states decoded (bf16), reading only
    their rows: the per-token tensors among `names` (any of the encoding's sample_tensors). With
    decode=False the states come as stored, decompressed (fp8, nvfp4: values and their scale tensors). A
    frame whose checksum or structure is broken raises ShardError naming the shard and the sample."""
    offsets = bounds["offsets"]
    start, end = offsets[first], offsets[stop]
    stored = encoding.token_tensors
    # A token tensor of a later version than the shard's (image_mask): zeros, as nothing of it was there.
    out = {
        name: f.get_slice(name)[start:end] if name in stored else torch.zeros(end - start, dtype=SPECS[name].dtype)
        for name in names
        if name not in STATE_TENSORS
    }
    states = [name for name in names if name in STATE_TENSORS]
    staged = {}
    for t in (t for state in states for t in encoding.staged_of(state)):
        if t.name in encoding.compressed:
            frames, decode_frame, blob = (
                bounds[t.name + FRAMES_SUFFIX],
                encoding.frame_codec.decoder(),
                f.get_slice(t.name),
            )
            pieces = []
            for i in range(first, stop):
                try:
                    pieces.append(decode_frame(blob[frames[i] : frames[i + 1]], t.dtype, offsets[i + 1] - offsets[i]))
                except encoding.frame_codec.errors + (ValueError,) as e:
                    raise ShardError(f"{path}: the {t.name} frame of sample position {i} is damaged ({e})") from e
            staged[t.name] = torch.cat(pieces)
        else:
            staged[t.name] = f.get_slice(t.name)[start:end]
    return {**out, **(encoding.decode(staged) if decode else staged)}


@dataclass
class Shard(ShardHeader):
    """A shard opened for reading: its header and its samples' bounds (`sample_bounds`); tensor data is
    read from disk only when asked for."""

    bounds: dict[str, list[int]]

    @property
    def offsets(self) -> list[int]:
        return self.bounds["offsets"]

    def position(self, i_or_id: int | str) -> int:
        """The row of a sample in this shard, given its position (int) or its id (str)."""
        if isinstance(i_or_id, str):
            for pos, s in enumerate(self.samples):
                if s.id == i_or_id:
                    return pos
            raise KeyError(f"no sample with id {i_or_id!r} in {self.path}")
        if not 0 <= i_or_id < len(self.samples):
            raise IndexError(f"sample position {i_or_id} out of range: {self.path} holds {len(self.samples)}")
        return i_or_id

    def sample(self, i_or_id: int | str) -> dict[str, torch.Tensor]:
        """One sample's input_ids, loss_mask, image_mask and states (aux_hidden_states, hidden_states if kept)."""
        pos = self.position(i_or_id)
        return self.read(pos, pos + 1)

    def read(self, first: int, stop: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Samples first:stop (positions) packed along tokens, states decoded; only their rows are read."""
        with safe_open(self.path, framework="pt") as f:
            return read_samples(
                f, self.encoding, self.bounds, first, stop, names or self.encoding.sample_tensors, self.path
            )

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)


def open_shard(path: str | os.PathLike) -> Shard:
    header = read_header(path)
    with safe_open(header.path, framework="pt") as f:
        bounds = sample_bounds(f, header.encoding)
    offsets = bounds["offsets"]
    if len(offsets) != len(header.samples) + 1 or offsets[-1] != header.num_tokens:
        raise ShardError(f"{header.path}: offsets do not match its {len(header.samples)} samples")
    return Shard(**vars(header), bounds=bounds)
