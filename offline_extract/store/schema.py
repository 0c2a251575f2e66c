"""The output format, stated once: which tensors a shard holds, their stored dtypes and shapes, and the
format version, shard and index names.

The writer, the readers, the integrity check, the dry-run sizing and the host offload all take these
facts from here, so a change of a stored dtype or width is a change to this module alone.

A shard is one safetensors file holding many samples concatenated along the token axis (T tokens,
n samples, k EAGLE-3 layers, hidden size H). `TENSORS` is a sample as readers hand it out; an `Encoding`
(`--store`, `--compress`, and whether the recipe keeps the final state) derives from it what a shard
stores. The safetensors metadata key `METADATA_KEY` holds a JSON document with the format version, the
encoding, the run dict given to the writer (stored verbatim), and one entry per sample (see
`SampleInfo`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from offline_extract.options import Compression, Store, check_choice, choices
from offline_extract.store.codecs import FP8_DTYPE, fp8_dequantize, fp8_quantize

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
    sample), "n+1", or "bytes" (a compressed byte stream); cols "k*H" (the aux layers side by side,
    ascending layer order), "H", "k" (one per aux layer), "1", or None for a 1-D tensor."""

    name: str
    dtype: torch.dtype
    rows: str
    cols: str | None = None

    @property
    def per_token(self) -> bool:
        return self.rows == "T"

    def width(self, num_aux_layers: int, hidden_size: int | None) -> int | None:
        """Row width for a model; None for a 1-D tensor, or when the hidden size is unknown."""
        if self.cols is None or (hidden_size is None and "H" in self.cols):
            return None
        return {"k*H": num_aux_layers * (hidden_size or 0), "H": hidden_size, "k": num_aux_layers, "1": 1}[self.cols]

    def shape(self, tokens: int, samples: int, num_aux_layers: int, hidden_size: int | None) -> tuple:
        """The expected shape; an unknown length or width is None."""
        rows = {"T": tokens, "n": samples, "n+1": samples + 1, "bytes": None}[self.rows]
        return (rows,) if self.cols is None else (rows, self.width(num_aux_layers, hidden_size))

    @property
    def safetensors_dtype(self) -> str:
        return SAFETENSORS_DTYPES[self.dtype]


TENSORS = (
    TensorSpec("input_ids", torch.int32, "T"),
    TensorSpec("loss_mask", torch.uint8, "T"),
    TensorSpec("aux_hidden_states", torch.bfloat16, "T", "k*H"),
    TensorSpec("hidden_states", torch.bfloat16, "T", "H"),  # the final state (run["final_state"] says which)
    TensorSpec("offsets", torch.int64, "n+1"),  # sample i is rows offsets[i]:offsets[i+1]
    TensorSpec("sample_index", torch.int64, "n"),  # the record index of each sample in the corpus
)
SPECS = {t.name: t for t in TENSORS}

# safetensors' codes for the dtypes shards hold, as its header and `get_dtype()` spell them.
SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    FP8_DTYPE: "F8_E4M3",
}

# What a sample consists of, in item order: the per-token tensors.
SAMPLE_TENSORS = tuple(t.name for t in TENSORS if t.per_token)
# The hidden states, (aux, last): the 2-D tensors, whose width depends on the model.
STATE_TENSORS = tuple(t.name for t in TENSORS if t.cols is not None)
# The dtype readers hand states out in, whatever the store, and what run["dtype"] records.
(STATE_DTYPE,) = {SPECS[name].dtype for name in STATE_TENSORS}
FINAL_STATE = STATE_TENSORS[-1]

# --store: the dtype a state is stored in, in the order of its choices. fp8 adds, per state, a float32 scale
# per token per layer.
STORES = dict(zip(choices("store"), (torch.bfloat16, FP8_DTYPE), strict=True))
SCALE_SUFFIX = "_scale"
# Under zstd a state is one byte stream of per-sample frames; "<state>_frames" holds the frame bounds.
FRAMES_SUFFIX = "_frames"


