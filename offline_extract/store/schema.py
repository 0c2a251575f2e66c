"""The output format, stated once: which tensors a shard holds, their stored dtypes and shapes, and the
format version, shard and index names.

The writer, the readers, the integrity check, the dry-run sizing and the host offload all take these
facts from here, so a change of a stored dtype or width is a change to `TENSORS` alone.

A shard is one safetensors file holding many samples concatenated along the token axis (T tokens,
n samples, k EAGLE-3 layers, hidden size H). The safetensors metadata key `METADATA_KEY` holds a JSON
document with the format version, the run dict given to the writer (stored verbatim), and one entry per
sample (see `SampleInfo`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# Of shards, index.json and manifest.json alike: they are read together, so they change together.
FORMAT_VERSION = 1
METADATA_KEY = "offline_extract"
INDEX_NAME = "index.json"
SHARD_GLOB = "shard_*.safetensors"


def shard_name(number: int) -> str:
    return f"shard_{number:03d}.safetensors"


def shard_number(path: Path) -> int:
    return int(path.name[len("shard_") : -len(".safetensors")])


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a shard. `rows` and `cols` are symbolic: rows "T" (one per token), "n" (one per
    sample) or "n+1"; cols "k*H" (the aux layers side by side, ascending layer order), "H", or None for a
    1-D tensor."""

    name: str
    dtype: torch.dtype
    rows: str
    cols: str | None = None

    @property
    def per_token(self) -> bool:
        return self.rows == "T"

    def width(self, num_aux_layers: int, hidden_size: int | None) -> int | None:
        """Row width for a model; None for a 1-D tensor, or when the hidden size is unknown."""
        if self.cols is None or hidden_size is None:
            return None
        return {"k*H": num_aux_layers * hidden_size, "H": hidden_size}[self.cols]

    def shape(self, tokens: int, samples: int, num_aux_layers: int, hidden_size: int | None) -> tuple:
        """The expected shape; an unknown width is None."""
        rows = {"T": tokens, "n": samples, "n+1": samples + 1}[self.rows]
        return (rows,) if self.cols is None else (rows, self.width(num_aux_layers, hidden_size))

    @property
    def safetensors_dtype(self) -> str:
        return SAFETENSORS_DTYPES[self.dtype]


TENSORS = (
    TensorSpec("input_ids", torch.int32, "T"),
    TensorSpec("loss_mask", torch.uint8, "T"),
    TensorSpec("aux_hidden_states", torch.bfloat16, "T", "k*H"),
    TensorSpec("hidden_states", torch.bfloat16, "T", "H"),  # the final post-norm state
    TensorSpec("offsets", torch.int64, "n+1"),  # sample i is rows offsets[i]:offsets[i+1]
    TensorSpec("sample_index", torch.int64, "n"),  # the record index of each sample in the corpus
)
SPECS = {t.name: t for t in TENSORS}

# safetensors' codes for the dtypes above, as its header and `get_dtype()` spell them.
SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
}

# What a sample consists of, in item order: the per-token tensors.
SAMPLE_TENSORS = tuple(t.name for t in TENSORS if t.per_token)
# The hidden states, (aux, last): the 2-D tensors, whose width depends on the model.
STATE_TENSORS = tuple(t.name for t in TENSORS if t.cols is not None)
# What captured states are cast to before they leave the device, and what run["dtype"] records.
(STATE_DTYPE,) = {SPECS[name].dtype for name in STATE_TENSORS}
# File order: widest element types first, so every tensor starts aligned to its element size and can be
# memory-mapped without a copy (the header is padded to 8 bytes).
FILE_ORDER = tuple(t.name for t in sorted(TENSORS, key=lambda t: -t.dtype.itemsize))


def state_widths(num_aux_layers: int, hidden_size: int) -> tuple[int, int]:
    """(aux width, hidden width) of a model's rows: k*H and H."""
    aux, last = (SPECS[name].width(num_aux_layers, hidden_size) for name in STATE_TENSORS)
    return aux, last


def bytes_per_token(widths: tuple[int, int]) -> dict[str, int]:
    """Stored bytes of one token in each per-token tensor, given the (aux, hidden) widths."""
    width = dict(zip(STATE_TENSORS, widths))
    return {name: SPECS[name].dtype.itemsize * width.get(name, 1) for name in SAMPLE_TENSORS}


def state_bytes_per_token(widths: tuple[int, int]) -> int:
    """Bytes of one token's hidden states (aux + last): what a shard's size target counts."""
    per_token = bytes_per_token(widths)
    return sum(per_token[name] for name in STATE_TENSORS)


# Bytes each sample adds besides its tokens: its rows of the per-sample tensors.
SAMPLE_ROW_BYTES = sum(t.dtype.itemsize for t in TENSORS if not t.per_token)


class ShardError(ValueError):
    """A shard or shard directory is malformed, inconsistent, or does not contain what was asked for."""


@dataclass(frozen=True)
class SampleInfo:
    """A sample's entry in its shard's metadata."""

    index: int
    id: str
    source: str
    line: int
    source_len: int
    truncated: bool
