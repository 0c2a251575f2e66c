"""The extraction job: records -> token samples -> ragged batches -> engine -> shard writer.

Each process runs one `Job`; `distributed.Layout` decides whether it writes, `resume` which records earlier
attempts into the same directory already wrote, and `distributed.Share` which of the records it reads. The
job's methods are its phases: the run's set-up (the checks, the tokenizer, the model's load, the output directory
claimed, the parity gate) and its finish are here, the extraction itself is `extract_phase`, whose hot loop is
`feed`; the counting is `summary`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from itertools import chain, islice
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from offline_extract import planning, preflight
from offline_extract.data.corpus import BadRecordError, Record, Reject, Row, in_order, parse, read_corpus, rows
from offline_extract.data.sources import CorpusReadError, Source, open_sources
from offline_extract.data.tokenization import (
    TEXT_ONLY,
    ImagesRefused,
    Sample,
    SampleTokenizer,
    from_rows,
    refuse_images,
    tokenizer_files,
)
from offline_extract.data.tokenizer_processes import TokenizerProcesses
from offline_extract.engine import checkpoint, parity
from offline_extract.engine.distributed import Coordinator, Layout, ReportedByLeader, Share, layout_from_env
from offline_extract.engine.kernels import jit_cache_files
from offline_extract.engine.multimodal import IMAGE_MODELS
from offline_extract.engine.sglang_adapter import LAYER_CONVENTION, Engine, EngineConfig, PortTaken, import_sglang
from offline_extract.extract_phase import ExtractPhase, count_owned, count_records, progress
from offline_extract.feed import HostMemory, warm_up_encoding
from offline_extract.lifecycle import interrupts, startup_gc
from offline_extract.lifecycle.progress import foreign_output_hidden, note
from offline_extract.lifecycle.timeline import Timeline
from offline_extract.lifecycle.timings import run_timings
from offline_extract.options import FINAL_STATES, ExtractOptions, default_tokenizer_processes, final_store
from offline_extract.output import OutputDirectory, resumable
from offline_extract.parity_gate import ParityGate
from offline_extract.recipes import RECIPES
from offline_extract.store import resume
from offline_extract.store.index import shard_paths
from offline_extract.store.journal import Journal
from offline_extract.store.schema import Encoding, RunInfo
from offline_extract.summary import Summary, Tally
from offline_extract.version import __version__


class Terminated(BaseException):
    """SIGTERM arrived: torchrun stopping the survivors of a failed rank, or a scheduler preempting the job.

    A BaseException like KeyboardInterrupt, so that no `except Exception` on the way swallows it, while
    the writer still drops its unfinished shard and the lock is released on the way out.
    """


def raise_terminated(signum, frame) -> None:
    raise Terminated()


# Records tokenized in one call of the tokenizer (SampleTokenizer.many), which spreads them over the cores:
# enough to keep them busy, few enough that the first batch does not wait long for its chunk.
TOKENIZED_TOGETHER = 64
# Rows in one such chunk at most, those read for their ids alone (another replica's, or done) counted too: a
# replica of many reads mostly others' rows, a resume mostly done ones. And their bytes at most, past which a
# chunk ends early: the chunks in flight to the tokenizing processes are held twice (the rows, their pickle).
ROWS_TOGETHER = 16 * TOKENIZED_TOGETHER
CHUNK_BYTES = 64 << 20


# What to do about a run that the parity gate refused, recorded with its verdict.
_AFTER_PARITY = "Fix what the verdict names (or run in float32, --dtype float32), then re-run"
# ...and what to do after an image chat for a model that takes none: the kept shards are of this model and corpus.
_AFTER_IMAGES = "Give a vision-language model, or a corpus without image chats, and a new --out"


def _weights_fingerprint(model_dir: Path) -> str:
    """The sha256 of the weight files (*.safetensors, *.bin, *.pt, *.pth) in name order: each one's name (UTF-8),
    its size (8 bytes, little-endian) and, for a safetensors file, its JSON header (the bytes after its 8-byte
    length). Cheap even for a 1 TB checkpoint, and it changes whenever the set of tensors, their shapes or their
    files change. A safetensors file whose header is damaged or that is cut short (an interrupted download, say),
    or one that the checkpoint's index names and that is not there, or a pickled one holding objects beyond tensors,
    is refused here, naming it, where SGLang's load would fail on it with a traceback."""
    checkpoint.check_checkpoint_complete(model_dir)
    checkpoint.check_pickled_weights(model_dir)
    files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth") for f in model_dir.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin, *.pt) in {model_dir}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little"))
        if f.suffix == ".safetensors":
            checkpoint.check_safetensors(f)
            with open(f, "rb") as fh:
                h.update(fh.read(int.from_bytes(fh.read(8), "little")))
    return h.hexdigest()


