"""A run's options, stated once: each option's type, default, help and, for a choice, the values it may take.

On the bottom floor, where importing it costs neither torch nor SGLang, so that `--help` and a mistyped
option answer at once. The command line takes its choices and defaults from here; the modules that
implement a choice key their tables by these names and check a value with `check_choice`. The options come in
groups, the sections of `--help` (`GROUPS`), each stating its own; `ExtractOptions` is all of them in one value.
"""

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

Device = Literal["cuda", "cpu"]
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: the checkpoint's
Overlong = Literal["truncate", "skip"]  # a sample longer than max_length (data/tokenization.py)
Nonfinite = Literal["fail", "drop", "keep"]  # a sample whose states hold NaN or Inf (engine/nonfinite.py)
FinalState = Literal["post-norm", "pre-norm"]  # which final state Captured.last holds (engine/sglang_adapter.py)
RecipeName = Literal["eagle3", "dflash", "dspark"]  # recipes.RECIPES
Store = Literal["bf16", "fp8", "nvfp4"]  # how the states are stored (store/schema.py STORES)
Compression = Literal["none", "zstd"]  # store/codecs.py

# One forward's token budget when tokens_per_batch is not given, by device type.
DEFAULT_TOKENS_PER_BATCH = {"cuda": 16384, "cpu": 4096}
# ...and on a GPU for a dense model of at most SMALL_MODEL_HIDDEN: its forward of 16k tokens takes a few
# milliseconds, beside which what every batch costs the host (its launches, copy and shard work) halves the
# rate; four times the tokens a forward pay it a quarter as often (benchmarks/README.md, "Small dense model").
# Not for a MoE model, whose warm-up compiles per token count up to the budget.
SMALL_MODEL_HIDDEN = 1024
SMALL_MODEL_TOKENS_PER_BATCH = 65536


# Shard-writing threads when writers is not given...
DEFAULT_WRITERS = 4
# ...and for a small model on a GPU, whose states reach the host fastest: faster than 4 writers write them
# into tmpfs, where 8 keep up (benchmarks/README.md, "Small dense model"). Each writer holds a shard buffer
# (--shard-size-mb) of host memory.
SMALL_MODEL_WRITERS = 8


def _small_model(device_type: str, hidden_size: int, moe: bool) -> bool:
    return device_type == "cuda" and hidden_size <= SMALL_MODEL_HIDDEN and not moe


def default_tokens_per_batch(device_type: str, hidden_size: int, moe: bool) -> int:
    """ExtractOptions.tokens_per_batch's default (DEFAULT_TOKENS_PER_BATCH, SMALL_MODEL_TOKENS_PER_BATCH)."""
    if _small_model(device_type, hidden_size, moe):
        return SMALL_MODEL_TOKENS_PER_BATCH
    return DEFAULT_TOKENS_PER_BATCH[device_type]


def default_writers(device_type: str, hidden_size: int, moe: bool) -> int:
    """ExtractOptions.writers's default (DEFAULT_WRITERS, SMALL_MODEL_WRITERS)."""
    return SMALL_MODEL_WRITERS if _small_model(device_type, hidden_size, moe) else DEFAULT_WRITERS


# port_base when not given, under torchrun (alone, any free port serves; engine/distributed.py).
DEFAULT_PORT_BASE = 29600
# image_threads when not given: the cores this process may run on, at most this many. On a 16-core GPU host, 4
# prepare images faster than a 7B model's forwards take them; more threads do not feed it faster but take the
# host from the forwards' own thread and the writers, and the forwards run slower beside them
# (benchmarks/README.md, "Vision-language").
MOST_IMAGE_THREADS = 4


def default_image_threads() -> int:
    """ExtractOptions.image_threads's default (MOST_IMAGE_THREADS)."""
    return max(1, min(MOST_IMAGE_THREADS, len(os.sched_getaffinity(0))))


