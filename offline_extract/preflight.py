"""What a run can know is wrong before the engine starts, answered in seconds and before the output
directory is touched: the options, the corpus sources (a missing file, an uncached hub data set), the
model (a directory or a hub id; its architecture, depth and context length, read from its config, whose
sizes are held against its weights' names and headers) and the device. A real run and --dry-run make
exactly these checks, so a dry run that passes means the real one starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from offline_extract import hub
from offline_extract.data.sources import Source, open_sources
from offline_extract.default_model import ensure_tiny_model
from offline_extract.engine.checkpoint import DAMAGED_MODEL_FILE, SIZES_SHOWN, check_config_sizes
from offline_extract.engine.distributed import layout_from_env
from offline_extract.engine.moe import routed_expert_count
from offline_extract.engine.reference import wrapped_text_config
from offline_extract.engine.sglang_adapter import (
    CONTEXT_KEYS,
    capture_rule,
    check_engine_choices,
    context_length,
    hide_gpus,
    validate_layer_ids,
)
from offline_extract.options import ExtractOptions, default, default_tokens_per_batch, default_writers, final_store
from offline_extract.recipes import RECIPES
from offline_extract.store import manifest
from offline_extract.store.index import shard_paths
from offline_extract.store.journal import load_json
from offline_extract.store.schema import INDEX_NAME, REJECTS_FILE, STORES


@dataclass(frozen=True)
class Model:
    """A model as its config describes it; `repo_id` and `revision` are set when it was named by hub id."""

    path: Path
    architecture: str
    num_layers: int
    hidden_size: int
    context_length: int
    context_key: str
    moe: bool = False  # routed experts in its decoder
    repo_id: str | None = None
    revision: str | None = None

    @property
    def provenance(self) -> dict:
        """Where the weights came from, for the run metadata."""
        return {"model_repo_id": self.repo_id, "model_revision": self.revision}


@dataclass(frozen=True)
class Checked:
    model: Model
    device: str
    tokens_per_batch: int
    writers: int
    sources: list[Source]
    layer_ids: tuple[int, ...] | None  # validated and sorted; None: SGLang's EAGLE-3 default, resolved by the engine

    @property
    def corpus_paths(self) -> list[Path]:
        """What the corpus is on disk (a hub data set's snapshot folder), for its fingerprint."""
        return [source.path for source in self.sources]


def check(opts: ExtractOptions) -> Checked:
    """Every check that needs neither SGLang nor the output directory; raises with what to change (the
    options' choices were checked when they were made)."""
    for name, value, least in (
        ("--tp", opts.tp, 1),
        ("--max-length", opts.max_length, 1),
        ("--seqs-per-batch", opts.seqs_per_batch, 1),
        ("--tokens-per-batch", opts.tokens_per_batch, 1),
        ("--chunk-tokens", opts.chunk_tokens, 1),
        ("--verify", opts.parity_samples, 0),
    ):
        if value is not None and value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if not 0 < opts.mem_fraction_static <= 1:
        # SGLang would take it and fail only once the model is loaded, with a message about its KV pool.
        raise ValueError(
            f"--mem-fraction-static is a fraction of the GPU's memory, above 0 and at most 1, got {opts.mem_fraction_static}"
        )
    replicas = layout_from_env(opts.tp).dp_size  # refuses a --tp that does not divide the processes per node
    if opts.port_base is not None:
        # SGLang takes any integer and refuses it only once the model is loaded, without naming the option.
        last = 65536 - replicas
        if not 1 <= opts.port_base <= last:
            each = f" for {replicas} data-parallel replicas (each uses port-base + its rank)" if replicas > 1 else ""
            raise ValueError(f"--port-base is a TCP port, from 1 to {last}{each}, got {opts.port_base}")
    check_out(opts.out)
    check_engine_choices(opts.attention_backend, opts.load_format)
    if opts.load_format == "dummy" and opts.parity_samples:
        # The gate runs HF on the checkpoint's weights, and SGLang's dummy loader draws its own: it would fail
        # after the model load, on every layer.
        raise ValueError(
            f"--verify {opts.parity_samples} compares the states with HF on the model's own weights, but "
            "--load-format dummy gives SGLang random ones, so the gate cannot pass: leave out --verify, or load the weights"
        )
    sources = open_sources(opts.data)
    _check_pipes(sources, opts.strict)
    _check_out_outside_the_corpus(opts.out, sources)
    device = resolve_device(opts.device, embedded_model=opts.model is None)
    if torch.device(device).type == "cpu":
        hide_gpus()  # now, before resolve_model may import transformers, which asks the CUDA driver
    check_dtype(device, opts.dtype)
    model = resolve_model(opts.model, opts.trust_remote_code, weights=opts.load_format != "dummy")
    recipe = RECIPES[opts.recipe]
    _check_storage(opts, model)
    layer_ids = opts.layers if opts.layers is not None else recipe.layer_ids(model.num_layers)
    if layer_ids is not None:
        layer_ids = validate_layer_ids(layer_ids, model.num_layers)
    if opts.max_length > model.context_length:
        raise ValueError(
            f"--max-length {opts.max_length} is longer than the model's context of {model.context_length} tokens "
            f"({model.context_key} in {model.path / 'config.json'}); lower --max-length to at most "
            f"{model.context_length}"
        )
    device_type = torch.device(device).type
    tokens_per_batch = opts.tokens_per_batch or default_tokens_per_batch(device_type, model.hidden_size, model.moe)
    writers = opts.writers or default_writers(device_type, model.hidden_size, model.moe)
    return Checked(model, device, tokens_per_batch, writers, sources, layer_ids)


def _check_storage(opts: ExtractOptions, model: Model) -> None:
    """The final state's options against the recipe, and each store's blocks against the model's width."""
    if not RECIPES[opts.recipe].keeps_final_state:
        for field, flag in (("final_state", "--final-state"), ("final_store", "--final-store")):
            if getattr(opts, field) != default(field):
                raise ValueError(
                    f"--recipe {opts.recipe} stores no final state, so {flag} {getattr(opts, field)} has no effect"
                )
    for option, store in (("--store", opts.store), ("--final-store", final_store(opts))):
        block = STORES[store].block
        if model.hidden_size % block:
            raise ValueError(
                f"{option} {store} scales blocks of {block} elements, but {model.path / 'config.json'} gives a hidden "
                f"size of {model.hidden_size}, not a multiple of {block}: give {option} fp8 or bf16"
            )


def check_out(out: str) -> None:
    """--out names a directory that can be made there, and holds no manifest.json that a run did not write. An
    empty name would put the run's files into the current directory, a file on its path (or a symbolic link that loops
    or leads nowhere) would fail the run at its first write, after the model load, and another tool's manifest.json
    (an existing folder named by mistake) would be merged into this run's."""
    if not str(out).strip():
        raise ValueError("--out is empty: name the output directory (it is made if it does not exist)")
    existing = Path(out)
    while not existing.exists():
        if existing.is_symlink():  # one that loops or leads nowhere: making the directory would fail at the run
            raise ValueError(
                f"--out {out} cannot be made: {_broken_link(existing)}. Remove the link, or point it at a directory"
            )
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == Path(out) else f"cannot be made: {existing} is a file"
        raise ValueError(f"--out {out} {where}, not a directory")
    try:
        recorded = manifest.load(out)
    except manifest.ForeignManifest as e:
        raise ValueError(
            f"--out {out}: {e}. A run neither builds on nor overwrites a manifest it did not write, so nothing there "
            f"was touched: choose a new or empty directory for --out (if this is an extraction whose manifest.json "
            f"was damaged, move that file away and re-run with --force: the shards name their run themselves)"
        ) from None
    # A run writes its manifest before any of these, so without it and without shards they are someone else's.
    theirs = [name for name in (INDEX_NAME, REJECTS_FILE) if (Path(out) / name).exists()]
    if recorded is None and theirs and not shard_paths(out):
        raise ValueError(
            f"--out {out} holds {' and '.join(theirs)} but neither {manifest.MANIFEST_NAME} nor shards: no run wrote "
            f"{'it' if len(theirs) == 1 else 'them'}, and this one would overwrite {'it' if len(theirs) == 1 else 'them'}. "
            f"Choose a new or empty directory for --out"
        )


def _broken_link(link: Path) -> str:
    """What is wrong with the symbolic link `link`, which leads to nothing: the loop it is part of, or where it ends."""
    chain = [str(link)]
    at = link
    while at.is_symlink() and len(chain) <= 40:  # the kernel's own limit on links followed
        at = Path(os.path.normpath(at.parent / os.readlink(at)))
        if str(at) in chain:
            return f"{link} is a symbolic link that loops ({' -> '.join(chain + [str(at)])})"
        chain.append(str(at))
    return f"{link} is a symbolic link to {' -> '.join(chain[1:])}, which does not exist"


def _check_pipes(sources: list[Source], strict: bool) -> None:
    """A pipe is read once, as it streams: refused where the run would read it more than once."""
    pipes = [source.name for source in sources if source.streamed]
    if not pipes:
        return
    readers = []
    if strict:
        readers.append("--strict reads the corpus once before the run reads it again")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        readers.append("every torchrun rank reads the corpus")
    if readers:
        raise ValueError(
            f"--data {', '.join(pipes)} is a pipe, which can be read only once, but {' and '.join(readers)}: "
            f"save it to a file first (a .jsonl.gz keeps it small)"
        )


def _check_out_outside_the_corpus(out: str, sources: list[Source]) -> None:
    """--out is not inside a corpus folder (a saved or a hub data set), whose fingerprint takes in every file there:
    the run's own files would change the corpus it recorded, and the run would never be marked complete
    (`output.OutputDirectory._check_corpus_unchanged`)."""
    where = Path(out).resolve()
    for source in sources:
        if source.path.is_dir() and where.is_relative_to(source.path.resolve()):
            raise ValueError(
                f"--out {out} is inside the corpus folder --data {source.name}, every file of which the corpus's "
                f"fingerprint takes in: the run's own files would change the corpus it records, and the run would "
                f"never be marked complete. Choose an --out outside {source.name}"
            )


def check_dtype(device: str, dtype: str) -> None:
    if torch.device(device).type == "cuda" and dtype == "float32":
        raise ValueError(
            "--dtype float32 does not run on CUDA: SGLang 0.5.17's CUDA kernels (sgl_kernel's RMSNorm among "
            "them) take float16 and bfloat16 only. Use --dtype bfloat16 (the parity gate then checks every "
            "token's cosine against HF), or --device cpu to extract and verify in float32."
        )


def resolve_device(device: str | None, embedded_model: bool = False) -> str:
    """--device, or its default: the CPU for the embedded tiny model, as documented (it exists to run the main
    command in seconds and prove parity in float32 there; on a GPU its head dim, 16, has no FlashInfer kernel,
    tests/gpu/test_gpu_architectures.py); else a GPU if one is visible. The embedded model's run and a --device cpu
    run never ask the CUDA driver anything here, so that they can still hide the GPUs from SGLang (`hide_gpus`)."""
    if device is None:
        return "cpu" if embedded_model or not torch.cuda.is_available() else "cuda"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch sees no CUDA GPU here; use --device cpu, or leave it out")
    return device


def resolve_model(name: str | None, trust_remote_code: bool = False, weights: bool = True) -> Model:
    """The embedded tiny model (None), a local directory, or a hub id through the local cache (`read_model`)."""
    if name is None:
        return read_model(ensure_tiny_model(), trust_remote_code, weights)
    path = Path(name).expanduser()
    if path.exists() or not hub.looks_like_repo_id(name):
        if not path.is_dir():
            raise FileNotFoundError(f"no model directory at {name}")
        return read_model(path, trust_remote_code, weights)

    def has_weights(snapshot: Path) -> bool:
        return (snapshot / "config.json").exists() and any(snapshot.glob("*.safetensors"))

    try:
        snap = hub.snapshot(name, "model", has_weights, allow_patterns=hub.MODEL_FILES)
    except hub.HubError as e:
        raise hub.HubError(f"no model directory at {name}, and {e}") from None
    model = read_model(snap.path, trust_remote_code, weights)
    return Model(**{**model.__dict__, "repo_id": snap.repo_id, "revision": snap.revision})


def read_model(path: Path, trust_remote_code: bool = False, weights: bool = True) -> Model:
    """The facts the checks need, from config.json: its architecture is judged before transformers
    parses the rest, since a refused architecture needs no further reading. `weights`: the run loads the
    checkpoint's weights (not SGLang's dummy ones), so the config's sizes must be theirs."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} holds no config.json, so it is not a Hugging Face model directory")
    raw = load_json(config_file, DAMAGED_MODEL_FILE)  # damaged, it is named
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_file} names no architectures, so the model cannot be identified")
    capture_rule(architectures[0], str(path))
    text = _text_config(path, raw, trust_remote_code)
    where = "text_config." if raw.get("text_config") else ""
    for key in ("num_hidden_layers", "hidden_size"):
        value = getattr(text, key)
        if type(value) is not int or value < 1:
            raise ValueError(
                f"{config_file} gives {where}{key} {value!r}, where a whole number of at least 1 belongs: put back "
                f"the config.json that came with the weights"
            )
    if weights:
        sizes = {key: getattr(text, key, None) for key, _, _ in SIZES_SHOWN}
        check_config_sizes(path, text.num_hidden_layers, sizes, where)
    limit, key = context_length(text)
    moe = routed_expert_count(text) > 0
    return Model(path, architectures[0], text.num_hidden_layers, text.hidden_size, limit, key, moe)


def _text_config(path: Path, raw: dict, trust_remote_code: bool):
    """The decoder's HF config (a multimodal wrapper nests it as text_config).

    When config.json states every field the checks read, as released checkpoints do, those are the values
    transformers would present, and reading them as written keeps a refusal within the first seconds
    (importing transformers' config classes alone costs several). Otherwise transformers supplies its
    defaults for the missing ones.
    """
    written = raw.get("text_config") or raw
    if {"num_hidden_layers", "hidden_size"} <= written.keys() and any(key in written for key in CONTEXT_KEYS):
        # transformers 5 writes RoPE's settings as rope_parameters (every checkpoint it saves) and presents
        # them as rope_scaling, the name SGLang and the checks read.
        if "rope_parameters" in written and "rope_scaling" not in written:
            written = {**written, "rope_scaling": written["rope_parameters"]}
        return SimpleNamespace(**written)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    except ValueError:
        return wrapped_text_config(raw)