def _known_before_loading(opts: ExtractOptions, checked: preflight.Checked) -> RunInfo:
    """The run's facts that need neither the engine nor the tokenizer: with the tokenizer's files in place
    of its hashes (`resume.finished`), enough to tell a finished directory of this run apart."""
    model_dir = checked.model.path
    dtype = _compute_dtype(opts, checked.device)
    return RunInfo(
        model=str(model_dir),
        **checked.model.provenance,
        config_sha256=hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        weights="dummy (random)" if opts.load_format == "dummy" else _weights_fingerprint(model_dir),
        tokenizer_path=str(model_dir),
        tokenizer_files=tokenizer_files(model_dir, opts.trust_remote_code),
        # SGLang decides these two when they are left to it (None until the model loads).
        layer_ids=checked.layer_ids,
        compute_dtype=None if dtype == "auto" else dtype,
        recipe=opts.recipe,
        min_loss_run=_min_loss_run(opts),
        final_state=opts.final_state if RECIPES[opts.recipe].keeps_final_state else None,
        store=opts.store,
        final_store=final_store(opts),
        compress=opts.compress,
        tp_size=opts.tp,
        max_length=opts.max_length,
        overlong=opts.overlong,
        trim_after_last_loss_token=opts.trim_after_last_loss,
        sglang_version=importlib.metadata.version("sglang"),
        torch_version=torch.__version__,
    )


def engine_config(
    opts: ExtractOptions,
    layout: Layout,
    model_path: Path,
    device: str,
    tokens_per_batch: int,
    layer_ids: tuple[int, ...] | None,
) -> EngineConfig:
    """The engine a run of `opts` loads on this rank, from what preflight resolved (the bench builds its
    engine here too, so that it measures the engine a run gets)."""
    return EngineConfig(
        model_path=str(model_path),
        device=device,
        dtype=_compute_dtype(opts, device),
        tp_size=opts.tp,
        tp_rank=layout.tp_rank,
        gpu_id=layout.local_rank,
        nccl_port=layout.nccl_port(opts.port_base),
        attention_backend=opts.attention_backend,
        max_tokens_per_batch=tokens_per_batch,
        max_seqs_per_batch=opts.seqs_per_batch,
        chunk_tokens=opts.chunk_tokens,
        context_length=max(opts.max_length, 8),
        layer_ids=layer_ids,
        final_state=opts.final_state,
        load_format=opts.load_format,
        mem_fraction_static=opts.mem_fraction_static,
        trust_remote_code=opts.trust_remote_code,
        jit_cache=opts.jit_cache,
        # On CPU SGLang's own kernels are what the threads are for.
        host_threads=layout.host_threads() if torch.device(device).type == "cuda" else None,
    )


def _compute_dtype(opts: ExtractOptions, device: str) -> str:
    # SGLang turns a float32 checkpoint into bf16 under "auto"; on CPU the embedded model exists to prove
    # parity in fp32, so it keeps its own dtype there (SGLang's CUDA kernels take half precision only).
    return "float32" if opts.dtype == "auto" and not opts.model and torch.device(device).type == "cpu" else opts.dtype