@dataclass(frozen=True)
class Encoding:
    """How a run stores its states: `--store`, `--compress`, and whether the final state is kept."""

    store: Store = "bf16"
    compress: Compression = "none"
    keeps_final_state: bool = True

    def __post_init__(self):
        check_choice("store", self.store)
        check_choice("compress", self.compress)

    def to_json(self) -> dict:
        return {"store": self.store, "compress": self.compress, "final_state": self.keeps_final_state}

    @classmethod
    def from_json(cls, document: dict | None) -> "Encoding":
        """A shard's encoding; shards written before encodings existed hold plain bf16 states."""
        if document is None:
            return cls()
        return cls(document["store"], document["compress"], keeps_final_state=document["final_state"])

    @property
    def states(self) -> tuple[str, ...]:
        """The state tensors a sample has: aux, and the final state unless the recipe drops it."""
        return STATE_TENSORS if self.keeps_final_state else STATE_TENSORS[:-1]

    @property
    def sample_tensors(self) -> tuple[str, ...]:
        return tuple(name for name in SAMPLE_TENSORS if name not in STATE_TENSORS or name in self.states)

    @property
    def staged(self) -> tuple[TensorSpec, ...]:
        """The per-token tensors the states become on the device, before they are copied to the host:
        each state in the stored dtype, then (fp8) its scales, one per token per layer."""
        specs = []
        for name in self.states:
            specs.append(TensorSpec(name, STORES[self.store], "T", SPECS[name].cols))
            if self.store == "fp8":
                specs.append(TensorSpec(name + SCALE_SUFFIX, torch.float32, "T", "k" if SPECS[name].cols == "k*H" else "1"))
        return tuple(specs)

    @property
    def compressed(self) -> tuple[str, ...]:
        """The staged tensors stored as zstd frames: the states (their scales are small and stay raw)."""
        return self.states if self.compress == "zstd" else ()

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every tensor a shard of this encoding holds."""
        specs = [SPECS["input_ids"], SPECS["loss_mask"]]
        for t in self.staged:
            if t.name in self.compressed:
                specs += [TensorSpec(t.name, torch.uint8, "bytes"), TensorSpec(t.name + FRAMES_SUFFIX, torch.int64, "n+1")]
            else:
                specs.append(t)
        return (*specs, SPECS["offsets"], SPECS["sample_index"])

    @property
    def file_order(self) -> tuple[str, ...]:
        """Widest element types first, so every tensor starts aligned to its element size and can be
        memory-mapped without a copy (the header is padded to 8 bytes)."""
        return tuple(t.name for t in sorted(self.tensors, key=lambda t: -t.dtype.itemsize))

    def widths(self, num_aux_layers: int, hidden_size: int) -> dict[str, int]:
        """Row width of each staged tensor for a model."""
        return {t.name: t.width(num_aux_layers, hidden_size) for t in self.staged}

    def state_bytes(self, widths: dict[str, int]) -> int:
        """Bytes of one token's staged states (and fp8 scales) at these widths: what a shard's size target
        counts."""
        return sum(t.dtype.itemsize * widths[t.name] for t in self.staged)

    def state_bytes_per_token(self, num_aux_layers: int, hidden_size: int) -> int:
        return self.state_bytes(self.widths(num_aux_layers, hidden_size))

    def bytes_per_token(self, num_aux_layers: int, hidden_size: int) -> dict[str, int]:
        """Bytes of one token in each per-token tensor before compression (staged states and scales,
        input_ids, loss_mask)."""
        widths = self.widths(num_aux_layers, hidden_size)
        per_token = {t.name: t.dtype.itemsize * widths[t.name] for t in self.staged}
        return {**per_token, **{name: SPECS[name].dtype.itemsize for name in ("input_ids", "loss_mask")}}

    def encode(self, aux: torch.Tensor, last: torch.Tensor | None, num_aux_layers: int) -> dict[str, torch.Tensor]:
        """The staged tensors of a batch's states, on the states' device (the GPU, before the copy)."""
        given = dict(zip(STATE_TENSORS, (aux, last)))
        out = {}
        for t in self.staged:
            if t.name in given:
                out[t.name] = given[t.name].to(t.dtype)
            else:  # a scale, after its state: quantize the state to fp8 with it
                state = t.name.removesuffix(SCALE_SUFFIX)
                out[state], out[t.name] = fp8_quantize(given[state], t.width(num_aux_layers, None))
        return out

    def decode(self, staged: dict[str, torch.Tensor], dtype: torch.dtype = STATE_DTYPE) -> dict[str, torch.Tensor]:
        """The states (in `dtype`, bf16 by default) from rows of the staged tensors, for each state that
        `staged` holds."""
        states = [name for name in self.states if name in staged]
        if self.store == "fp8":
            return {name: fp8_dequantize(staged[name], staged[name + SCALE_SUFFIX], dtype) for name in states}
        return {name: staged[name].to(dtype) for name in states}


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
