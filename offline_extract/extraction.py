"""The extraction job: records -> token samples -> ragged batches -> engine -> shard writer.

Each process runs this; `distributed.Layout` decides which records it owns and whether it writes, and
`resume` which of them earlier attempts into the same directory already wrote.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import operator
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields
from itertools import chain, islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from offline_extract import __version__, final_norm, planning, preflight
from offline_extract.data.batching import Batch, batch_by_tokens
from offline_extract.data.corpus import BadRecordError, Record, Reject, read_corpus
from offline_extract.data.sources import Source
from offline_extract.data.tokenization import Sample, SampleTokenizer
from offline_extract.engine import parity
from offline_extract.engine.distributed import Coordinator, Layout, ReportedByLeader, layout_from_env
from offline_extract.engine.nonfinite import NonFiniteError, NonFiniteGuard, batch_flag
from offline_extract.engine.offload import HostOffload, pinned_buffers
from offline_extract.engine.sglang_adapter import FINAL_STATES, LAYER_CONVENTION, Captured, Engine, EngineConfig
from offline_extract.progress import RunProgress, foreign_output_hidden, plural
from offline_extract.store import manifest, resume
from offline_extract.store.atomic import atomic_write
from offline_extract.store.index import write_index
from offline_extract.store.journal import Journal, read_journal
from offline_extract.recipes import RECIPES
from offline_extract.store.schema import FINAL_STATE, STATE_TENSORS, STORES, Encoding, SampleInfo
from offline_extract.store.writer import WRITER_THREADS, ShardWriter, shard_buffers

REJECTS_FILE = "rejects.jsonl"


class StoppedError(RuntimeError):
    """The run stopped part-way (disk full, I/O error, non-finite states); what it wrote is complete."""


class Terminated(BaseException):
    """SIGTERM arrived: torchrun stopping the survivors of a failed rank, or a scheduler preempting the job.

    A BaseException like KeyboardInterrupt, so that no `except Exception` on the way swallows it, while
    the writer still drops its unfinished shard and the lock is released on the way out.
    """


def raise_terminated(signum, frame) -> None:
    raise Terminated()


@dataclass(frozen=True)
class ExtractOptions:
    data: tuple[str, ...]
    out: str = "out"
    model: str | None = None  # None: the embedded tiny Llama, on CPU
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"
    tp: int = 1
    layers: tuple[int, ...] | None = None
    max_length: int = 4096
    overlong: str = "truncate"
    tokens_per_batch: int | None = None
    chunk_tokens: int | None = None  # for samples longer than tokens_per_batch; None: tokens_per_batch
    seqs_per_batch: int = 256
    shard_bytes: int = 512 << 20
    attention_backend: str | None = None
    load_format: str = "auto"
    mem_fraction_static: float = 0.85
    port_base: int | None = None
    verify: int = 0
    trim_after_last_loss: bool = False
    trust_remote_code: bool = False
    progress: bool = True
    progress_every: float = 60.0  # without the bar (progress=False): a progress line this often, in seconds; 0: none
    verbose: bool = False  # show what SGLang, torch and HF print while loading
    strict: bool = False
    nonfinite: str = "fail"
    final_state: str = "post-norm"  # a key of sglang_adapter.FINAL_STATES
    recipe: str = "eagle3"  # a key of recipes.RECIPES
    min_loss_run: int | None = None  # None: the recipe's
    store: str = "bf16"  # a key of schema.STORES
    compress: str = "none"  # one of schema.COMPRESSIONS
    force: bool = False  # resume into an output directory written by a different run


@dataclass
class Summary:
    """Counts of one attempt. Every record read is exactly one of: extracted now, resumed (already in
    a complete shard of an earlier attempt), skipped, rejected or dropped."""

    records: int = 0
    extracted: int = 0
    resumed: int = 0
    skipped: int = 0
    rejected: int = 0
    dropped: int = 0
    nonfinite_kept: int = 0
    tokens: int = 0
    bytes_written: int = 0
    shards: list[str] = field(default_factory=list, metadata={"merge": lambda a, b: sorted(a + b)})
    # Replicas run side by side: the run took as long as the slowest.
    seconds: float = field(default=0.0, metadata={"merge": max})
    extract_seconds: float = field(default=0.0, metadata={"merge": max})
    # Every replica checks its own first samples; the report shows the first replica's.
    parity: list[dict] = field(default_factory=list, metadata={"merge": lambda a, b: a or b})

    def merge(self, other: "Summary") -> "Summary":
        """Two replicas' summaries as one: counts add up, unless a field's metadata says otherwise."""
        return Summary(**{
            f.name: f.metadata.get("merge", operator.add)(getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
        })


    def no_sample_verdict(self, data: Sequence[str]) -> str | None:
        left_out = {"rejected": self.rejected, "skipped": self.skipped, "dropped": self.dropped}
        return no_sample_verdict(data, self.records, left_out)

    def report(self, out: str | os.PathLike) -> str:
        # Resumed samples count as extracted, so that the four counts add up to the records read.
        extracted = f"extracted {self.extracted + self.resumed}"
        if self.resumed:
            extracted += f" ({self.resumed} by earlier attempts)"
        lines = [
            f"records {self.records}: {extracted}, skipped {self.skipped}, rejected {self.rejected}, "
            f"dropped {self.dropped}",
        ]
        if self.tokens or self.shards:
            lines += [
                f"tokens {self.tokens:,}: {self.tokens / max(self.extract_seconds, 1e-9):,.0f} tok/s over "
                f"{self.extract_seconds:.1f} s of extraction ({self.seconds:.1f} s with start-up)",
                f"{plural(len(self.shards), 'new shard')}, {self.bytes_written / 1e9:.3f} GB -> {out}",
            ]
        if self.nonfinite_kept:
            lines.append(f"{self.nonfinite_kept} extracted samples hold NaN or Inf (--nonfinite keep)")
        if self.skipped or self.rejected or self.dropped:
            lines.append(f"skipped, rejected and dropped records are listed in {Path(out) / REJECTS_FILE}")
        return "\n".join(lines)


def no_sample_verdict(data: Sequence[str], records: int, left_out: dict[str, int]) -> str | None:
    """Why a corpus gave no sample at all, in the same words for a run and a dry run; None if it gave one.

    `left_out` counts the records that gave no sample, by kind (rejected, skipped, dropped); it says
    nothing of where the records came from, so every corpus source gets the same verdict.
    """
    if records == 0:
        return f"{', '.join(map(str, data))} {'has' if len(data) == 1 else 'have'} no records"
    if sum(left_out.values()) < records:
        return None
    kinds = {kind: n for kind, n in left_out.items() if n}
    which = f"all {records} records" if records > 1 else "its only record"
    if len(kinds) == 1:
        return f"{which} {next(iter(kinds))}"
    return f"{which} left out ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})"


def parity_lines(rows: list[dict]) -> list[str]:
    return [
        f"parity {row['layer']:>8} vs HF hidden_states[{row['hf_index']}]: max_abs {row['max_abs']:.3g} "
        f"cosine worst {row['cosine']:.6f} median {row['median_cosine']:.6f} {'ok' if row['ok'] else 'FAIL'}"
        for row in rows
    ]


def _weights_fingerprint(model_dir: Path) -> str:
    """Names and sizes of the weight files, plus each safetensors file's header: cheap even for a 1 TB
    checkpoint, and it changes whenever the set of tensors, their shapes or their files change."""
    files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth") for f in model_dir.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin, *.pt) in {model_dir}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little"))
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                h.update(fh.read(int.from_bytes(fh.read(8), "little")))
    return h.hexdigest()


def _known_before_loading(opts: ExtractOptions, checked: preflight.Checked, tokenizer: SampleTokenizer) -> dict:
    """The run metadata that needs no engine: enough to tell a finished directory of this run apart."""
    model_dir = checked.model.path
    dtype = _compute_dtype(opts, checked.device)
    return {
        "model": str(model_dir),
        **checked.model.provenance,
        "config_sha256": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": "dummy (random)" if opts.load_format == "dummy" else _weights_fingerprint(model_dir),
        "tokenizer_path": str(model_dir),
        **tokenizer.fingerprint(),
        # SGLang decides these two when they are left to it.
        **({"layer_ids": sorted(checked.layer_ids)} if checked.layer_ids is not None else {}),
        **({"compute_dtype": dtype} if dtype != "auto" else {}),
        "recipe": opts.recipe,
        "min_loss_run": _min_loss_run(opts),
        "final_state": opts.final_state if RECIPES[opts.recipe].final_state else None,
        "store": opts.store,
        "compress": opts.compress,
        "dtype": str(STORES[opts.store]).removeprefix("torch."),
        "tp_size": opts.tp,
        "max_length": opts.max_length,
        "overlong": opts.overlong,
        "trim_after_last_loss_token": opts.trim_after_last_loss,
    }


def _compute_dtype(opts: ExtractOptions, device: str) -> str:
    # SGLang turns a float32 checkpoint into bf16 under "auto"; on CPU the embedded model exists to prove
    # parity in fp32, so it keeps its own dtype there (SGLang's CUDA kernels take half precision only).
    return "float32" if opts.dtype == "auto" and not opts.model and torch.device(device).type == "cpu" else opts.dtype


def run_metadata(known: dict, engine: Engine) -> dict:
    return {
        **known,
        "architecture": engine.architecture,
        "layer_ids": list(engine.layer_ids),
        "layer_convention": LAYER_CONVENTION + (f"; last = {FINAL_STATES[known['final_state']]}" if known["final_state"] else ""),
        "sglang_capture_points": list(engine.capture_points),
        "num_layers": engine.num_layers,
        "hidden_size": engine.hidden_size,
        **({final_norm.RUN_KEY: norm.to_json()} if (norm := engine.final_norm()) is not None else {}),
        "compute_dtype": engine.dtype,
        "quantization": engine.quantization,
        "attention_backend": engine.attention_backend,
        "sglang_version": importlib.metadata.version("sglang"),
        "torch_version": torch.__version__,
        "offline_extract_version": __version__,
    }


class Tally:
    """One replica's counts as its records go by, kept in its `summary`, and the journal of the records
    that gave no sample (`rejects`; None on ranks that do not write). Every record read is counted here
    exactly once, so the counts add up to the records read."""

    def __init__(self, rejects: Journal | None, strict: bool, nonfinite: str):
        self.summary = Summary()
        self._rejects = rejects
        self._strict = strict
        self._nonfinite = nonfinite
        self._records_shown = 0

    def resumed(self) -> None:
        """A record already in a complete shard of an earlier attempt."""
        self.summary.records += 1
        self.summary.resumed += 1

    def to_extract(self) -> None:
        self.summary.records += 1

    def left_out(self, reject: Reject) -> None:
        """A record that gave no sample: skipped or rejected, and journaled (under --strict a rejected
        one stops the run instead)."""
        self.summary.records += 1
        if reject.kind == "skipped":
            self.summary.skipped += 1
        elif self._strict:
            raise BadRecordError(reject)
        else:
            self.summary.rejected += 1
        self._journal(reject)

    def nonfinite(self, sample: Sample, reason: str) -> None:
        """A sample whose states hold NaN or Inf, under --nonfinite drop or keep."""
        if self._nonfinite == "drop":
            self.summary.dropped += 1
            self._journal(Reject(sample.source, sample.line, sample.index, sample.id, reason, "dropped"))
        else:
            self.summary.nonfinite_kept += 1
            _note(f"warning: sample {sample.id!r} ({sample.source}:{sample.line}) kept with {reason}")

    def batch_done(self, batch: Batch) -> int:
        """Counts the batch's tokens; returns the records read since the last batch, bad and resumed ones
        included, so that a progress bar over the records reaches its total."""
        self.summary.tokens += batch.num_tokens
        new, self._records_shown = self.summary.records - self._records_shown, self.summary.records
        return new

    def written(self, shards: list[Path], writer: ShardWriter) -> None:
        self.summary.shards = [p.name for p in shards]
        # Counted as written, not as batched: dropped samples are batched but never written.
        self.summary.extracted = writer.samples_written
        self.summary.bytes_written = writer.bytes_written

    def _journal(self, reject: Reject) -> None:
        if self._rejects is not None:
            self._rejects.append(reject.to_json())


def _pending(
    opts: ExtractOptions, layout: Layout, tokenizer: SampleTokenizer, done: np.ndarray, tally: Tally
) -> Iterator[Sample]:
    """This replica's samples still to extract, every record read counted in `tally`. `done[i]` marks
    record i as already written."""
    for item in read_corpus(opts.data, owns=layout.owns):
        if item.index < len(done) and done[item.index]:
            tally.resumed()
            continue
        if isinstance(item, Record):
            item = tokenizer(item)
        if isinstance(item, Sample):
            tally.to_extract()
            yield item
        else:
            tally.left_out(item)


def _info(s: Sample) -> SampleInfo:
    return SampleInfo(s.index, s.id, s.source, s.line, s.source_len, s.truncated)


@dataclass(frozen=True)
class _Piece:
    """Rows start:stop of a batch's packed tokens, as one forward returned them (all of a batch, or one
    chunk of a long sample), with their non-finite flag."""

    batch: Batch
    start: int
    stop: int
    flag: torch.Tensor

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.batch.num_tokens


def _forwards(engine: Engine, batch: Batch) -> Iterator[tuple[int, int, Captured]]:
    """A batch's forwards, each with the rows it covers: the batch in one, or a long sample's chunks."""
    seqs = [s.input_ids for s in batch.samples]
    if engine.is_chunked(seqs):
        yield from engine.chunks(seqs[0], engine.chunk_tokens)
    else:
        yield 0, batch.num_tokens, engine.capture(seqs)


class _WriterFeed:
    """The offload's consumer: hands each piece's host rows to the writer. A long sample's chunks go
    straight into its rows in the shard buffer as they arrive, so its states are never held on the host
    twice, and are screened for NaN/Inf once all of them are there. Its shard is written as the chunks
    arrive, unless non-finite samples are dropped: a streamed sample can no longer be left out."""

    def __init__(self, writer: ShardWriter, guard: NonFiniteGuard):
        self.writer = writer
        self.guard = guard
        self._rows: dict[str, torch.Tensor] | None = None  # the long sample being filled, per staged tensor
        self._flagged = False

    # The flag travels with its piece, so it is read only once the copy event says the states (and the
    # flag, enqueued before them) are on the host.
    def __call__(self, piece: _Piece, staged: dict[str, torch.Tensor]) -> None:
        if piece.whole:
            self._batch(piece, staged)
            return
        (sample,) = piece.batch.samples
        if piece.start == 0:
            widths = {name: t.shape[1] for name, t in staged.items()}
            stream = self.guard.policy != "drop"
            self._rows = self.writer.begin_sample(_info(sample), sample.input_ids, sample.loss_mask, widths, stream=stream)
            self._flagged = False
        for name, t in staged.items():
            self._rows[name][piece.start : piece.stop].copy_(t)
        self.writer.filled(piece.stop)
        self._flagged |= bool(piece.flag)
        if piece.stop == sample.num_tokens:
            kept = self._screen([sample], self._rows)[0] if self._flagged else [sample]
            self._rows = None
            self.writer.end_sample(keep=bool(kept))

    def _screen(self, samples, staged: dict[str, torch.Tensor]):
        """The guard's verdict on the decoded states: kept samples and their rows (None: all)."""
        states = self.writer.encoding.decode(staged)
        return self.guard.screen(samples, states[STATE_TENSORS[0]], states.get(FINAL_STATE))

    def _batch(self, piece: _Piece, staged: dict[str, torch.Tensor]) -> None:
        samples = piece.batch.samples
        if piece.flag:
            samples, rows = self._screen(samples, staged)
            if not samples:
                return
            if rows is not None:
                staged = {name: t[rows] for name, t in staged.items()}
        self.writer.add_staged(
            [_info(s) for s in samples],
            np.concatenate([s.input_ids for s in samples]),
            np.concatenate([s.loss_mask for s in samples]),
            staged,
            lengths=[s.num_tokens for s in samples],
        )