def run_metadata(known: RunInfo, engine: Engine) -> RunInfo:
    """The run's facts once the model is loaded (the parity gate's rows come last, `Job._gate`)."""
    return replace(
        known,
        architecture=engine.architecture,
        layer_ids=tuple(engine.layer_ids),
        layer_convention=LAYER_CONVENTION
        + (f"; last = {FINAL_STATES[known.final_state]}" if known.final_state else ""),
        sglang_capture_points=tuple(engine.capture_points),
        num_layers=engine.num_layers,
        hidden_size=engine.hidden_size,
        final_norm=None if (norm := engine.final_norm()) is None else norm.to_json(),
        compute_dtype=engine.dtype,
        quantization=engine.quantization,
        attention_backend=engine.attention_backend,
        offline_extract_version=__version__,
    )


def sample_tokenizer(opts: ExtractOptions, model_dir: Path) -> SampleTokenizer:
    from transformers import AutoTokenizer

    where = f"put the model's tokenizer files (tokenizer.json, or tokenizer.model) beside {model_dir / 'config.json'}"
    processor = _image_processor(opts, model_dir)
    try:
        tokenizer = (
            processor.tokenizer
            if processor is not None
            else AutoTokenizer.from_pretrained(model_dir, trust_remote_code=opts.trust_remote_code)
        )
    except (OSError, ValueError) as e:  # its words name neither the directory nor, often, the cause
        raise ValueError(f"no tokenizer loads from {model_dir} ({where}): {e}") from e
    if len(tokenizer) <= len(tokenizer.all_special_tokens):
        # transformers 5 builds this for some model types (Qwen) from a directory without tokenizer files: text
        # would tokenize to nothing, and every chat record would fail for want of a chat template.
        raise ValueError(
            f"{model_dir} holds no tokenizer: transformers built one of special tokens alone "
            f"({', '.join(tokenizer.all_special_tokens) or 'none'}); {where}"
        )
    return SampleTokenizer(
        tokenizer,
        max_length=opts.max_length,
        overlong=opts.overlong,
        trim_after_last_loss=opts.trim_after_last_loss,
        min_loss_run=_min_loss_run(opts),
        model=_model_name(opts),
        processor=processor,
        image_token_id=None if processor is None else _image_token_id(model_dir),
        image_threads=opts.image_threads,
        images_refused=None if processor is None else _without_its_tower(model_dir),
    )


def start_tokenizer_processes(
    opts: ExtractOptions, device: str, images: bool, layout: Layout
) -> TokenizerProcesses | None:
    """The processes tokenizing `layout`'s rank's records on `device` (--tokenizer-processes, by default
    `default_tokenizer_processes`) for a model with or without `images`, started and waiting for their
    tokenizer (`TokenizerProcesses.hand`); None where the records are tokenized on the feed's thread."""
    processes = opts.tokenizer_processes
    if processes is None:
        processes = default_tokenizer_processes(torch.device(device).type, images, layout.local_world_size)
    return TokenizerProcesses(processes) if processes else None


def _model_name(opts: ExtractOptions) -> str:
    return opts.model or "the default model"


def _vision_language(model_dir: Path) -> bool:
    """Whether the model is a vision-language one: its config has a vision_config."""
    return "vision_config" in json.loads((model_dir / "config.json").read_text())


def _image_processor(opts: ExtractOptions, model_dir: Path):
    """A vision-language model's HF processor (`_vision_language`), which renders its image chats and prepares
    their pixels; None for a text-only model."""
    if not _vision_language(model_dir):
        return None
    from transformers import AutoProcessor

    needed = "preprocessor_config.json or processor_config.json, and its tokenizer files"
    try:
        processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=opts.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{model_dir} is a vision-language model (its config.json has a vision_config), but its HF "
            f"processor does not load from it ({needed}): {e}"
        ) from e
    if getattr(processor, "image_processor", None) is None:  # AutoProcessor gives the tokenizer alone then
        raise ValueError(
            f"{model_dir} is a vision-language model (its config.json has a vision_config), but "
            f"AutoProcessor finds no image processor there ({needed})"
        )
    return processor


