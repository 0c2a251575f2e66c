"""A run's options, stated once: each option's type, default and, for a choice, the values it may take.

On the bottom floor, where importing it costs neither torch nor SGLang, so that `--help` and a mistyped
option answer at once. The command line takes its choices and defaults from here; the modules that
implement a choice key their tables by these names and check a value with `check_choice`.
"""
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

Device = Literal["cuda", "cpu"]
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: the checkpoint's
Overlong = Literal["truncate", "skip"]  # a sample longer than max_length (data/tokenization.py)
Nonfinite = Literal["fail", "drop", "keep"]  # a sample whose states hold NaN or Inf (engine/nonfinite.py)
FinalState = Literal["post-norm", "pre-norm"]  # which final state Captured.last holds (engine/sglang_adapter.py)
RecipeName = Literal["eagle3", "dflash", "dspark"]  # recipes.RECIPES
Store = Literal["bf16", "fp8"]  # the stored dtype of the states (store/schema.py STORES)
Compression = Literal["none", "zstd"]  # store/codecs.py

# One forward's token budget when tokens_per_batch is not given, by device type.
DEFAULT_TOKENS_PER_BATCH = {"cuda": 16384, "cpu": 4096}
# port_base when not given, under torchrun (alone, any free port serves; engine/distributed.py).
DEFAULT_PORT_BASE = 29600


def cache_root() -> Path:
    """Where what is built once per machine is kept (the embedded model; compiled kernels, --jit-cache's
    default): $XDG_CACHE_HOME/offline_extract, else ~/.cache/offline_extract, as other tools keep theirs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offline_extract"


@dataclass(frozen=True)
class ExtractOptions:
    data: tuple[str, ...]
    out: str = "out"
    model: str | None = None  # None: the embedded tiny Llama, on CPU
    device: Device | None = None  # None: cuda if available, else cpu
    dtype: ComputeDtype = "auto"
    tp: int = 1
    layers: tuple[int, ...] | None = None
    max_length: int = 4096
    overlong: Overlong = "truncate"
    tokens_per_batch: int | None = None  # None: DEFAULT_TOKENS_PER_BATCH of the device
    chunk_tokens: int | None = None  # for samples longer than tokens_per_batch; None: tokens_per_batch
    seqs_per_batch: int = 256
    shard_bytes: int = 512 << 20
    writers: int = 4  # shard-writing threads (one file each) and so shard buffers in flight, writers + 1
    attention_backend: str | None = None
    load_format: str = "auto"
    mem_fraction_static: float = 0.85
    port_base: int | None = None  # None: DEFAULT_PORT_BASE under torchrun, else a free port
    parity_samples: int = 0  # --verify N: the HF parity gate's samples a replica (integrity is store.integrity.verify)
    trim_after_last_loss: bool = False
    trust_remote_code: bool = False
    progress: bool = True
    progress_every: float = 60.0  # without the bar (progress=False): a progress line this often, in seconds; 0: none
    verbose: bool = False  # show what SGLang, torch and HF print while loading
    strict: bool = False
    nonfinite: Nonfinite = "fail"
    final_state: FinalState = "post-norm"
    recipe: RecipeName = "eagle3"
    min_loss_run: int | None = None  # None: the recipe's
    store: Store = "bf16"
    compress: Compression = "none"
    force: bool = False  # resume into an output directory written by a different run
    jit_cache: str | None = None  # where compiled kernels are kept between runs; None: the engine's default
    warm_up: bool = True  # on a GPU, compile what the forward compiles on first use before the first real batch

    def __post_init__(self):
        for name in _CHOICES:
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name))


def _literal_values(hint) -> tuple[str, ...] | None:
    """The values of a Literal type, or of the Literal in `Literal[...] | None`; None for other types."""
    for t in (hint, *get_args(hint)):
        if get_origin(t) is Literal:
            return get_args(t)
    return None


_CHOICES = {
    name: values for name, hint in get_type_hints(ExtractOptions).items()
    if (values := _literal_values(hint)) is not None
}
_DEFAULTS = {f.name: f.default for f in fields(ExtractOptions) if f.default is not MISSING}


def choices(option: str) -> tuple[str, ...]:
    """The values `option` (an ExtractOptions field) may take, in the order the command line lists them."""
    return _CHOICES[option]


def default(option: str):
    """The default of `option` (an ExtractOptions field), for the command line to show."""
    return _DEFAULTS[option]


def check_choice(option: str, value: str) -> None:
    """Raises ValueError naming `option` and its values unless `value` is one of them."""
    if value not in _CHOICES[option]:
        raise ValueError(f"{option} must be one of {', '.join(_CHOICES[option])}, got {value!r}")


# What each final state is, in the words the run metadata records. Trainers disagree, and a drafter fed
# the other one is silently wrong (GPT-OSS drafters broke exactly so, sglang#32334).
FINAL_STATES = dict(zip(choices("final_state"), (
    "the last decoder layer's output after the model's final norm (SGLang's EAGLE-3 and SpecForge)",
    "the last decoder layer's output before the model's final norm (vLLM and speculators, which "
    "apply the verifier's norm at training time)",
), strict=True))