def extract_batches(
    engine: Engine,
    batches: Iterable[Batch],
    writer: ShardWriter | None,
    on_batch=lambda b: None,
    staging=None,
    nonfinite: NonFiniteGuard | None = None,
) -> None:
    """The hot loop: forward each batch and hand its states to the writer without waiting for the host.

    A long sample's chunks are handed over one by one, so that copying the earlier ones overlaps the later
    ones' compute. `staging` (from `staging_buffers`) may be passed in to reuse pinned memory across
    calls. Ranks that do not write (tp_rank > 0) still take part in every forward: TP needs all of them.
    Batches with NaN or Inf go through `nonfinite` (default: fail on the first such sample).
    """
    if writer is None:
        for batch in batches:
            for _ in _forwards(engine, batch):
                pass
            on_batch(batch)
        return
    feed = _WriterFeed(writer, nonfinite or NonFiniteGuard("fail", engine.layer_ids))

    def encode(aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
        return writer.encoding.encode(aux, last, len(engine.layer_ids))

    buffers = staging or staging_buffers(engine, writer.encoding)
    with HostOffload(feed, engine.device, buffers, encode) as offload:
        for batch in batches:
            for start, stop, captured in _forwards(engine, batch):
                piece = _Piece(batch, start, stop, batch_flag(captured.aux, captured.last))
                offload.submit(piece, captured.aux, captured.last)
            on_batch(batch)


def staging_buffers(engine: Engine, encoding: Encoding) -> list:
    """Pinned host rows for a few forwards' states: a batch's, or one chunk's of a long sample."""
    widths = encoding.widths(len(engine.layer_ids), engine.hidden_size)
    return pinned_buffers(engine.device, engine.max_forward_tokens, encoding, widths)


class _HostMemory:
    """A writing rank's hot-loop host memory on a GPU, prepared on a thread while the model loads: pinned
    staging for the forwards' states and the writer's touched shard buffers. Pinning and first
    touching a few gigabytes takes a second or more, which would otherwise sit between the loaded model
    and the first batch.

    The widths are predicted from the config (`_num_aux_layers`); should the loaded engine differ, the
    prepared memory is dropped and allocated anew.
    """

    def __init__(self, opts: ExtractOptions, checked: preflight.Checked, layout: Layout):
        self.encoding = encoding(opts)
        self.widths = self.encoding.widths(_num_aux_layers(checked), checked.model.hidden_size)
        self.forward_tokens = max(checked.tokens_per_batch, opts.chunk_tokens or 0)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-memory")
        self._prepared = pool.submit(self._allocate, layout.local_rank, opts.shard_bytes)
        pool.shutdown(wait=False)

    def _allocate(self, gpu: int, shard_bytes: int) -> tuple[list, list]:
        torch.cuda.set_device(gpu)  # pinned memory belongs to the current device's context, per thread
        staging = pinned_buffers("cuda", self.forward_tokens, self.encoding, self.widths)
        return staging, shard_buffers(self.encoding, self.widths, shard_bytes, WRITER_THREADS + 1)

    def take(self, engine: Engine) -> tuple[list, list]:
        """(staging, shard buffers) for `engine`'s widths and forwards."""
        staging, buffers = self._prepared.result()
        widths = self.encoding.widths(len(engine.layer_ids), engine.hidden_size)
        if (self.widths, self.forward_tokens) != (widths, engine.max_forward_tokens):
            return staging_buffers(engine, self.encoding), []
        return staging, buffers


def _count_owned(layout: Layout, sources: Sequence[Source]) -> int | None:
    """This replica's share of the records, for the progress ETA; None when a source cannot say."""
    counts = [source.count() for source in sources]
    return None if None in counts else len(range(layout.dp_rank, sum(counts), layout.dp_size))


def _verify(
    opts: ExtractOptions, engine: Engine, layout: Layout, coord: Coordinator, model_dir: Path, head: list[Sample],
    meta: dict,
) -> list[dict]:
    """--verify N: the parity gate on each replica's first N samples. Its rows (and, on a MoE model, how HF
    was routed) go into the run's metadata; the leader prints the rows."""
    verified = _parity_gate(engine, layout, coord, model_dir, head, opts.verbose) if opts.verify else {"rows": []}
    meta["parity"] = verified["rows"]
    if "routing" in verified:
        meta["parity_routing"] = verified["routing"]
    if layout.leads:
        for line in parity_lines(verified["rows"]):
            _note(line)
    return verified["rows"]


def _parity_gate(
    engine: Engine, layout: Layout, coord: Coordinator, model_dir: Path, head: list[Sample], verbose: bool
) -> dict:
    """Parity gate on each replica's first samples, before extraction spends any time. Every rank takes
    part, and every rank stops if any replica fails: a TP peer left running would wait in NCCL forever.

    On a MoE model HF is sent to the experts the engine chose (parity.ForcedRouting) where SGLang exposes
    them and HF's MoE block is one that can be forced, so that near-tied router scores, which bf16 and FP8
    rounding resolve differently in the two stacks, do not compare a token on two different experts; how
    often HF's own router would have chosen otherwise is recorded."""
    states = []
    for s in head:
        if engine.is_moe:
            with engine.recording_routing() as chosen:
                c = engine.capture([s.input_ids])
            # A sample longer than one forward's budget is routed chunk by chunk.
            experts = {layer: None if any(i is None for i in ids) else torch.cat(ids) for layer, ids in chosen.items()}
        else:
            c, experts = engine.capture([s.input_ids]), {}
        states.append((s.input_ids.tolist(), c.aux.cpu(), c.last.cpu(), experts))
    fp8 = parity.is_fp8_block(engine.quantization)
    result, failure = {"rows": []}, None
    if layout.writes and head:
        with foreign_output_hidden(not verbose):
            hf = parity.load_hf_model(str(model_dir), engine.dtype, str(engine.device))
        exposed = all(experts and all(ids is not None for ids in experts.values()) for _, _, _, experts in states)
        forcing = parity.ForcedRouting(hf) if engine.is_moe and exposed and parity.ForcedRouting.supports(hf) else None
        try:
            rows = parity.compare(states, hf, engine.layer_ids, engine.dtype, moe=engine.is_moe,
                                  final_state=engine.final_state, fp8=fp8, forcing=forcing)
        finally:
            if forcing is not None:
                forcing.remove()
        del hf
        if torch.device(engine.device).type == "cuda":
            torch.cuda.empty_cache()  # once, so HF's weights do not shrink the extraction's activation room
        result["rows"] = [r.to_json() for r in rows]
        if engine.is_moe:
            result["routing"] = [layer.to_json() for layer in forcing.layers.values()] if forcing else "not forced"
        try:
            parity.check(rows, engine.dtype, len(head), moe=engine.is_moe, fp8=fp8)
        except parity.ParityError as e:
            failure = f"dp replica {layout.dp_rank}: {e}"
    failures = [f for f in coord.all_gather(failure) if f]
    if failures:
        raise parity.ParityError(failures[0])
    return result


def _sample_tokenizer(opts: ExtractOptions, model_dir: Path) -> SampleTokenizer:
    from transformers import AutoTokenizer

    return SampleTokenizer(
        AutoTokenizer.from_pretrained(model_dir, trust_remote_code=opts.trust_remote_code),
        max_length=opts.max_length,
        overlong=opts.overlong,
        trim_after_last_loss=opts.trim_after_last_loss,
        min_loss_run=_min_loss_run(opts),
    )


def _min_loss_run(opts: ExtractOptions) -> int:
    return opts.min_loss_run if opts.min_loss_run is not None else RECIPES[opts.recipe].min_loss_run


def encoding(opts: ExtractOptions) -> Encoding:
    return Encoding(opts.store, opts.compress, final_state=RECIPES[opts.recipe].final_state)


def dry_run(opts: ExtractOptions) -> planning.Plan:
    """The real run's checks, then the whole corpus tokenized as the run would and its output sized,
    without loading the model."""
    checked = preflight.check(opts)
    model = checked.model
    return planning.plan(opts.data, _sample_tokenizer(opts, model.path), opts.out, model.hidden_size,
                         _num_aux_layers(checked), encoding(opts), strict=opts.strict)


def _num_aux_layers(checked: preflight.Checked) -> int:
    """Before the model loads: every supported model's SGLang EAGLE-3 default captures three layers."""
    return len(checked.layer_ids) if checked.layer_ids is not None else 3


def run(opts: ExtractOptions) -> Summary | None:
    """Run this process's part of the job; the leading process gets the whole run's summary.

    Into a directory that already holds shards this resumes: see `resume`.
    """
    start = time.perf_counter()
    checked = preflight.check(opts)
    layout = layout_from_env(opts.tp)
    out = Path(opts.out)
    with foreign_output_hidden(not opts.verbose):
        tokenizer = _sample_tokenizer(opts, checked.model.path)
    known = _known_before_loading(opts, checked, tokenizer)
    finished = resume.finished(out, known, checked.corpus_paths)
    if finished is not None:
        # Every rank finds the same, and no rank loads the model to find nothing to do; the leader checks the
        # shards' checksums and rebuilds a lost index.
        if layout.leads:
            for note in resume.settle_finished(out, finished):
                _note(note)
            _note(f"already complete: {out} holds this run's finished output, nothing to extract")
        counts = finished["result"]
        return Summary(records=counts["records"], resumed=counts["extracted"], skipped=counts["skipped"],
                       rejected=counts["rejected"], dropped=counts["dropped"]) if layout.leads else None
    coord = Coordinator(layout, namespace=f"run-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    if opts.strict:
        _stop_at_the_first_bad_record(opts, layout, coord, tokenizer)
    locks = []

    def take_over() -> dict:
        lock, existing = resume.take_over(out)
        locks.append(lock)
        return asdict(existing)

    try:
        # Nobody touches the directory before the leader holds it and has cleared a crashed run's leftovers.
        existing = resume.Existing(**coord.from_leader(take_over))
        return _run(opts, checked, tokenizer, known, layout, coord, existing, start)
    finally:
        for lock in locks:
            lock.release()


def _stop_at_the_first_bad_record(
    opts: ExtractOptions, layout: Layout, coord: Coordinator, tokenizer: SampleTokenizer
) -> None:
    """--strict: each replica reads and tokenizes its share before the model loads, and the run stops at
    the first bad record in corpus order, whichever replica holds it, reported once."""
    first = None
    for item in read_corpus(opts.data, owns=layout.owns):
        if isinstance(item, Record):
            item = tokenizer(item)
        if isinstance(item, Reject) and item.kind != "skipped":
            first = item.to_json()
            break
    found = [reject for reject in coord.all_gather(first) if reject]
    if not found:
        return
    error = BadRecordError(Reject(**min(found, key=lambda reject: reject["index"])))
    if layout.world_size == 1:
        raise error
    if layout.leads:
        _note(f"Error: {error}")
    coord.barrier()  # nobody exits before it is said: torchrun stops the others at the first exit
    raise ReportedByLeader(str(error))


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(
    opts: ExtractOptions, checked: preflight.Checked, tokenizer: SampleTokenizer, known: dict, layout: Layout,
    coord: Coordinator, existing: resume.Existing, start: float,
) -> Summary | None:
    """The phases of one attempt, in order: load the model, claim the output directory for this run,
    read the samples still pending, verify the first ones against HF, extract the rest, finish."""
    out = Path(opts.out)
    if layout.leads:
        for note in existing.notes:
            _note(note)
    on_gpu = torch.device(checked.device).type == "cuda"
    host = _HostMemory(opts, checked, layout) if on_gpu and layout.writes else None
    engine = _load(opts, checked, layout)
    meta = run_metadata(known, engine)
    done = _claim(opts, checked, layout, coord, existing, meta)
    with _resumable(out), ExitStack() as journals:
        rejects = journals.enter_context(Journal(out / f".rejects.dp{layout.dp_rank}.jsonl")) if layout.writes else None
        tally = Tally(rejects, opts.strict, opts.nonfinite)
        samples = _pending(opts, layout, tokenizer, done, tally)
        head = list(islice(samples, opts.verify))
        tally.summary.parity = _verify(opts, engine, layout, coord, checked.model.path, head, meta)
        staging, buffers = host.take(engine) if host else (None, [])
        writer = _writer(opts, layout, existing, engine, meta, journals, buffers, on_gpu) if layout.writes else None
        _extract(opts, checked, layout, engine, chain(head, samples), writer, staging, tally)
    tally.summary.seconds = time.perf_counter() - start
    return _finish(out, layout, coord, tally.summary)


def _load(opts: ExtractOptions, checked: preflight.Checked, layout: Layout) -> Engine:
    with foreign_output_hidden(not opts.verbose):
        return Engine(EngineConfig(
            model_path=str(checked.model.path),
            device=checked.device,
            dtype=_compute_dtype(opts, checked.device),
            tp_size=opts.tp,
            tp_rank=layout.tp_rank,
            gpu_id=layout.local_rank,
            nccl_port=layout.nccl_port(opts.port_base),
            attention_backend=opts.attention_backend,
            max_tokens_per_batch=checked.tokens_per_batch,
            max_seqs_per_batch=opts.seqs_per_batch,
            chunk_tokens=opts.chunk_tokens,
            context_length=max(opts.max_length, 8),
            layer_ids=checked.layer_ids,
            final_state=opts.final_state,
            load_format=opts.load_format,
            mem_fraction_static=opts.mem_fraction_static,
            trust_remote_code=opts.trust_remote_code,
        ))


def _claim(
    opts: ExtractOptions, checked: preflight.Checked, layout: Layout, coord: Coordinator, existing: resume.Existing,
    meta: dict,
) -> np.ndarray:
    """Checks that the directory's earlier shards come from this same run (once the model is loaded: the
    default layer ids and the compute dtype come from SGLang) and returns which records they hold."""
    out = Path(opts.out)

    def claim() -> list[str]:
        identity = manifest.run_identity(meta, checked.corpus_paths)
        notes = resume.check_identity(out, identity, opts.force)
        resume.done_mask(out, existing.shards)  # a damaged shard refuses the run before anything is written
        return notes + resume.claim(out, identity)

    notes = coord.from_leader(claim)
    done = resume.done_mask(out, existing.shards)
    if layout.leads:
        for note in notes:
            _note(note)
        if existing.shards:
            kept = f"{plural(int(done.sum()), 'sample')} in {plural(len(existing.shards), 'complete shard')}"
            _note(f"resuming in {out}: {kept} are kept")
    return done


def _writer(
    opts: ExtractOptions, layout: Layout, existing: resume.Existing, engine: Engine, meta: dict, journals: ExitStack,
    buffers: list, on_gpu: bool,
) -> ShardWriter:
    out = Path(opts.out)
    shard_log = journals.enter_context(Journal(manifest.journal_path(out, layout.dp_rank), durable=True))
    return ShardWriter(
        out,
        meta,
        shard_bytes=opts.shard_bytes,
        shard_numbers=resume.shard_numbers(existing.first_number, layout),
        on_written=lambda shard: shard_log.append(asdict(shard)),
        # On a GPU the first shards would otherwise fill fresh pages on the hot path; on CPU
        # (tiny models, tests) that memory would mostly sit unused.
        encoding=encoding(opts),
        widths=encoding(opts).widths(len(engine.layer_ids), engine.hidden_size) if on_gpu else None,
        buffers=buffers,
    )


def _extract(
    opts: ExtractOptions, checked: preflight.Checked, layout: Layout, engine: Engine, samples: Iterator[Sample],
    writer: ShardWriter | None, staging: list | None, tally: Tally,
) -> None:
    show = layout.leads and (opts.progress or opts.progress_every > 0)
    label = f"dp {layout.dp_rank}/{layout.dp_size}" if layout.dp_size > 1 else "extract"
    heartbeat = None if opts.progress else opts.progress_every
    with RunProgress(lambda: _count_owned(layout, checked.sources), label, enabled=show, heartbeat=heartbeat) as bar:

        def advance(batch: Batch) -> None:
            bar.advance(tally.batch_done(batch), batch.num_tokens, writer.bytes_written if writer else 0)

        extract_start = time.perf_counter()
        batches = batch_by_tokens(samples, checked.tokens_per_batch, opts.seqs_per_batch)
        guard = NonFiniteGuard(opts.nonfinite, engine.layer_ids, tally.nonfinite)
        try:
            extract_batches(engine, batches, writer, advance, staging=staging, nonfinite=guard)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            tally.written(writer.close(), writer)
            bar.advance(0, 0, writer.bytes_written)  # the last shards land after the last batch
        tally.summary.extract_seconds = time.perf_counter() - extract_start


def _finish(out: Path, layout: Layout, coord: Coordinator, summary: Summary) -> Summary | None:
    """Every replica has finished writing: the leader describes the whole directory (rejects.jsonl, the
    index, then the manifest) and gets the run's summary."""
    parts = coord.all_gather(asdict(summary) if layout.writes else None)
    total = Summary()
    for p in parts:
        if p is not None:
            total = total.merge(Summary(**p))
    if not layout.leads:
        return None
    with _resumable(out):
        _merge_rejects(out)
        write_index(out)
        # Last, so that a manifest saying "complete" means the index and rejects.jsonl are final too.
        counts = {key: getattr(total, key) for key in ("records", "skipped", "rejected", "dropped")}
        manifest.consolidate(out, status="complete", result={**counts, "extracted": total.extracted + total.resumed})
    return total


@contextmanager
def _resumable(out: Path) -> Iterator[None]:
    """Turns a failure that a re-run recovers from into a StoppedError that says so."""
    try:
        yield
    except (OSError, NonFiniteError) as e:
        raise StoppedError(
            f"{e}\nThe complete shards in {out} are kept: once the cause is fixed, re-running the same command "
            f"resumes from them."
        ) from e


def _merge_rejects(out: Path) -> None:
    """One rejects.jsonl in record order from the replicas' parts; the parts go."""
    parts = sorted(out.glob(resume.REJECTS_PARTS))
    rows = sorted((row for part in parts for row in read_journal(part)), key=lambda row: row["index"])
    atomic_write(out / REJECTS_FILE, lambda tmp: tmp.write_text("".join(json.dumps(row) + "\n" for row in rows)))
    for part in parts:
        part.unlink()