def _without_its_tower(model_dir: Path) -> str | None:
    """Why a vision-language checkpoint whose processor loads still takes no image: its index names none of the
    tower's weights that SGLang builds the tower from (`ImageModel.indexed_tower`), so SGLang runs it text-only.
    Its image chats are refused as they come, naming the record, where their forward would fail inside SGLang
    without naming it; its text records run."""
    config = json.loads((model_dir / "config.json").read_text())
    spec = IMAGE_MODELS.get((config.get("architectures") or [None])[0])
    missing = checkpoint.unindexed(model_dir, spec.indexed_tower) if spec else ()
    if not missing:
        return None
    index = model_dir / checkpoint.CHECKPOINT_INDEX
    lacks = f"names no {' or '.join(f'{p}*' for p in missing)} weights" if index.is_file() else "does not exist"
    return (
        f"runs text-only in SGLang: its index {index} {lacks}, and SGLang builds the vision tower only from the "
        f"weights the index names. Give the checkpoint with its vision weights, or a corpus without images"
    )


def _refuse_images_ahead(opts: ExtractOptions, checked: preflight.Checked) -> None:
    """A model that takes no image (a text-only one, or one whose checkpoint lacks its tower's weights) given a
    corpus whose first records hold images is refused before the model loads, as the tokenizer refuses the first
    of them after it (`tokenization.refuse_images`), where a corpus of image chats given the wrong model would cost
    a model load to learn so. The rows of the feed's first chunk are read at most (`ROWS_TOGETHER`, `CHUNK_BYTES`),
    and none of a pipe, which can be read only once: an image chat past them is refused as it is tokenized, and the
    directory then says so (`Job._attempt`). A file that breaks off within them is left for the run's own reading
    to meet, which records the refusal in --out (`OutputDirectory.refused_where_the_corpus_breaks_off`): raised
    here, before the directory is claimed, it would leave an interrupted run's manifest that reads as resumable."""
    model_dir = checked.model.path
    why = _without_its_tower(model_dir) if _vision_language(model_dir) else TEXT_ONLY
    if why is None or any(source.streamed for source in checked.sources):
        return
    size = 0
    try:
        for row in islice(rows(checked.sources), ROWS_TOGETHER):
            _, item = parse(row)
            if isinstance(item, Record) and item.images:
                refuse_images(item, _model_name(opts), why)
            size += row.size()
            if size >= CHUNK_BYTES:
                return
    except CorpusReadError:
        return


def _image_token_id(model_dir: Path) -> int | None:
    """The token a vision-language model's image embeddings replace, as its config.json names it (Llama 4's
    image_token_index is what HF's attribute_map calls image_token_id); None where it names none."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("image_token_id", config.get("image_token_index"))


def _min_loss_run(opts: ExtractOptions) -> int:
    return opts.min_loss_run if opts.min_loss_run is not None else RECIPES[opts.recipe].min_loss_run


def encoding(opts: ExtractOptions) -> Encoding:
    return Encoding(
        opts.store,
        opts.compress,
        keeps_final_state=RECIPES[opts.recipe].keeps_final_state,
        final_store=final_store(opts),
    )


def dry_run(opts: ExtractOptions) -> planning.Plan:
    """The real run's checks, then the whole corpus tokenized as the run would and its output sized,
    without loading the model."""
    checked = preflight.check(opts)
    out = Path(opts.out)
    known = _known_before_loading(opts, checked)  # the weights' checks too: they read only names and headers
    shards = [path.name for path in shard_paths(out)] if out.is_dir() else []
    done = None
    if shards:
        identity = resume.check_before_loading(out, known, checked.corpus_paths, opts.force, opts.allow_other_sglang)
        done = resume.done_mask(out, shards)  # what the run resuming there keeps (a damaged shard refuses it)
        resume.check_images(out, shards, identity, opts.data, opts.force)
    model = checked.model
    tokenizer = sample_tokenizer(opts, model.path)
    with progress(opts, "dry run", lambda: count_records(checked.sources)) as bar:
        plan = planning.plan(
            opts.data,
            tokenizer,
            opts.out,
            model.hidden_size,
            _num_aux_layers(checked),
            encoding(opts),
            strict=opts.strict,
            advance=lambda tokens: bar.advance(1, tokens, 0),
            done=done,
            kept_shards=len(shards),
        )
    if resume.finished(out, replace(known, **tokenizer.fingerprint()), checked.corpus_paths):
        return replace(plan, finished=True)  # the run says "already complete" without taking the directory
    # Looked at last: the state the run would meet if started now, after a dry run that may have taken minutes.
    return replace(plan, in_use=resume.in_use(out))


def _num_aux_layers(checked: preflight.Checked) -> int:
    """Before the model loads: every supported model's SGLang EAGLE-3 default captures three layers."""
    return len(checked.layer_ids) if checked.layer_ids is not None else 3


