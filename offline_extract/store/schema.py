"""The output format, stated once: which tensors a shard holds, their stored dtypes and shapes, and the
format version, shard and index names.

The writer, the readers, the integrity check, the dry-run sizing and the host offload all take these
facts from here, so a change of a stored dtype or width is a change to this module alone.

A shard is one safetensors file holding many samples concatenated along the token axis (T tokens,
n samples, k EAGLE-3 layers, hidden size H). `TENSORS` is a sample as readers hand it out; an `Encoding`
(`--store`, `--compress`, and whether the recipe keeps the final state) derives from it what a shard
stores. The safetensors metadata key `METADATA_KEY` holds a JSON document with the format version, the
run's facts (`RunInfo`, whose store, compress and final state give the shard's encoding), and one entry
per sample (see `SampleInfo`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

import torch

from offline_extract.options import Compression, FinalState, Overlong, RecipeName, Store, check_choice, choices
from offline_extract.store.codecs import (
    CODECS,
    FP8_DTYPE,
    NVFP4_BLOCK,
    FrameCodec,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)

# Of shards, index.json and manifest.json alike: they are read together, so they change together.
# Version 3 adds image_mask, which tokens stand for images, and each sample's images_sha256. Version 2 records a
# shard's encoding once, in its run (version 1 also had it beside the run, and the stored dtype as run["dtype"]).
# Outputs of versions 1 and 2 are still read (an image_mask of zeros: they hold no image), resumed, verified and
# exported.
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, FORMAT_VERSION)
# The first version whose shards hold image_mask.
IMAGE_MASK_SINCE = 3
METADATA_KEY = "offline_extract"
INDEX_NAME = "index.json"
REJECTS_FILE = "rejects.jsonl"  # the records a run left out, with why: its replicas' lists, merged at its end
SHARD_GLOB = "shard_*.safetensors"
# A shard's whole name: the glob also matches a copy ("shard_000 - Copy.safetensors") or a file of the user's
# ("shard_abc.safetensors"), which are no run's shards: never read as one, never deleted.
SHARD_NAME = re.compile(r"shard_([0-9]+)\.safetensors")


def check_format_version(version, path: Path) -> None:
    if version not in READABLE_FORMAT_VERSIONS:
        readable = " or ".join(map(str, READABLE_FORMAT_VERSIONS))
        raise ShardError(f"{path} has format_version {version}, expected {readable}")


def shard_name(number: int) -> str:
    return f"shard_{number:03d}.safetensors"


def is_shard_name(name: str) -> bool:
    return SHARD_NAME.fullmatch(name) is not None


def shard_number(path: Path) -> int:
    """The number of the shard at `path`, whose name `is_shard_name`."""
    named = SHARD_NAME.fullmatch(path.name)
    if named is None:
        raise ValueError(f"{path} is not named as a shard is ({shard_name(0)}, ...)")
    return int(named[1])


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a shard. `rows` and `cols` are symbolic: rows "T" (one per token), "n" (one per
    sample), "n+1", or "bytes" (a compressed byte stream); cols "k*H" (the aux layers side by side,
    ascending layer order), "H", "k" (one per aux layer), "1", or None for a 1-D tensor, each column
    standing for `per` of them (two e2m1 codes a byte, one block scale for 16 elements)."""

    name: str
    dtype: torch.dtype
    rows: str
    cols: str | None = None
    per: int = 1

    @property
    def per_token(self) -> bool:
        return self.rows == "T"

    def width(self, num_aux_layers: int | None, hidden_size: int | None) -> int | None:
        """Row width for a model; None for a 1-D tensor, or when the width depends on an unknown."""
        if self.cols is None:
            return None
        both = None if num_aux_layers is None or hidden_size is None else num_aux_layers * hidden_size
        count = {"k*H": both, "H": hidden_size, "k": num_aux_layers, "1": 1}[self.cols]
        return None if count is None else count // self.per

    def row_width(self, num_aux_layers: int | None, hidden_size: int | None = None) -> int:
        """`width` of a 2-D tensor whose width the sizes given decide."""
        width = self.width(num_aux_layers, hidden_size)
        if width is None:
            raise ValueError(f"{self.name} has no row width for {num_aux_layers} layers of width {hidden_size}")
        return width

    def shape(self, tokens: int, samples: int, num_aux_layers: int | None, hidden_size: int | None) -> tuple:
        """The expected shape; an unknown length or width is None."""
        rows = {"T": tokens, "n": samples, "n+1": samples + 1, "bytes": None}[self.rows]
        return (rows,) if self.cols is None else (rows, self.width(num_aux_layers, hidden_size))

    @property
    def safetensors_dtype(self) -> str:
        return SAFETENSORS_DTYPES[self.dtype]