# tokenizer_processes when not given, on a GPU for a text-only model: a quarter of this process's share of the
# cores it may run on (the node's ranks share them), at most this many. One process tokenizes a small model's
# chats at about half the rate a GPU prefills them, so a few keep ahead of it (benchmarks/README.md, "Storage and
# the host side").
MOST_TOKENIZER_PROCESSES = 4


def default_tokenizer_processes(device_type: str, images: bool, local_ranks: int = 1) -> int:
    """ExtractOptions.tokenizer_processes's default (MOST_TOKENIZER_PROCESSES) for one of `local_ranks` ranks
    on its node: none on CPU, whose forwards take far longer than tokenizing, nor for a model with images
    (`TokenizerProcesses`)."""
    if device_type != "cuda" or images:
        return 0
    return max(1, min(MOST_TOKENIZER_PROCESSES, len(os.sched_getaffinity(0)) // local_ranks // 4))


def cache_root() -> Path:
    """Where what is built once per machine is kept (the embedded model; compiled kernels, --jit-cache's
    default): $XDG_CACHE_HOME/offline_extract, else ~/.cache/offline_extract, as other tools keep theirs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offline_extract"


@dataclass(frozen=True)
class Cli:
    """How an ExtractOptions field is given on the command line: commands/extract.py makes its click option
    from this and the field's type (a Literal: its choices; bool: a flag; tuple[str, ...]: repeatable;
    tuple[int, ...]: comma-separated) and default (shown unless None or a flag); its `--help` section is the
    group that states it (`GROUPS`)."""

    help: str
    flag: str | None = None  # its name on the command line; None: --the-field-name
    inverse: bool = False  # a flag that turns off a field that is on by default (--no-progress)
    minimum: float | None = None  # the least value taken
    minimum_taken: bool = True  # whether `minimum` itself is taken
    unit: int = 1  # the command line gives the value in units of this many (--shard-size-mb: 1 MiB)
    directory: bool = False  # a directory's path


def _option(default=MISSING, **cli):
    return field(default=default, metadata={"cli": Cli(**cli)})


@dataclass(frozen=True, kw_only=True)
class InputOptions:
    """The corpus, and how its records become samples."""

    data: tuple[str, ...] = _option(
        help="Corpus: a .jsonl or .jsonl.gz file (JSONL also through a pipe, or - for standard input, read once: "
        "not with --strict or torchrun), a .json file of one JSON array (read whole into memory: convert a large one to "
        "JSONL), a .parquet file, a datasets.save_to_disk folder, or a hub "
        "data set id (org/name, or org/name:split; the local hub cache first, HF_HUB_OFFLINE honoured). "
        "Repeat for several (records are numbered across them in order).",
    )
    max_length: int = _option(
        4096,
        help="Longest sample in tokens, at most the model's context length; a longer one is cut or skipped "
        "(--overlong).",
    )
    overlong: Overlong = _option(
        "truncate",
        help="What to do with a sample longer than --max-length (recorded per sample either way). A "
        "truncated sample whose loss tokens all lay past the cut is skipped, listed in rejects.jsonl "
        "and counted as skipped: it has nothing left to train on.",
    )
    trim_after_last_loss: bool = _option(
        False,
        flag="--trim-after-last-loss-token",
        help="Drop each sample's tokens after its last loss token (they carry no training signal).",
    )
    strict: bool = _option(
        False,
        help="Stop at the first bad record in corpus order (named by source and line) instead of listing it in "
        "rejects.jsonl. Every record is read and tokenized first (each replica its share), so the run stops "
        "before the model loads and writes nothing.",
    )


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The checkpoint, and how SGLang loads and runs it."""

    model: str | None = _option(  # None: the embedded tiny Llama, on CPU
        None,
        help="HF model directory, or a hub id (org/name) taken from the local hub cache, else downloaded "
        "unless HF_HUB_OFFLINE is set; the commit it resolved to is recorded. Default: the embedded tiny "
        "random Llama, built once into $XDG_CACHE_HOME/offline_extract (~/.cache/offline_extract), run "
        "on CPU.",
    )
    device: Device | None = _option(  # None: cuda if available, else cpu
        None,
        help="Default: cpu for the embedded tiny model (no --model), also on a GPU machine; otherwise cuda when a "
        "GPU is visible, else cpu. A cpu run hides the GPUs from its own process (SGLang chooses its kernels "
        "from whether torch sees a GPU).",
    )
    dtype: ComputeDtype = _option(
        "auto",
        help="Compute dtype (auto = the checkpoint's; float32 on CPU only, SGLang's CUDA kernels take half "
        "precision). How the states are stored is --store's.",
    )
    attention_backend: str | None = _option(
        None,
        help="SGLang attention backend. Default: fa3 on Hopper when installed, else triton; torch_native on CPU.",
    )
    load_format: str = _option(
        "auto",
        help="SGLang load format; 'dummy' gives random weights (benchmarks only; refused with --verify, whose HF "
        "reference reads the real ones).",
    )
    trust_remote_code: bool = _option(False, help="Allow model code from the model directory.")


@dataclass(frozen=True, kw_only=True)
class LayerOptions:
    """Which states each sample keeps, for which drafter."""

    layers: tuple[int, ...] | None = _option(
        None,
        help="Comma-separated layer ids stored as aux_hidden_states (id k = output of decoder layer k). "
        "Default: the --recipe's: SGLang's EAGLE-3 default for the model under eagle3, e.g. "
        "[1, N/2-1, N-4] for Llama; 5 layers spread over 1..N-3 under dflash and dspark.",
    )
    final_state: FinalState = _option(
        "post-norm",
        help="Which final state to store as hidden_states: after the model's final norm (SGLang's EAGLE-3 and "
        "SpecForge train on it) or before it (vLLM and speculators store this one and apply the "
        "verifier's norm while training). A drafter trained on the other one is silently wrong.",
    )
    recipe: RecipeName = _option(
        "eagle3",
        help="Which drafter the states are for (SpecForge's data preparation). eagle3: SGLang's EAGLE-3 "
        "layers plus the final state. dflash (also Domino): 5 layers spread evenly over 1..N-3, no final "
        "state, and only samples with consecutive loss tokens. dspark: the dflash layers and rule plus "
        "the final state. --layers overrides the layers; the recipe is recorded in the manifest.",
    )
    min_loss_run: int | None = _option(  # None: the recipe's
        None,
        minimum=0,
        help="Skip samples without this many consecutive loss tokens (listed in rejects.jsonl as skipped). "
        "Default: the recipe's (dflash, dspark: 2; eagle3: no rule).",
    )


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """Where the shards go, their size, and how their states are stored."""

    out: str = _option(
        "out",
        directory=True,
        help="Output directory for shards, index.json, manifest.json and rejects.jsonl.",
    )
    shard_bytes: int = _option(
        512 << 20,
        flag="--shard-size-mb",
        unit=1 << 20,
        minimum=0,
        minimum_taken=False,
        help="Target hidden-state MiB per shard (a shard closes once it reaches this).",
    )
    writers: int | None = (
        _option(  # shard-writing threads (one file each), writers + 1 shard buffers; None: default_writers
            None,
            minimum=1,
            help="Threads writing shards, one file each, side by side; host memory holds writers + 1 shard "
            "buffers. Raise it when one writing rank produces states faster than that many files at once "
            "can take (TP on many GPUs, a fast array) or zstd's compression, which these threads also run, "
            f"falls behind. Default: {DEFAULT_WRITERS} ({SMALL_MODEL_WRITERS} on GPU for a dense model of hidden "
            f"size {SMALL_MODEL_HIDDEN} or less).",
        )
    )
    store: Store = _option(
        "bf16",
        help="How states are stored, quantized on the GPU before the copy to host, decoded to bf16 by every reader. "
        "fp8: e4m3, a float32 scale per token per layer (absmax/448): half a state's bytes. nvfp4: 4-bit e2m1, an "
        "e4m3 scale per 16, a float32 one per token per layer: 0.29 of them.",
    )
    # The final state gives the trainer its target logits; docs/usage.md#storage shows 4 bits hold acceptance.
    final_store: Store | None = _option(
        None, help="The final state's store (fp8, or bf16 for exact target logits). Default: --store's."
    )
    compress: Compression = _option(
        "none",
        help="zstd: lossless, one frame per sample per state tensor with its bytes grouped by significance; "
        "compressed by the writer threads. Saves most on bf16 states; costs CPU while writing.",
    )


@dataclass(frozen=True, kw_only=True)
class ParallelismOptions:
    """The ranks, the forwards' batches, and the host's threads and processes that feed them."""

    tp: int = _option(1, help="Tensor-parallel size; world size / tp replicas run data-parallel.")
    tokens_per_batch: int | None = _option(  # None: default_tokens_per_batch of the device and model
        None,
        help=f"Token budget of one forward. Default: {DEFAULT_TOKENS_PER_BATCH['cuda']} on GPU "
        f"({SMALL_MODEL_TOKENS_PER_BATCH} for a dense model of hidden size {SMALL_MODEL_HIDDEN} or less), "
        f"{DEFAULT_TOKENS_PER_BATCH['cpu']} on CPU. A longer sample is prefilled alone, in chunks of "
        "--chunk-tokens.",
    )
    chunk_tokens: int | None = _option(  # for samples longer than tokens_per_batch; None: tokens_per_batch
        None,
        help="Tokens a forward when a sample longer than --tokens-per-batch is prefilled in chunks. "
        "Default: --tokens-per-batch.",
    )
    seqs_per_batch: int = _option(256, help="Most sequences in one forward.")
    image_threads: int | None = _option(  # None: default_image_threads
        None,
        minimum=1,
        help="Threads decoding image chats' images and preparing them with the model's HF processor, side by "
        "side, ahead of the forwards (the records keep their order). Default: the cores this process may "
        f"run on, at most {MOST_IMAGE_THREADS}.",
    )
    tokenizer_processes: int | None = _option(  # None: default_tokenizer_processes
        None,
        minimum=0,
        help="Processes tokenizing the records (chat templates, the tokenizer) ahead of the forwards, beside "
        "this one, whose thread launching the forwards would otherwise share the GIL with that Python; 0: a "
        "thread of this process. Default: on a GPU for a text-only model, a quarter of this process's share of "
        "the cores it may run on (shared with the node's other ranks), at most "
        f"{MOST_TOKENIZER_PROCESSES}; 0 on CPU and for a model with images.",
    )
    mem_fraction_static: float = _option(0.85, help="GPU memory fraction for weights plus the (prefill-sized) KV pool.")
    port_base: int | None = _option(  # None: DEFAULT_PORT_BASE under torchrun, else a free port
        None,
        help="Each data-parallel replica's SGLang rendezvous uses port-base + dp_rank. "
        f"Default: a free port alone, {DEFAULT_PORT_BASE} under torchrun.",
    )


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The parity gate before the run, what it shows, and what it does when a check says no or a state is not finite."""

    parity_samples: int = (
        _option(  # --verify N: the HF parity gate's samples a replica (integrity is store.integrity.verify)
            0,
            flag="--verify",
            help="Before extracting, compare each replica's first N samples against HF transformers and stop "
            "on mismatch. HF loads the whole model on the GPU of each replica's tp_rank 0, so for a model "
            "that needs TP, verify a smaller sibling of the same architecture. 0: no gate.",
        )
    )
    progress: bool = _option(
        True,
        inverse=True,
        help="No progress bar (e.g. for logs): a line every --progress-every seconds instead. The bar or lines "
        "also follow --dry-run's and --strict's pass through the corpus.",
    )
    progress_every: float = _option(  # without the bar (progress=False): a progress line this often, in seconds
        60.0,
        minimum=0,
        help="With --no-progress, seconds between progress lines (samples, tokens, tok/s, bytes written, ETA); "
        "0: none.",
    )
    verbose: bool = _option(
        False,
        help="Also show what SGLang, torch and HF print while loading (warnings, log lines, loading bars); "
        "without it they are shown only if loading fails.",
    )
    nonfinite: Nonfinite = _option(
        "fail",
        help="A sample whose hidden states hold NaN or Inf: stop the run, drop it (listed in rejects.jsonl "
        "as dropped), or keep it with a warning.",
    )
    force: bool = _option(
        False,
        help="Go ahead even if a check says no: --dry-run's free space, or resuming into an --out whose "
        "manifest records another corpus (right when records were only appended). An --out holding "
        "shards of another model, tokenizer, layers, compute dtype or length policy is refused even so, "
        "before anything is written: mixed, its shards would not be one data set.",
    )
    allow_other_sglang: bool = _option(
        False,
        help="Resume into an --out whose shards were extracted under another SGLang version than the one "
        "installed, which is refused otherwise: the states of two versions differ in their last bits, so the "
        "directory would mix them.",
    )
    jit_cache: str | None = _option(  # None: the engine's default
        None,
        directory=True,
        help="Where the kernels SGLang compiles on first use (Triton, nvcc-built modules, Inductor, "
        "FlashInfer and its CuTe DSL kernels, DeepGEMM) are kept between runs; a cold cache costs the first "
        "run tens of seconds. Keep it on storage that outlives the machine or container. Variables such as TRITON_CACHE_DIR "
        "that are already set win. Default: $XDG_CACHE_HOME/offline_extract (~/.cache/offline_extract).",
    )
    warm_up: bool = _option(
        True,
        inverse=True,
        help="Skip the throwaway batch that compiles those kernels right after the model loads (then the "
        "first real batch compiles them; start-up and tail are printed and kept in manifest.json either "
        "way).",
    )


# The sections of `bin/extract.py --help`, in its order, by their titles: each group's fields are its options.
GROUPS = {
    InputOptions: "Input",
    ModelOptions: "Model",
    LayerOptions: "Layers and final state",
    StorageOptions: "Output and storage",
    ParallelismOptions: "Parallelism and batching",
    RunOptions: "Run",
}


# Its bases in reverse of GROUPS: a dataclass takes its bases' fields last base first, so that its fields, and the
# command's options, come in GROUPS' order.
@dataclass(frozen=True, kw_only=True)
class ExtractOptions(RunOptions, ParallelismOptions, StorageOptions, LayerOptions, ModelOptions, InputOptions):
    """Every option of a run, one value: each option is stated once, in its group, and taken by its own name
    here (`ExtractOptions(data=..., out=...)`, `opts.store`); a choice's value is checked as the options are made."""

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
    name: values
    for name, hint in get_type_hints(ExtractOptions).items()
    if (values := _literal_values(hint)) is not None
}
_DEFAULTS = {f.name: f.default for f in fields(ExtractOptions) if f.default is not MISSING}