def run(opts: ExtractOptions) -> Summary | None:
    """Run this process's part of the job; the leading process gets the whole run's summary.

    Into a directory that already holds shards this resumes: see `resume`.
    """
    job = Job(opts)
    finished = resume.finished(job.out, job.known, job.checked.corpus_paths)
    if finished is None and resume.tokenizer_decides(job.out, job.known):
        # Other files may still make the recorded tokenizer (a copied model directory): it decides, so it
        # loads now rather than beside the model.
        job.load_tokenizer()
        finished = resume.finished(job.out, job.known, job.checked.corpus_paths)
    if finished is not None:
        return job.output.already_complete(finished, opts.data, opts.force)
    return job.run()


class Job:
    """One process's part of one attempt. Built from the options, it holds what every phase reads: the
    checked options, this rank's place in the layout, the tokenizer (`load_tokenizer`, or beside the model
    load: `_load`) and the run metadata known before the model loads; `run` calls the phases in order, and
    `timeline` records when each began."""

    def __init__(self, opts: ExtractOptions):
        self.timeline = Timeline()
        self.opts = opts
        self.layout = layout_from_env(opts.tp)
        # Beating before the checks: a rank whose checks take long (a model still downloading to its node, a
        # slow filesystem) is waited for at the first meeting, where it would otherwise be taken for lost.
        self.coord = Coordinator(self.layout, namespace=f"run-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
        self.checked = preflight.check(opts)
        self.out = Path(opts.out)
        self.known = _known_before_loading(opts, self.checked)
        self.timeline.mark("checked")
        self.tokenizer: SampleTokenizer | None = None
        self.apart: TokenizerProcesses | None = None  # the processes tokenizing the records, if any
        # Set by _load: the engine, and the run's facts that every shard carries.
        self.engine: Engine
        self.meta: RunInfo
        self.output = OutputDirectory(self.out, self.layout, self.coord)
        self.gate = ParityGate(opts, self.layout, self.coord, self.timeline, self.checked.model.path)
        self.extract = ExtractPhase(opts, self.layout, self.checked, self.out, self.timeline)
        self._cached_when_warm: set[str] = set()  # the compilers' cache files once the engine was warm

    def load_tokenizer(self) -> SampleTokenizer:
        """Before the model loads, where the tokenizer decides what happens next (--strict, a rerun into a
        complete directory of another tokenizer's files): transformers alone takes seconds to import, which
        a run that goes on to load the model pays inside SGLang's import instead (`_load`)."""
        with foreign_output_hidden(not self.opts.verbose):
            return self._tokenizer_now()

    def _tokenizer_now(self) -> SampleTokenizer:
        self.timeline.mark("tokenizer loading")
        self.tokenizer = sample_tokenizer(self.opts, self.checked.model.path)
        self.known = replace(self.known, **self.tokenizer.fingerprint())
        if self.apart is not None:
            self.apart.hand(self.tokenizer)
        self.timeline.mark("tokenizer loaded")
        return self.tokenizer

    def run(self) -> Summary | None:
        _refuse_images_ahead(self.opts, self.checked)
        locks = []

        def take_over() -> dict:
            with interrupts.held_back():  # a lock taken is a lock released on the way out
                lock, existing = resume.take_over(self.out)
                locks.append(lock)
                interrupts.undo_at_once(lock.release)
            return asdict(existing)

        try:
            # First, so that the processes' imports pass beside SGLang's import and the model's load: started
            # once the tokenizer has loaded, they would hold up the first batch wherever the model loads and
            # warms up in a few seconds (a warm kernel cache).
            images = _vision_language(self.checked.model.path)
            self.apart = start_tokenizer_processes(self.opts, self.checked.device, images, self.layout)
            if self.apart is not None:
                self.timeline.mark("tokenizing processes started")
                if self.tokenizer is not None:
                    self.apart.hand(self.tokenizer)
            if self.opts.strict:
                tokenizer = self.tokenizer or self.load_tokenizer()
                _stop_at_the_first_bad_record(self.opts, self.layout, self.coord, self.checked.sources, tokenizer)
            # Nobody touches the directory before the leader holds it and has cleared a crashed run's leftovers.
            existing = resume.Existing(**self.coord.from_leader(take_over))
            return self._attempt(existing)
        finally:
            for lock in locks:
                lock.release()
            if self.apart is not None:
                self.apart.close()

    def _attempt(self, existing: resume.Existing) -> Summary | None:
        """The phases of one attempt, in order: load the model, claim the output directory for this run,
        read the samples still pending, hold the first ones against HF (the parity gate), extract the rest,
        finish."""
        opts, layout = self.opts, self.layout
        if layout.leads:
            for line in existing.notes:
                note(line)
        on_gpu = torch.device(self.checked.device).type == "cuda"
        host = self._host_memory() if on_gpu and layout.writes else None
        self.gate.start_preload()
        self._load()
        done = self.output.claim(existing, self.meta, self.checked.corpus_paths, self.opts)
        self.share = Share(layout, done)
        with (
            self.output.refused_where_the_corpus_breaks_off(),
            resumable(self.out, self.opts.data),
            ExitStack() as journals,
        ):
            rejects = (
                journals.enter_context(Journal(self.out / resume.REJECTS_PART.format(layout.dp_rank)))
                if layout.writes
                else None
            )
            tally = Tally(rejects, opts.strict, opts.nonfinite)
            samples = self._pending(done, tally)
            head = list(islice(samples, opts.parity_samples))
            self.timeline.mark("verifying")
            # Nothing was extracted: this rank's rejects journal goes with the refusal.
            gone = None if rejects is None else rejects.path
            with _refusal_recorded(
                self.out, layout, journals, parity.ParityMismatch, "the parity gate", _AFTER_PARITY, gone
            ):
                tally.summary.parity = self._gate(head)
            self.timeline.mark("verified")
            staging, buffers = host.take(self.engine) if host else (None, [])
            writer = self.extract.writer(self.meta, existing, journals, buffers, on_gpu) if layout.writes else None
            with _refusal_recorded(self.out, layout, journals, ImagesRefused, "the tokenizer", _AFTER_IMAGES):
                self.extract.run(self.engine, self.share, chain(head, samples), writer, staging, tally)
        tally.summary.seconds = self.timeline.now()  # from the command, as a user waits for it
        return self.output.finish(
            tally.summary, self.extract.written, self.checked.sources, self.timeline, self._timings
        )

    def _host_memory(self) -> HostMemory:
        """Started before the model loads, with the widths the config predicts (`_num_aux_layers`)."""
        enc = encoding(self.opts)
        widths = enc.widths(_num_aux_layers(self.checked), self.checked.model.hidden_size)
        forward_tokens = max(self.checked.tokens_per_batch, self.opts.chunk_tokens or 0)
        return HostMemory(
            enc, widths, forward_tokens, self.layout.local_rank, self.opts.shard_bytes, self.checked.writers
        )

    def _load(self) -> None:
        """SGLang's imports, then its model load and the warm-up, with the tokenizer (unless it is loaded
        already) on a thread of its own beside them: the run waits only for what of it they did not cover."""
        opts, checked, layout = self.opts, self.checked, self.layout
        cfg = engine_config(
            opts, layout, checked.model.path, checked.device, checked.tokens_per_batch, checked.layer_ids
        )
        self.timeline.mark("loading")
        with foreign_output_hidden(not opts.verbose):
            import_sglang(cfg.device, cfg.jit_cache)
            self.timeline.mark("sglang imported")
            beside = None if self.tokenizer is not None else _Beside(self._tokenizer_now)
            try:
                if beside is not None:
                    beside.start()
                try:
                    self.engine = Engine(cfg)
                except PortTaken as e:
                    raise PortTaken(
                        f"{e} (another extraction on this machine, or one still exiting?): --port-base P gives "
                        f"this run others, P + r for replica r (now P = {cfg.nccl_port - layout.dp_rank})"
                    ) from None
                self.timeline.mark("loaded")
                if opts.warm_up and torch.device(checked.device).type == "cuda":  # nothing compiles on CPU
                    self.engine.warm_up()
                    warm_up_encoding(self.engine, encoding(opts))
                self.timeline.mark("warm")
                self.engine.compiles.warm()
                startup_gc.start_up_done()
                self._cached_when_warm = jit_cache_files(self.engine.jit_caches)
                if beside is not None:
                    beside.wait()
                    self.timeline.mark("tokenizer waited")
            except KeyboardInterrupt:
                if beside is not None and beside.error is not None:
                    raise beside.error from None  # it stopped the load (_Beside)
                raise
            finally:
                if beside is not None:
                    beside.settle()
        prebuilt = self.engine.compiles.report()
        for name, why in prebuilt.get("prebuild_failed", {}).items():
            note(f"kernel prebuild: {name} failed ({why}); SGLang builds it when the forward first needs it")
        for why in prebuilt.get("routing_prebuild_failed", []):
            note(f"MoE routing prebuild: a process failed ({why}); the forwards compile what it missed")
        self.meta = run_metadata(self.known, self.engine)

    def _pending(self, done: np.ndarray, tally: Tally) -> Iterator[Sample]:
        assert self.tokenizer is not None, "loaded with the model, if not before (_load)"
        return pending_samples(self.opts.data, self.share, self.tokenizer, done, tally, self.apart)

    def _gate(self, head: list[Sample]) -> list[dict]:
        """--verify N (`ParityGate`): its rows, and on a MoE model how HF was routed, go into the run's metadata."""
        verified = self.gate.run(self.engine, head)
        self.meta = replace(self.meta, parity=tuple(verified["rows"]), parity_routing=verified.get("routing"))
        return verified["rows"]

    def _timings(self) -> dict:
        timings = run_timings(
            self.timeline, self.layout.dp_size, self.extract.waits, self.gate.timings, self.engine.compiles.report
        )
        # What compiled once the run was warm is what its warm-up missed: the first batches paid for it.
        compiled = sorted(jit_cache_files(self.engine.jit_caches) - self._cached_when_warm)
        use = {"host_use": self.extract.host_use} if self.extract.host_use is not None else {}
        return {
            **timings,
            **use,
            "compiled_in_extraction": len(compiled),
            "compiled_in_extraction_files": compiled[:40],
        }


@contextmanager
def _refusal_recorded(
    out: Path,
    layout: Layout,
    journals: ExitStack,
    refusal: type[Exception],
    by: str,
    advice: str,
    gone: Path | None = None,
) -> Iterator[None]:
    """A `refusal` raised inside, which a re-run would meet again (the parity gate's verdict, an image chat for a
    model that takes none), leaves `out` saying that `by` refused the run, with its verdict and `advice`, not reading
    as an interrupted run that a re-run would finish; the journals are closed first, and `gone` deleted."""
    try:
        yield
    except refusal as e:
        journals.close()
        if gone is not None:
            gone.unlink(missing_ok=True)
        if layout.leads:
            resume.refuse(out, by, str(e), advice)
        raise


def pending_samples(
    data: Sequence[str],
    share: Share,
    tokenizer: SampleTokenizer,
    done: np.ndarray,
    tally: Tally,
    apart: TokenizerProcesses | None = None,
) -> Iterator[Sample]:
    """The samples of `share`'s records of `data` still to extract, in corpus order, every record read counted
    in `tally`: records -> samples as a run makes them (the bench's --data too). `done[i]` marks record i as
    already written. The rows are read here, and parsed and tokenized by `apart`'s processes where it is given
    (`tokenization.from_rows`), else here too; which ids are duplicates is settled here, in order."""
    sources = open_sources(data)

    def resumed(index: int) -> bool:
        return index < len(done) and bool(done[index])

    def chunks() -> Iterator[tuple[list[Row], tuple[list[Row], list[bool]]]]:
        chunk: list[Row] = []
        wanted: list[bool] = []
        taken = size = 0  # rows of the chunk wanted, and its bytes
        for row in rows(sources):
            want = share(row.index) and not resumed(row.index)
            chunk.append(row)
            wanted.append(want)
            taken += want
            size += row.size()
            if taken == TOKENIZED_TOGETHER or len(chunk) == ROWS_TOGETHER or size >= CHUNK_BYTES:
                yield chunk, (chunk, wanted)
                chunk, wanted, taken, size = [], [], 0, 0
        if chunk:
            yield chunk, (chunk, wanted)

    made: Iterator[tuple[list[Row], list]]
    if apart is None:
        made = ((chunk, from_rows(tokenizer, *work)) for chunk, work in chunks())
    else:
        made = apart.many_ahead(chunks())
    parsed = ((row, id_, item) for chunk, items in made for row, (id_, item) in zip(chunk, items))
    for row, item in in_order(sources, parsed, owns=share):
        if resumed(row.index):
            tally.resumed()
        elif isinstance(item, Exception):  # the tokenizer refused the record whole (`from_rows`)
            raise item
        elif isinstance(item, Sample):
            tally.to_extract()
            yield item
        elif isinstance(item, Reject):
            tally.left_out(item)
        else:  # a row is made nothing only where it is not wanted: another replica's, or resumed
            raise AssertionError(f"{row.source}:{row.line} was read and neither tokenized nor rejected")


def _stop_at_the_first_bad_record(
    opts: ExtractOptions, layout: Layout, coord: Coordinator, sources: Sequence[Source], tokenizer: SampleTokenizer
) -> None:
    """--strict: each replica reads and tokenizes its share before the model loads, and the run stops at
    the first bad record in corpus order, whichever replica holds it, reported once."""
    first = None
    share = Share(layout, np.zeros(0, dtype=bool))
    count = (lambda: count_owned(share, sources)) if layout.leads else None
    with progress(opts, "--strict check", count, shown=layout.leads) as bar:
        for item in read_corpus(opts.data, owns=share):
            made = tokenizer(item) if isinstance(item, Record) else item
            bar.advance(1, made.num_tokens if isinstance(made, Sample) else 0, 0)
            if isinstance(made, Reject) and made.kind != "skipped":
                first = made.to_json()
                break
    found = [reject for reject in coord.all_gather(first) if reject]
    if not found:
        return
    error = BadRecordError(Reject(**min(found, key=lambda reject: reject["index"])))
    if layout.world_size == 1:
        raise error
    if layout.leads:
        note(f"Error: {error}")
    coord.barrier()  # nobody exits before it is said: torchrun stops the others at the first exit
    raise ReportedByLeader(str(error))


class _Beside:
    """`call` on a thread of its own (`start`), beside what the calling thread does meanwhile; `wait` joins
    it and raises what it raised.

    The tokenizer loads so beside SGLang's model load. Started once SGLang is imported (`import_sglang`),
    it finds every module it needs imported already: the two threads never import the same modules at once,
    and transformers' import, which SGLang needs anyway, counts as SGLang's. A failure should not cost a
    whole model load to learn: where the caller is the main thread of a command (`interrupts.guard`), the
    failure interrupts it at once (`interrupts.interrupt_main`), and the caller raises `error` in its place.
    `settle`, on the way out, makes sure no such interrupt lands later."""

    def __init__(self, call: Callable[[], object]):
        self.error: BaseException | None = None
        self._call = call
        self._armed = threading.current_thread() is threading.main_thread() and interrupts.guarded()
        self._sent = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="beside-the-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._call()
        except BaseException as e:
            with self._lock:
                self.error = e
                if self._armed:
                    interrupts.interrupt_main()
                    self._sent = True

    def wait(self) -> None:
        try:
            self._thread.join()
            _pending_signals_run()
        except KeyboardInterrupt:
            if self.error is None:
                raise
        if self.error is not None:
            raise self.error

    def settle(self) -> None:
        """From here on the thread interrupts nothing; an interrupt it sent and that has not landed yet never does."""
        with self._lock:
            self._armed = False
            if self._sent:
                interrupts.withdraw()


def _pending_signals_run() -> None:
    """Does nothing: the main thread runs a pending signal's handler on entering a Python function, so a
    call to this one takes the signal where the caller catches what it raises."""
