"""Reading one shard: its header alone, or its tensors row by row."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from offline_extract.store.schema import FORMAT_VERSION, METADATA_KEY, SAMPLE_TENSORS, TENSORS, SampleInfo, ShardError


@dataclass
class ShardHeader:
    """What a shard's header alone tells: enough to index a directory without reading tensor data."""

    path: Path
    run: dict
    samples: list[SampleInfo]
    shapes: dict[str, tuple[int, ...]]

    @property
    def num_tokens(self) -> int:
        return self.shapes["input_ids"][0]


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
        version = document.get("format_version")
        if version != FORMAT_VERSION:
            raise ShardError(f"{path} has format_version {version}, expected {FORMAT_VERSION}")
        run, samples = document["run"], [SampleInfo(**s) for s in document["samples"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ShardError):
            raise
        raise ShardError(f"{path} has damaged {METADATA_KEY!r} metadata: {e!r}") from e
    missing = [t.name for t in TENSORS if t.name not in shapes]
    if missing:
        raise ShardError(f"{path} lacks tensors {missing}")
    return ShardHeader(path, run, samples, shapes)


@dataclass
class Shard:
    """A shard opened for reading; tensor data is read from disk only when asked for."""

    path: Path
    run: dict
    samples: list[SampleInfo]
    shapes: dict[str, tuple[int, ...]]
    offsets: list[int]

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

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
        """One sample's rows of input_ids, loss_mask, aux_hidden_states and hidden_states."""
        pos = self.position(i_or_id)
        return self.rows(self.offsets[pos], self.offsets[pos + 1])

    def rows(self, start: int, stop: int, names: Sequence[str] = SAMPLE_TENSORS) -> dict[str, torch.Tensor]:
        """Token rows start:stop of the per-token tensors, reading only those rows from disk."""
        with safe_open(self.path, framework="pt") as f:
            return {name: f.get_slice(name)[start:stop] for name in names}

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)


def open_shard(path: str | os.PathLike) -> Shard:
    header = read_header(path)
    with safe_open(header.path, framework="pt") as f:
        offsets = f.get_tensor("offsets").tolist()
    if len(offsets) != len(header.samples) + 1 or offsets[-1] != header.num_tokens:
        raise ShardError(f"{header.path}: offsets do not match its {len(header.samples)} samples")
    return Shard(header.path, header.run, header.samples, header.shapes, offsets)