def choices(option: str) -> tuple[str, ...]:
    """The values `option` (an ExtractOptions field) may take, in the order the command line lists them."""
    return _CHOICES[option]


def default(option: str):
    """The default of `option` (an ExtractOptions field), for the command line to show."""
    return _DEFAULTS[option]


def is_choice(option: str) -> bool:
    """Whether `option` (an ExtractOptions field) takes one of fixed values."""
    return option in _CHOICES


def check_choice(option: str, value: str) -> None:
    """Raises ValueError naming `option` and its values unless `value` is one of them."""
    if value not in _CHOICES[option]:
        raise ValueError(f"{option} must be one of {', '.join(_CHOICES[option])}, got {value!r}")


def final_store(opts: ExtractOptions) -> Store:
    """The store of the run's final state: --final-store, else --store."""
    return opts.final_store or opts.store


# What each final state is, in the words the run metadata records. Trainers disagree, and a drafter fed
# the other one is silently wrong (GPT-OSS drafters broke exactly so, sglang#32334).
FINAL_STATES = dict(
    zip(
        choices("final_state"),
        (
            "the last decoder layer's output after the model's final norm (SGLang's EAGLE-3 and SpecForge)",
            "the last decoder layer's output before the model's final norm (vLLM and speculators, which "
            "apply the verifier's norm at training time)",
        ),
        strict=True,
    )
)