TENSORS = (
    TensorSpec("input_ids", torch.int32, "T"),
    TensorSpec("loss_mask", torch.uint8, "T"),
    TensorSpec("image_mask", torch.uint8, "T"),  # 1 at the tokens that stand for an image, never in the loss
    TensorSpec("aux_hidden_states", torch.bfloat16, "T", "k*H"),
    TensorSpec("hidden_states", torch.bfloat16, "T", "H"),  # the final state (RunInfo.final_state says which)
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
# The per-token tensors of the tokens themselves, one value a token (input_ids and the masks).
TOKEN_TENSORS = tuple(t.name for t in TENSORS if t.per_token and t.cols is None)
# The hidden states, (aux, last): the 2-D tensors, whose width depends on the model.
STATE_TENSORS = tuple(t.name for t in TENSORS if t.cols is not None)
# The dtype readers hand states out in, whatever the store.
(STATE_DTYPE,) = {SPECS[name].dtype for name in STATE_TENSORS}
# The tensor of the final state (which one, post- or pre-norm, is the run's final_state).
FINAL_STATE_TENSOR = STATE_TENSORS[-1]

SCALE_SUFFIX = "_scale"
BLOCK_SCALE_SUFFIX = "_block_scale"


@dataclass(frozen=True)
class Scales:
    """Scales stored beside a quantized state, `<state><suffix>`: a state decodes as its values times them."""

    suffix: str
    dtype: torch.dtype
    block: int  # state elements one scale covers; 0: one per token per layer
    # A block scale may be zero (its block decodes to zeros, being that far below its token's largest); a
    # token's scale is positive (1 for an all-zero token), so a zero there is damage.
    zero_taken: bool


@dataclass(frozen=True)
class StoreFormat:
    """How one `--store` choice lays a state out: its values, the scales beside them (in the order its quantize
    returns them after the values and its dequantize takes them), and how inspect words it."""

    dtype: torch.dtype
    per: int  # state elements one stored element holds
    scales: tuple[Scales, ...]
    quantize: Callable | None  # ([T, layers*H] states, layers) -> (values, *scales); None: a cast
    dequantize: Callable | None  # (values, *scales, dtype) -> [T, layers*H] states
    words: str

    @property
    def block(self) -> int:
        """The elements a layer's state must be a whole number of."""
        return max([1, *(s.block for s in self.scales)])


_TOKEN_SCALES = Scales(SCALE_SUFFIX, torch.float32, 0, zero_taken=False)
# --store, in the order of its choices.
STORES = dict(
    zip(
        choices("store"),
        (
            StoreFormat(torch.bfloat16, 1, (), None, None, "bf16"),
            StoreFormat(
                FP8_DTYPE,
                1,
                (_TOKEN_SCALES,),
                fp8_quantize,
                fp8_dequantize,
                "fp8 (e4m3, a float32 scale per token per layer)",
            ),
            StoreFormat(
                torch.uint8,
                2,
                (Scales(BLOCK_SCALE_SUFFIX, FP8_DTYPE, NVFP4_BLOCK, zero_taken=True), _TOKEN_SCALES),
                nvfp4_quantize,
                nvfp4_dequantize,
                f"nvfp4 (e2m1 two a byte, an e4m3 scale per {NVFP4_BLOCK} and a float32 one per token per layer)",
            ),
        ),
        strict=True,
    )
)
# Under --compress a state is one byte stream of per-sample frames; "<state>_frames" holds their bounds.
FRAMES_SUFFIX = "_frames"


@dataclass(frozen=True)
class Encoding:
    """How a run stores its states: `--store` (and `--final-store`, where the final state is stored otherwise),
    `--compress`, and whether the final state is kept."""

    store: Store = "bf16"
    compress: Compression = "none"
    keeps_final_state: bool = True
    # Whether the shard stores image_mask (format version 3 on); readers hand one of zeros out where it does not.
    image_mask: bool = True
    # The final state's store where it differs from `store`; None where it does not, or no final state is kept,
    # so that one encoding has one spelling.
    final_store: Store | None = None

    def __post_init__(self):
        check_choice("store", self.store)
        check_choice("compress", self.compress)
        if self.final_store is not None:
            check_choice("store", self.final_store)
            if self.final_store == self.store or not self.keeps_final_state:
                object.__setattr__(self, "final_store", None)

    def to_json(self) -> dict:
        return {
            "store": self.store,
            "compress": self.compress,
            "final_state": self.keeps_final_state,
            "final_store": self.final_store,
        }

    @classmethod
    def from_json(cls, document: dict) -> "Encoding":
        """The encoding a format version 1 shard document records beside its run."""
        return cls(document["store"], document["compress"], keeps_final_state=document["final_state"], image_mask=False)

    @property
    def token_tensors(self) -> tuple[str, ...]:
        """The tensors of the tokens themselves that a shard of this encoding stores."""
        return tuple(name for name in TOKEN_TENSORS if name != "image_mask" or self.image_mask)

    @property
    def states(self) -> tuple[str, ...]:
        """The state tensors a sample has: aux, and the final state unless the recipe drops it."""
        return STATE_TENSORS if self.keeps_final_state else STATE_TENSORS[:-1]

    @property
    def sample_tensors(self) -> tuple[str, ...]:
        return tuple(name for name in SAMPLE_TENSORS if name not in STATE_TENSORS or name in self.states)

    def store_of(self, state: str) -> Store:
        """How `state` (one of STATE_TENSORS) is stored."""
        return self.final_store if self.final_store is not None and state == FINAL_STATE_TENSOR else self.store

    def staged_of(self, state: str) -> tuple[TensorSpec, ...]:
        """The per-token tensors `state` becomes on the device: its values, then its scales (`StoreFormat.scales`)."""
        cols, store = SPECS[state].cols, STORES[self.store_of(state)]
        per_layer = "k" if cols == "k*H" else "1"
        return (
            TensorSpec(state, store.dtype, "T", cols, store.per),
            *(
                TensorSpec(state + s.suffix, s.dtype, "T", cols if s.block else per_layer, s.block or 1)
                for s in store.scales
            ),
        )

    @property
    def staged(self) -> tuple[TensorSpec, ...]:
        """The per-token tensors the states become on the device, before they are copied to the host: each
        state's values in its store's dtype, then its scales."""
        return tuple(t for name in self.states for t in self.staged_of(name))

    @property
    def scales(self) -> dict[str, Scales]:
        """The staged scale tensors, by name."""
        return {name + s.suffix: s for name in self.states for s in STORES[self.store_of(name)].scales}

    @property
    def codec(self) -> FrameCodec | None:
        """The frame codec of `--compress`; None for "none"."""
        return CODECS.get(self.compress)

    @property
    def frame_codec(self) -> FrameCodec:
        """`codec`, of an encoding that stores frames (`compressed` names the tensors it stores so)."""
        if self.codec is None:
            raise ValueError(f"--compress {self.compress} stores no frames")
        return self.codec

    @property
    def compressed(self) -> tuple[str, ...]:
        """The staged tensors stored as frames of the codec: the states' values and their block scales (the
        scales per token per layer, 4 bytes a layer, stay raw)."""
        if not self.codec:
            return ()
        scales = self.scales
        return tuple(t.name for t in self.staged if t.name not in scales or scales[t.name].block)

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every tensor a shard of this encoding holds."""
        specs = [SPECS[name] for name in self.token_tensors]
        for t in self.staged:
            if t.name in self.compressed:
                specs += [
                    TensorSpec(t.name, torch.uint8, "bytes"),
                    TensorSpec(t.name + FRAMES_SUFFIX, torch.int64, "n+1"),
                ]
            else:
                specs.append(t)
        return (*specs, SPECS["offsets"], SPECS["sample_index"])

    @property
    def file_order(self) -> tuple[str, ...]:
        """Widest element types first, so every tensor starts aligned to its element size and can be
        memory-mapped without a copy (the header is padded to 8 bytes)."""
        return tuple(t.name for t in sorted(self.tensors, key=lambda t: -t.dtype.itemsize))

    def widths(self, num_aux_layers: int | None, hidden_size: int | None) -> dict[str, int]:
        """Row width of each staged tensor for a model."""
        return {t.name: t.row_width(num_aux_layers, hidden_size) for t in self.staged}

    def state_bytes(self, widths: dict[str, int]) -> int:
        """Bytes of one token's staged states (and their scales) at these widths: what a shard's size target
        counts."""
        return sum(t.dtype.itemsize * widths[t.name] for t in self.staged)

    def state_bytes_per_token(self, num_aux_layers: int, hidden_size: int) -> int:
        return self.state_bytes(self.widths(num_aux_layers, hidden_size))

    def bytes_per_token(self, num_aux_layers: int, hidden_size: int) -> dict[str, int]:
        """Bytes of one token in each per-token tensor before compression (staged states and scales,
        then the tokens' own: input_ids and the masks)."""
        widths = self.widths(num_aux_layers, hidden_size)
        per_token = {t.name: t.dtype.itemsize * widths[t.name] for t in self.staged}
        return {**per_token, **{name: SPECS[name].dtype.itemsize for name in self.token_tensors}}

    def encode(
        self, aux: torch.Tensor, last: torch.Tensor | None, num_aux_layers: int | None
    ) -> dict[str, torch.Tensor]:
        """The staged tensors of a batch's states, on the states' device (the GPU, before the copy)."""
        given = {name: state for name, state in zip(STATE_TENSORS, (aux, last)) if state is not None}
        out = {}
        for name in self.states:
            store, staged = STORES[self.store_of(name)], self.staged_of(name)
            if store.quantize is None:
                out[name] = given[name].to(store.dtype)
                continue
            layers = 1 if SPECS[name].cols == "H" else num_aux_layers
            if layers is None:
                raise ValueError(
                    f"{name} stored as {self.store_of(name)} needs the aux layers' count: each has its scales"
                )
            out.update(zip((t.name for t in staged), store.quantize(given[name], layers)))
        return out

    def decode(self, staged: dict[str, torch.Tensor], dtype: torch.dtype = STATE_DTYPE) -> dict[str, torch.Tensor]:
        """The states (in `dtype`, bf16 by default) from rows of the staged tensors, for each state that
        `staged` holds."""
        out = {}
        for name in (name for name in self.states if name in staged):
            store = STORES[self.store_of(name)]
            if store.dequantize is None:
                out[name] = staged[name].to(dtype)
            else:
                out[name] = store.dequantize(*(staged[t.name] for t in self.staged_of(name)), dtype)
        return out


class ShardError(ValueError):
    """A shard or shard directory is malformed, inconsistent, or does not contain what was asked for."""


@dataclass(frozen=True)
class SampleInfo:
    """A sample's entry in its shard's metadata."""

    index: int
    id: str
    source: str
    line: int
    source_len: int  # tokens before --max-length; of the part tokenized where a text was cut first (data/tokenization)
    truncated: bool
    images_sha256: str | None = None  # the fingerprint of its images' bytes (data/images.load_images); None: none

    def to_json(self) -> dict:
        """Its entry as the shard's metadata holds it. Every field is a scalar, so a copy of its fields is what
        dataclasses.asdict would give, at a thirtieth of its cost: a shard of short samples holds thousands,
        each serialized on a writer thread that holds the GIL the forwards' launches need."""
        return dict(vars(self))


# A RunInfo field's role. An identity fact decides every sample's bytes: a run may resume in a directory
# only with the same identity (store/manifest.py), since shards of two identities would not be one data set.
# Topology (DP, TP, batch budget, attention backend) is left out on purpose: a run may finish on different
# hardware than it started on. A provenance fact is recorded with the identity but not compared: where the
# model came from. A hub id's commit tells a reader which snapshot was used; whether two runs match is
# decided by the config and weights hashes, so the same snapshot named by path and by hub id is one run. The
# SGLang and torch versions are provenance too: another SGLang's states differ only in their last bits, and a
# resume under it is refused unless asked for (store/resume.py, `check_sglang`).
IDENTITY = "identity"
PROVENANCE = "provenance"


def _identity(default=None):
    return field(default=default, metadata={"role": IDENTITY})


def _provenance(default=None):
    return field(default=default, metadata={"role": PROVENANCE})


@dataclass(frozen=True)
class RunInfo:
    """The facts of the run that wrote a shard, as every shard, index.json and (its identity) manifest.json
    record them. A field's default is what a document written before that field existed meant, so every
    earlier version's document reads (`from_json`); None is "not recorded" (or, before the model loads,
    "not known yet": the layer ids and compute dtype SGLang decides, the tokenizer's hashes)."""

    # The identity, in the order a refused resume lists its differences.
    config_sha256: str | None = _identity()
    weights: str | None = _identity()  # the weight files' fingerprint, or "dummy (random)"
    tokenizer_sha256: str | None = _identity()
    chat_template_sha256: str | None = _identity()
    image_processor_sha256: str | None = _identity()  # a vision-language model's image processor's settings
    layer_ids: tuple[int, ...] | None = _identity()  # ascending; layer k = HF output_hidden_states[k + 1]
    final_state: FinalState | None = _identity("post-norm")  # None: the recipe keeps no final state
    recipe: RecipeName = _identity("eagle3")
    min_loss_run: int = _identity(0)
    store: Store = _identity("bf16")
    # The final state's store where it differs from `store` (Encoding.final_store: None where it does not).
    final_store: Store | None = _identity()
    compress: Compression = _identity("none")
    compute_dtype: str | None = _identity()  # the dtype the model ran in; the stored one is `stored_dtype`
    quantization: dict | None = _identity()  # the checkpoint's quantization_config
    max_length: int | None = _identity()
    overlong: Overlong | None = _identity()
    trim_after_last_loss_token: bool = _identity(False)
    # `tokenizer_files` (tokenization.tokenizer_files) lets a rerun take the recorded tokenizer hashes
    # without loading the tokenizer.
    model: str | None = _provenance()
    model_repo_id: str | None = _provenance()
    model_revision: str | None = _provenance()
    tokenizer_files: str | None = _provenance()
    tokenizer_path: str | None = None
    architecture: str | None = None
    layer_convention: str | None = None
    sglang_capture_points: tuple[int, ...] | None = None
    num_layers: int | None = None  # the model's depth
    hidden_size: int | None = None
    final_norm: dict | None = None  # final_norm.FinalNorm.to_json(): what an export converts the final state with
    tp_size: int | None = None
    attention_backend: str | None = None
    sglang_version: str | None = _provenance()
    torch_version: str | None = _provenance()
    offline_extract_version: str | None = None
    parity: tuple[dict, ...] = ()  # the parity gate's rows (--verify)
    parity_routing: list | str | None = None  # on a MoE model, how HF was routed during the gate
    # Keys this version does not know (a library caller's own), kept and written back as they were.
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # One spelling of one encoding, as Encoding has it: a resume compares the identity as recorded.
        object.__setattr__(self, "final_store", self.encoding.final_store)

    @property
    def encoding(self) -> Encoding:
        return Encoding(
            self.store, self.compress, keeps_final_state=self.final_state is not None, final_store=self.final_store
        )

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype the aux states' values are stored in (`compute_dtype` is the one the model ran in)."""
        return STORES[self.store].dtype

    @property
    def num_aux_layers(self) -> int | None:
        """k, the number of captured layers side by side in aux_hidden_states; None when not recorded."""
        return None if self.layer_ids is None else len(self.layer_ids)

    def to_json(self) -> dict:
        document = dict(self.extra)
        for f in fields(self):
            if f.name != "extra":
                value = getattr(self, f.name)
                document[f.name] = list(value) if isinstance(value, tuple) else value
        return document

    def identity(self) -> dict:
        """The identity and provenance facts, as JSON values (manifest.json's `identity` adds the corpus)."""
        document = self.to_json()
        return {name: document[name] for name in IDENTITY_KEYS + PROVENANCE_KEYS}

    @classmethod
    def from_json(cls, document: dict, where: str) -> "RunInfo":
        """The run a document records, whichever version wrote it; a value of the wrong type is a ShardError
        naming `where` (the file) and the key."""
        if not isinstance(document, dict):
            raise ShardError(f"{where}: the run is {type(document).__name__}, not a JSON object")
        types = _field_types()
        facts: dict[str, Any] = {}  # each checked against its field's type (`_fits`)
        extra = {}
        for key, value in document.items():
            if key in RETIRED_KEYS:
                continue
            if key not in types:
                extra[key] = value
            elif not _fits(value, types[key]):
                raise ShardError(f"{where}: run key {key!r} is {value!r}, expected {_described(types[key])}")
            else:
                facts[key] = tuple(value) if isinstance(value, list) and _options(types[key])[0] is not list else value
        return cls(**facts, extra=extra)


IDENTITY_KEYS = tuple(f.name for f in fields(RunInfo) if f.metadata.get("role") == IDENTITY)
PROVENANCE_KEYS = tuple(f.name for f in fields(RunInfo) if f.metadata.get("role") == PROVENANCE)
# Keys earlier versions wrote that a RunInfo no longer holds: "dtype" was the stored dtype, which follows
# from store (RunInfo.stored_dtype).
RETIRED_KEYS = ("dtype",)


def _field_types() -> dict:
    return {name: hint for name, hint in get_type_hints(RunInfo).items() if name != "extra"}


def _options(hint) -> tuple:
    """The types a field's value may take: `X | None` -> (X, NoneType)."""
    return get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)


def _fits(value, hint) -> bool:
    """Whether a JSON value fits a field's type (a tuple field reads a JSON list)."""
    for option in _options(hint):
        origin = get_origin(option)
        if origin is Literal:
            fits = value in get_args(option)
        elif origin is tuple:
            fits = isinstance(value, list) and all(_fits(v, get_args(option)[0]) for v in value)
        else:
            kind = origin or option
            fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if fits:
            return True
    return False


def _described(hint) -> str:
    words = []
    for option in _options(hint):
        origin = get_origin(option)
        if option is type(None):
            words.append("null")
        elif origin is Literal:
            words.append(" or ".join(map(repr, get_args(option))))
        elif origin is tuple:
            words.append(f"a list of {get_args(option)[0].__name__}")
        else:
            words.append((origin or option).__name__)
    return " or ".join(words)
