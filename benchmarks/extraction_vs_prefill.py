"""Benchmarking: extraction throughput against bare SGLang prefill, on the same GPU, batches and process.

First, the warm-up batches are timed as they come, on a freshly loaded engine: the cold start
(`--cold`: with an empty JIT cache, as on a fresh machine), beside the warm figures that follow. Then bare
prefill runs once over the batches to be timed (`bare_first_pass_tok_s`, cold for every token count the
warm-up did not have), so that every mode below is timed on warm kernels; `timed_compiled` counts the JIT
cache files added while they ran (0: none compiled). Modes, in this order, each after untimed warm-up batches:
1. bare prefill: SGLang's forward with no capture and no copy-out (the ceiling);
2. extraction: capture, copy to host and write shards to each `--out` (tmpfs or disk), timed until the
   last shard is on disk; with --data, for the first `--store`/`--out`, once more fed from the corpus as
   bin/extract.py is (`fed_batches`: the records read, tokenized and their images prepared while the forwards
   run), `extract_fed_*`;
3. optionally HF transformers with output_hidden_states, copying the same layers to host;
4. optionally the peers users would run instead (`--baseline`, benchmarks/peers/): SGLang's own
   return_hidden_states and SpecForge's generator run first, each with the whole GPU, and every peer's
   states are cross-checked against ours at the end.
The result JSONs are rewritten as each of these parts finishes (`ResultFiles`): a run cut short keeps what
it measured.
Under torchrun every data-parallel replica runs its share and the figures are aggregated.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.metadata
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from benchmarks.bench_options import BenchOptions
from benchmarks.peers import baselines as peers
from offline_extract.data.batching import Batch, batch_by_tokens
from offline_extract.data.corpus import Record
from offline_extract.data.sources import open_sources
from offline_extract.data.tokenization import Sample, SampleTokenizer
from offline_extract.data.tokenizer_processes import TokenizerProcesses
from offline_extract.default_model import TRAINING_TEXT
from offline_extract.engine.distributed import Coordinator, Layout, Share, layout_from_env
from offline_extract.engine.kernels import JIT_CACHES, jit_cache_files  # noqa: E402
from offline_extract.engine.sglang_adapter import Engine
from offline_extract.extraction import engine_config, pending_samples, sample_tokenizer, start_tokenizer_processes
from offline_extract.feed import extract_batches, prepared_ahead, staging_buffers, warm_up_encoding
from offline_extract.lifecycle import startup_gc
from offline_extract.lifecycle.timeline import Timeline
from offline_extract.options import ExtractOptions, default_tokens_per_batch, default_writers
from offline_extract.preflight import read_model
from offline_extract.store.manifest import file_fingerprint
from offline_extract.store.schema import FINAL_STATE_TENSOR, STATE_TENSORS, Encoding, RunInfo
from offline_extract.store.writer import ShardWriter
from offline_extract.summary import Tally
from offline_extract.testing.models import build_model

# Dense bf16 tensor-core peaks, for MFU.
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def synthetic_corpus(
    tokenizer: SampleTokenizer, opts: BenchOptions, dp_rank: int = 0, dp_size: int = 1
) -> list[Sample]:
    """Chat-formatted samples with a realistic length distribution, so loss masks are real.

    Each sample's length is drawn first: lognormal (sigma 0.8) with mean `mean_length`, capped by
    `longest`, or exactly `mean_length` for "fixed". A chat of random words from the tiny model's
    vocabulary, long enough to overshoot, is then tokenized and cut to that length.
    """
    rng = np.random.default_rng(opts.seed)
    words = TRAINING_TEXT.split()
    samples, total, i = [], 0, 0
    sigma = 0.8
    while total < opts.synthetic_tokens:
        if opts.lengths == "fixed":
            target = opts.mean_length
        else:
            target = int(min(opts.longest, max(16, rng.lognormal(math.log(opts.mean_length) - sigma**2 / 2, sigma))))
        turns = int(rng.integers(1, 4))
        messages = []
        for _ in range(turns):
            # At least one token a word, so `n` words overshoot; a fifth of each turn is the user's.
            n = max(2, target // turns + 8)
            messages.append(("user", " ".join(rng.choice(words, max(1, n // 5)))))
            messages.append(("assistant", " ".join(rng.choice(words, n - n // 5))))
        record = Record(
            source="synthetic", line=i + 1, index=i, id=f"synthetic-{i}", format="openai", messages=tuple(messages)
        )
        sample = tokenizer(record)
        sample = dataclasses.replace(
            sample, input_ids=sample.input_ids[:target], loss_mask=sample.loss_mask[:target], truncated=True
        )
        i += 1
        total += sample.num_tokens
        if sample.index % dp_size == dp_rank:
            samples.append(sample)
    return samples


def data_corpus(
    opts: BenchOptions, run: ExtractOptions, model_dir: Path, layout: Layout
) -> tuple[SampleTokenizer, list[Sample], dict]:
    """--data: this replica's samples of the corpus `run.data`, made as bin/extract.py makes them (its reader,
    the model's tokenizer or processor, its chat template, its images decoded and prepared), up to
    `opts.num_tokens` / replicas tokens; with the tokenizer and what they are (`data_facts`)."""
    tokenizer = sample_tokenizer(run, model_dir)
    nothing_done = np.zeros(0, dtype=bool)
    tally = Tally(None, strict=False, nonfinite=run.nonfinite)
    pending = pending_samples(run.data, Share(layout, nothing_done), tokenizer, nothing_done, tally)
    cap = opts.num_tokens / layout.dp_size if opts.num_tokens else math.inf
    samples, tokens = [], 0
    while tokens < cap and (sample := next(pending, None)) is not None:
        samples.append(sample)
        tokens += sample.num_tokens
    if not samples:
        raise ValueError(f"--data gave no sample to time: {tally.summary.no_sample_verdict(run.data)}")
    return tokenizer, samples, data_facts(run.data, samples, tally.summary)


def data_facts(data: tuple[str, ...], samples: list[Sample], summary) -> dict:
    """What a --data row ran on, for running it again: each corpus file's identity as a run's manifest records
    it (`file_fingerprint`: its bytes and sha256, of sampled blocks over 16 MiB), and the records read, the
    samples they gave, their tokens and image tokens."""
    with_images = [s for s in samples if s.images is not None]
    return {
        "corpus": [file_fingerprint(source.path) for source in open_sources(data)],
        "records": summary.records,
        "skipped": summary.skipped,
        "rejected": summary.rejected,
        "samples": len(samples),
        "tokens": sum(s.num_tokens for s in samples),
        "samples_with_images": len(with_images),
        "image_tokens": image_tokens(with_images),
    }


def image_tokens(samples) -> int:
    return int(sum(s.images.token_mask.sum() for s in samples if s.images is not None))


def _replicas_facts(coord: Coordinator, layout: Layout, facts: dict) -> dict:
    """`data_facts` of every replica's share as one: the counts summed over the writing ranks."""
    shares = [f for f in coord.all_gather(facts if layout.writes else None) if f is not None]
    return {k: v if k == "corpus" else sum(f[k] for f in shares) for k, v in facts.items()}


def run_options(opts: BenchOptions, model_dir: Path) -> ExtractOptions:
    """The run of bin/extract.py that the bench stands for: through its options, the samples (with --data) and
    the engine (`engine_config`) measured are the ones a run gets."""
    return ExtractOptions(
        data=opts.data,
        model=str(model_dir),
        dtype=opts.dtype,
        tp=opts.tp,
        max_length=opts.longest,
        tokens_per_batch=opts.tokens_per_batch,
        chunk_tokens=opts.chunk_tokens,
        attention_backend=opts.attention_backend,
        load_format=opts.load_format,
        image_threads=opts.image_threads,
    )


def bench_corpus(
    opts: BenchOptions, run: ExtractOptions, model_dir: Path, layout: Layout, coord: Coordinator
) -> tuple[SampleTokenizer, list[Sample], list[Batch], dict | None]:
    """This replica's samples and the batches that every mode runs, as a run packs them, with their
    tokenizer: --data's (`data_corpus`), with every replica's `data_facts` as one, or synthetic ones (no facts)."""
    if opts.data:
        tokenizer, samples, facts = data_corpus(opts, run, model_dir, layout)
        facts = _replicas_facts(coord, layout, facts)
        if opts.baselines and facts["image_tokens"]:
            raise ValueError(
                f"--baseline {' '.join(opts.baselines)}: the peers prefill token ids alone, and --data "
                f"holds image chats ({facts['samples_with_images']} samples with images)"
            )
    else:
        from transformers import AutoTokenizer

        tokenizer = SampleTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=opts.longest)
        samples, facts = synthetic_corpus(tokenizer, opts, layout.dp_rank, layout.dp_size), None
    return tokenizer, samples, list(batch_by_tokens(samples, budget(opts, model_dir), run.seqs_per_batch)), facts


def for_the_model(opts: BenchOptions, model_dir: Path) -> BenchOptions:
    """opts with --tokens-per-batch and --writers, where not given, at bin/extract.py's defaults for the model on a
    GPU."""
    model = read_model(model_dir)
    facts = ("cuda", model.hidden_size, model.moe)
    return dataclasses.replace(
        opts,
        tokens_per_batch=opts.tokens_per_batch or default_tokens_per_batch(*facts),
        writers=opts.writers or default_writers(*facts),
    )


def budget(opts: BenchOptions, model_dir: Path) -> int:
    """--tokens-per-batch, else bin/extract.py's default for the model on a GPU."""
    return for_the_model(opts, model_dir).tokens_per_batch


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_flops(config, start: int, stop: int) -> float:
    """Causal attention FLOPs of tokens start..stop-1 of one sequence, each attending to itself and every
    token before it (for a chunk, its prefix included): token i scores i+1 keys and mixes i+1 values,
    2 FLOPs a multiply-add, in each query head of each layer:

        4 * layers * heads * head_dim * sum_{i=start}^{stop-1} (i + 1)
      = 4 * layers * heads * head_dim * (stop - start) * (start + stop + 1) / 2

    Summed over the chunks of a sequence of L tokens this is the unchunked 4*layers*heads*head_dim*L(L+1)/2:
    chunking moves attention work between forwards, it does not add any. Kernels that compute whole
    masked tiles do a little more; that is not counted (MFU counts the model's FLOPs).
    """
    return (
        4
        * config.num_hidden_layers
        * config.num_attention_heads
        * _head_dim(config)
        * (stop - start)
        * (start + stop + 1)
        / 2
    )


def model_flops_per_token(config, samples: list[Sample]) -> float:
    """Forward FLOPs per token: 2 x matmul weights (no LM head: extraction computes no logits) plus
    causal attention (`attention_flops`), averaged over the samples' tokens."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, head_dim = config.num_attention_heads, _head_dim(config)
    kv = getattr(config, "num_key_value_heads", heads)
    inter = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    tokens = sum(s.num_tokens for s in samples)
    attention = sum(attention_flops(config, 0, s.num_tokens) for s in samples)
    return 2 * layers * per_layer + attention / tokens


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _host_peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _host_facts() -> dict:
    """The host's CPU and the GPU's clocks: a small model's rate follows the host's speed, and a run's bare rate
    the GPU's clocks, and neither is the same on every machine of one kind."""
    cpu = None
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    facts = {"cpu": cpu, "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))}
    try:
        import pynvml

        pynvml.nvmlInit()
        # By UUID: NVML numbers every GPU of the host, CUDA only those CUDA_VISIBLE_DEVICES leaves.
        gpu = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties().uuid}")
        facts |= {
            "gpu_sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM),
            "gpu_sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(gpu, pynvml.NVML_CLOCK_SM),
            "gpu_power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(gpu) / 1000,
            "gpu_temperature_c": pynvml.nvmlDeviceGetTemperature(gpu, pynvml.NVML_TEMPERATURE_GPU),
        }
    except Exception as e:  # NVML is a diagnostic here: its absence must not cost the measurement
        facts["gpu_clocks_error"] = f"{type(e).__name__}: {e}"
    return facts


def out_kind(path: str) -> str:
    """'tmpfs' or 'disk', from the file system that holds `path`."""
    target = os.path.realpath(path)
    best, kind = "", "disk"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, "tmpfs" if fstype in ("tmpfs", "ramfs") else "disk"
    return kind


def disk_write_rate(directory: Path, total_bytes: int, streams: int) -> float:
    """Aggregate bytes/s of `streams` parallel sequential writers with fsync, like the shard writers."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = np.ones(64 << 20, dtype=np.uint8)
    per_stream = max(len(chunk), total_bytes // streams)

    def write(i: int) -> None:
        path = directory / f".probe-{i}"
        with open(path, "wb") as f:
            for _ in range(per_stream // len(chunk)):
                f.write(memoryview(chunk))
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams * (per_stream // len(chunk)) * len(chunk) / (time.perf_counter() - start)


def _on_gpu(engine: Engine) -> bool:
    # The bench runs on a GPU; its CPU tests drive the same code through the engine on CPU.
    return torch.device(engine.device).type == "cuda"


def _synchronize() -> None:
    # The bench runs on a GPU; its CPU tests drive the same code through the engine on CPU.
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(coord: Coordinator, fn, clock: "_ForwardClock | None" = None) -> float:
    """Wall seconds of fn() on the slowest rank; `clock` (if given) is restarted at the same instant."""
    coord.barrier()
    _synchronize()
    if clock is not None:
        clock.restart()
    start = time.perf_counter()
    fn()
    _synchronize()
    seconds = time.perf_counter() - start
    if clock is not None:
        clock.wall_s = seconds
    return max(coord.all_gather(seconds))


def jit_cache_entries(caches: dict[str, str]) -> int:
    """How many files the compilers' caches hold (`kernels.jit_cache_files`)."""
    return len(jit_cache_files(caches))


def _host_thread_sweep(counts: tuple[int, ...], timed_extraction, root: Path, tokens: int) -> dict[str, float]:
    """Extraction tokens/s with torch's intra-op threads (which copy each batch's states into the shard
    buffers, beside the writer threads and the thread launching the forwards) at each of `counts`.
    `timed_extraction(name)` writes into `root / name`, a folder of its own for each count (a writer
    refuses to overwrite another run's shards), removed once timed as every other mode's is."""
    before = torch.get_num_threads()
    rates = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            name = f"threads_{n}"
            try:
                rates[str(n)] = tokens / timed_extraction(name)
            finally:
                shutil.rmtree(root / name, ignore_errors=True)
    finally:
        torch.set_num_threads(before)
    return rates


def _first_pass(engine: Engine, coord: Coordinator, batches: list[Batch]) -> dict:
    """Bare prefill over the timed batches once, before any mode is timed. A forward of a token count that
    the warm-up batches did not have may compile (a MoE model's Triton kernels are specialized by token
    count), and that compiling would land in whichever mode ran first. Its seconds are the cold figure beside
    the warm ones; `compiled`, the files it added to the JIT caches (slowest rank's seconds, most files of any rank)."""
    before = jit_cache_entries(engine.jit_caches)
    seconds = _timed(coord, lambda: _bare(engine, batches))
    return {"seconds": seconds, "compiled": max(coord.all_gather(jit_cache_entries(engine.jit_caches) - before))}


def _bare(engine: Engine, batches: list[Batch]) -> None:
    for b in batches:
        engine.prefill([s.input_ids for s in b.samples], [s.images for s in b.samples])


def _hf_pass(model, batches: list[Batch], layer_ids, device) -> None:
    """The usual HF script: pad each batch, output_hidden_states, copy the layers it needs to host."""
    pick = [k + 1 for k in layer_ids] + [-1]
    for b in batches:
        n = max(s.num_tokens for s in b.samples)
        ids = torch.zeros(len(b.samples), n, dtype=torch.long)
        mask = torch.zeros(len(b.samples), n, dtype=torch.long)
        for i, s in enumerate(b.samples):
            ids[i, : s.num_tokens] = torch.from_numpy(s.input_ids)
            mask[i, : s.num_tokens] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        keep = mask.bool()
        for j in pick:
            hs[j][keep].cpu()


class _ForwardClock:
    """The engine, timed from both sides of every forward (each chunk of a long sample's `chunks` is one).

    On the host: the main thread's seconds inside forwards; the rest of a mode's wall time is what the host
    adds around them (batch hand-off, waits for free staging buffers). The host's seconds inside a forward
    are its GPU time only while the host is ahead of the GPU: a forward waits somewhere inside SGLang for
    the GPU work before it (one H200's extract and bare host seconds in forwards both equal the bare GPU
    time), so a host that keeps the GPU fed spends the GPU's time there; a host that is behind (waiting for
    the writer, say) finds the GPU idle and spends only the forward's launch time there (TP=2 on
    2026-12-01: 1.2 s of forwards in 4.9 s of extraction, against bare's 2.9 s).

    On the GPU, from CUDA events on the compute stream: how long after the start the first forward began
    (start-up), how long the GPU sat idle between forwards because the host had not enqueued the next one,
    and what ran after the last forward ended (the tail: copies, shard assembly and writes still in
    flight). `per_forward` gives the same forward by forward. An engine on CPU (the CPU tests) gets the
    host side only.
    """

    def __init__(self, engine: Engine):
        self._engine = engine
        self._on_gpu = _on_gpu(engine)
        self.restart()

    def restart(self) -> None:
        self.seconds = 0.0
        # What the forwards were handed: each mode's must be the same inputs.
        self.tokens = 0
        self.sequences_with_images = 0
        self.wall_s = 0.0
        self.started = time.perf_counter()
        self._host: list[tuple[float, float]] = []  # (start, seconds) of each forward
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._origin = self._event()

    def _event(self) -> torch.cuda.Event | None:
        if not self._on_gpu:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _timed(self, step):
        before = self._event()
        start = time.perf_counter()
        try:
            return step()
        finally:
            seconds = time.perf_counter() - start
            self.seconds += seconds
            self._host.append((start, seconds))
            self._events.append((before, self._event()))

    def _counted(self, seqs, images) -> None:
        self.tokens += sum(len(s) for s in seqs)
        self.sequences_with_images += sum(im is not None for im in images or ())

    def capture(self, seqs, images=None):
        self._counted(seqs, images)
        return self._timed(lambda: self._engine.capture(seqs, images))

    def prefill(self, seqs, images=None):
        self._counted(seqs, images)
        return self._timed(lambda: self._engine.prefill(seqs, images))

    def chunks(self, ids, chunk):
        self._counted([ids], None)
        parts = self._engine.chunks(ids, chunk)
        done = object()
        # The last step only finds the generator exhausted (and frees the KV pool): a host-only step.
        while (part := self._timed(lambda: next(parts, done))) is not done:
            yield part

    def phases(self) -> dict:
        """GPU-side split of the last timed mode (call after it synchronized)."""
        if not self._events or not self._on_gpu:
            return {}
        first, last = self._events[0][0], self._events[-1][1]
        idle = sum(max(0.0, end.elapsed_time(begin)) for (_, end), (begin, _) in zip(self._events, self._events[1:]))
        return {
            "first_forward_s": self._origin.elapsed_time(first) / 1e3,
            "gpu_idle_between_forwards_s": idle / 1e3,
            "after_last_forward_s": self.wall_s - self._origin.elapsed_time(last) / 1e3,
        }

    def per_forward(self) -> dict:
        """Forward by forward, of the last timed mode (after it synchronized): the host's seconds inside it
        and before it outside any forward (the hand-off of the batch before: waits for staging, the
        writer), and on a GPU its GPU seconds and the GPU's idle seconds before it."""
        ends = [self.started] + [a + s for a, s in self._host]
        out = {
            "host_s": [s for _, s in self._host],
            "host_before_s": [a - end for (a, _), end in zip(self._host, ends)],
        }
        if self._on_gpu and self._events:
            out["gpu_s"] = [begin.elapsed_time(end) / 1e3 for begin, end in self._events]
            out["gpu_idle_before_s"] = [
                max(0.0, end.elapsed_time(begin)) / 1e3
                for (_, end), (begin, _) in zip([(None, self._origin)] + self._events, self._events)
            ]
        return {k: [round(x, 5) for x in v] for k, v in out.items()}

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _DiscardWriter:
    """Takes batches like ShardWriter and keeps nothing: isolates the copy-out from shard writing.

    A long sample's chunks still land in host rows, as a writer's would, in one scratch area of
    `rows` x `widths` touched up front (as a writer's shard buffers are)."""

    bytes_written = 0

    def __init__(self, encoding: Encoding, rows: int, widths: dict[str, int]):
        self.encoding = encoding
        self._scratch = {t.name: torch.zeros(rows, widths[t.name], dtype=t.dtype) for t in encoding.staged}

    def add_staged(self, *args, **kwargs) -> None:
        pass

    def begin_sample(self, sample, input_ids, loss_mask, widths, stream=False) -> dict[str, torch.Tensor]:
        return {name: t[: len(input_ids)] for name, t in self._scratch.items()}

    def filled(self, rows: int) -> None:
        pass

    def end_sample(self, keep: bool = True, ending: bool = False) -> None:
        pass

    def close(self) -> list:
        return []


@dataclasses.dataclass
class _Bench:
    """What every mode of one run shares: its options, this rank's place among the replicas, the corpus and the
    batches made of it (the warm-up ones and the timed ones), the model's config, and where results go."""

    opts: BenchOptions
    layout: Layout
    coord: Coordinator
    run: ExtractOptions
    model_dir: Path
    tokenizer: SampleTokenizer
    samples: list[Sample]
    warm: list[Batch]
    timed: list[Batch]
    data: dict | None
    config: object  # the model's HF config; its language model's is `text_config`
    files: ResultFiles
    # The timed tokens of every replica: each counts once, however many TP ranks computed it.
    timed_tokens: int = 0

    @property
    def text_config(self):
        return self.config.get_text_config()


@dataclasses.dataclass(frozen=True)
class _BareFigures:
    """Bare prefill over the timed batches, before any extraction: the first pass (cold for a token count the
    warm-up did not have), then the timed pass every ratio divides by, with where its time went."""

    seconds: float
    forward_s: float
    phases: dict
    ranks: list[dict]
    first_pass: dict
    jit_cache_entries: int  # the JIT caches' files once the first pass is done
    by_chunk: dict[str, float] | None
    fp8_error: dict | None  # fp8's decoded states against bf16's, where any --store is fp8


def run_bench(opts: BenchOptions) -> list[dict]:
    timeline = Timeline()
    layout = _checked_layout(opts)
    torch.cuda.set_device(layout.local_rank)
    coord = Coordinator(layout, namespace=f"bench-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    model_dir = Path(opts.model) if opts.model else _generated_config(opts.shape, opts.longest, layout, coord)
    bench = _bench_inputs(for_the_model(opts, model_dir), layout, coord, model_dir)
    pending = peers_first(
        bench.opts,
        bench.files,
        model_dir,
        bench.tokenizer.tokenizer,
        [[s.input_ids for s in b.samples] for b in bench.warm + bench.timed],
        bench.text_config.num_hidden_layers,
    )
    engine, cold = _loaded_engine(bench, timeline)
    return measure(bench, engine, cold, pending)


def _checked_layout(opts: BenchOptions) -> Layout:
    """This process's place among the ranks, once the machine and the options allow a measurement at all."""
    if not torch.cuda.is_available():
        raise ValueError("bin/bench.py times extraction on a GPU, but torch sees no CUDA GPU here")
    if "hf" in opts.baselines and opts.tp > 1:
        raise ValueError("--baseline hf runs HF on one GPU; it cannot be combined with --tp > 1")
    layout = layout_from_env(opts.tp)
    if set(opts.baselines) - {"hf"} and layout.world_size > 1:
        raise ValueError(
            f"--baseline {', '.join(peers.OWN_PROCESS)} run on one GPU; they cannot be combined with "
            f"--tp or torchrun (world size {layout.world_size})"
        )
    if opts.baselines:
        peers.check_names(opts.baselines)
    return layout


def _bench_inputs(opts: BenchOptions, layout: Layout, coord: Coordinator, model_dir: Path) -> _Bench:
    """The corpus and its batches, split into the warm-up ones and those timed, with the model's config."""
    from transformers import AutoConfig

    run = run_options(opts, model_dir)
    tokenizer, samples, batches, data = bench_corpus(opts, run, model_dir, layout, coord)
    warm, timed = batches[: opts.warmup_batches], batches[opts.warmup_batches :]
    if not timed:
        corpus = "--data" if opts.data else f"--num-tokens {opts.synthetic_tokens}"
        raise ValueError(
            f"{corpus} makes {len(batches)} batches, all taken by --warmup-batches "
            f"{opts.warmup_batches}: nothing left to time"
        )
    tokens = sum(b.num_tokens for b in timed) if layout.writes else 0
    return _Bench(
        opts,
        layout,
        coord,
        run,
        model_dir,
        tokenizer,
        samples,
        warm,
        timed,
        data,
        AutoConfig.from_pretrained(model_dir),
        ResultFiles(opts, layout),
        timed_tokens=sum(coord.all_gather(tokens)),
    )


def _loaded_engine(bench: _Bench, timeline: Timeline) -> tuple[Engine, dict]:
    """Our engine, loaded as bin/extract.py loads it (into an empty JIT cache with --cold), and the cold start:
    the warm-up batches timed one by one on it (`_cold_start`)."""
    opts, jit_cache = bench.opts, bench.opts.jit_cache
    if opts.cold:
        jit_cache = tempfile.mkdtemp(prefix="offline_extract_cold_jit_")
        for key in JIT_CACHES:
            os.environ.pop(key, None)  # even a cache the environment names would not be cold
    timeline.mark("engine")
    run = dataclasses.replace(bench.run, jit_cache=jit_cache)
    engine = Engine(engine_config(run, bench.layout, bench.model_dir, "cuda", opts.tokens_per_batch, layer_ids=None))
    timeline.mark("loaded")
    cold = _cold_start(engine, bench.warm, timeline)
    startup_gc.start_up_done()  # where bin/extract.py's warm-up ends, as it does (bin/bench.py deferred)
    if opts.cold:
        shutil.rmtree(jit_cache, ignore_errors=True)
    return engine, cold


def measure(bench: _Bench, engine: Engine, cold: dict, pending: list[peers.Pending]) -> list[dict]:
    """Every mode on the loaded `engine`: bare prefill, then for each --store x --compress the copy-out alone and
    the extraction into each --out, then HF and the peers' cross-checks; each result saved as it is measured."""
    clock = _ForwardClock(engine)
    bare = _bare_modes(bench, engine, clock)
    results: list[dict] = []
    for encoding in (Encoding(store, compress) for store, compress in bench.opts.encodings):
        extraction = _Extraction(bench, engine, clock, encoding)
        copy_only_s = extraction.copy_only()
        for out in bench.opts.outs:
            results.append(_measure_out(extraction, out, bare, cold, copy_only_s, index=len(results)))
    if "hf" in bench.opts.baselines:
        pending.append(_hf_row(bench, engine, results))
    if pending:
        ours = peers.our_states(engine)
        for p in pending:
            peers.cross_check(p, ours)
            bench.files.done(f"cross-check {p.row.name}")
    if bench.opts.single_gpu_results:
        _add_scaling(results, bench.opts.single_gpu_results)
    return bench.files.write(final=True)


def _bare_modes(bench: _Bench, engine: Engine, clock: _ForwardClock) -> _BareFigures:
    coord, timed = bench.coord, bench.timed
    first_pass = _first_pass(engine, coord, timed)
    entries = jit_cache_entries(engine.jit_caches)
    seconds = _timed(coord, lambda: _bare(clock, timed), clock)
    forward_s, phases = clock.seconds, clock.phases()
    ranks = coord.all_gather(_rank_report(bench.layout, clock))
    by_chunk = _chunk_sweep(engine, coord, timed[0], bench.opts.chunk_sweep) if bench.opts.chunk_sweep else None
    # fp8's error against the bf16 states of the same forward passes, once for every fp8 encoding.
    fp8 = any(store == "fp8" for store, _ in bench.opts.encodings)
    fp8_error = _fp8_error(engine, timed, bench.opts.fp8_error_tokens) if fp8 else None
    return _BareFigures(seconds, forward_s, phases, ranks, first_pass, entries, by_chunk, fp8_error)


class _Extraction:
    """Extraction in one encoding, shared by every --out: its staging buffers, the shards' widths, and the
    writers of its runs."""

    def __init__(self, bench: _Bench, engine: Engine, clock: _ForwardClock, encoding: Encoding):
        self.bench, self.engine, self.clock, self.encoding = bench, engine, clock, encoding
        warm_up_encoding(engine, encoding)  # as bin/extract.py's start-up does, so nothing compiles while timed
        self.staging = staging_buffers(engine, encoding)
        self.widths = encoding.widths(len(engine.layer_ids), engine.hidden_size)
        self.info = RunInfo(
            model=str(bench.model_dir),
            layer_ids=tuple(engine.layer_ids),
            store=encoding.store,
            compress=encoding.compress,
        )
        self.host_times: dict = {}  # the host's side of the last extraction (`HostOffload.times`)

    def copy_only(self) -> float:
        """Seconds of the copy-out alone over the timed batches: captured and copied to host, nothing written."""
        bench = self.bench
        longest = max(s.num_tokens for s in bench.samples)
        scratch = longest if longest > bench.opts.tokens_per_batch else 0
        discard = _DiscardWriter(self.encoding, scratch, self.widths) if bench.layout.writes else None
        return _timed(
            bench.coord, lambda: extract_batches(self.clock, bench.timed, discard, staging=self.staging), self.clock
        )

    def writer(self, folder: Path) -> ShardWriter | None:
        """A run's writer into `folder`, made before its clock starts, as a run makes it before its first batch."""
        if not self.bench.layout.writes:
            return None
        return ShardWriter(folder, self.info, writers=self.bench.opts.writers, widths=self.widths)

    def extract(self, batches, writer: ShardWriter | None) -> None:
        self.host_times.update(extract_batches(self.clock, batches, writer, staging=self.staging))
        if writer is not None:
            writer.close()

    def timed(self, batches, writer: ShardWriter | None) -> float:
        return _timed(self.bench.coord, lambda: self.extract(batches, writer), self.clock)


def _measure_out(
    extraction: _Extraction, out: str, bare: _BareFigures, cold: dict, copy_only_s: float, index: int
) -> dict:
    """The extraction into `out`, timed until its last shard is written, and the result of it (the `index`-th
    file), saved: with bare again after it, and on the first result the host-thread sweep and --data's fed run."""
    bench, clock = extraction.bench, extraction.clock
    opts, layout, coord = bench.opts, bench.layout, bench.coord
    root = Path(out) / f"rank{layout.rank}"
    shutil.rmtree(root, ignore_errors=True)
    disk_rate = disk_write_rate(root / "probe", opts.disk_probe_bytes, opts.writers) if layout.writes else 0.0
    if _on_gpu(extraction.engine):
        torch.cuda.reset_peak_memory_stats()
    extraction.extract(bench.warm, extraction.writer(root / "warm"))
    if opts.profile:
        profiled = bench.timed[: opts.profile_batches]
        _profile(lambda: _bare(extraction.engine, profiled), Path(opts.profile), "bare")
        writer = extraction.writer(root / "profile")
        _profile(lambda: extraction.extract(profiled, writer), Path(opts.profile), "extract")
    writer = extraction.writer(root / "shards")
    extract_s = extraction.timed(bench.timed, writer)
    ranks = coord.all_gather(_rank_report(layout, clock, extraction.host_times, writer))
    written = sum(coord.all_gather(writer.bytes_written if writer is not None else 0))
    result = {
        **_run_facts(bench, extraction.engine),
        **_bare_result(bench, bare, cold),
        **_extract_result(extraction, bare, extract_s, copy_only_s, ranks),
        **_stored_result(extraction, out, disk_rate, written, extract_s, bare),
        **_host_result(bench, extraction.engine),
    }
    # Bare again on the same batches, after the extraction: a bare rate that moved while the modes were timed
    # (the GPU's clocks, the host's load) shows here rather than as the extraction's gain or loss.
    bare_after_s = _timed(coord, lambda: _bare(clock, bench.timed), clock)
    result |= {
        "bare_after_tok_s": bench.timed_tokens / bare_after_s,
        "bare_after_over_bare": bare.seconds / bare_after_s,
    }
    if index == 0:
        result |= _first_result_extras(extraction, root, bare, extract_s)
    bench.files.measured(index, result)
    if layout.leads:
        print(summary_line(result), file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return result


def _first_result_extras(extraction: _Extraction, root: Path, bare: _BareFigures, extract_s: float) -> dict:
    """What the first --store/--out's extraction is also timed for: at each --host-threads count, and with --data
    fed from the records as bin/extract.py feeds it."""
    bench, clock = extraction.bench, extraction.clock
    extras = {}
    if bench.opts.host_threads:
        extras["extract_tok_s_by_host_threads"] = _host_thread_sweep(
            bench.opts.host_threads,
            lambda name: extraction.timed(bench.timed, extraction.writer(root / name)),
            root,
            bench.timed_tokens,
        )
    if bench.opts.data:
        writer = extraction.writer(root / "fed")
        apart = start_tokenizer_processes(bench.run, "cuda", bench.tokenizer.processor is not None, bench.layout)
        try:
            if apart is not None:  # its processes' start-up is a run's beside the model load, not timed
                apart.hand(bench.tokenizer)
                apart.ready()
            fed = fed_batches(
                bench.opts, bench.run, bench.tokenizer, bench.layout, bench.warm, bench.timed, extraction.engine, apart
            )
            fed_s = extraction.timed(fed, writer)
        finally:
            if apart is not None:
                apart.close()
        extras |= _fed_figures(
            bench.coord,
            clock,
            extraction.host_times,
            writer,
            bench.timed,
            bench.timed_tokens,
            fed_s,
            bare.seconds,
            extract_s,
        )
    return extras


def _run_facts(bench: _Bench, engine: Engine) -> dict:
    """What ran: the command, machine, versions, model, and the corpus of the timed batches."""
    opts, layout, coord, timed = bench.opts, bench.layout, bench.coord, bench.timed
    return {
        "command": opts.command,
        "device": torch.cuda.get_device_name() if _on_gpu(engine) else str(engine.device),
        "host": _host_facts(),
        "world_size": layout.world_size,
        "tp_size": layout.tp_size,
        "dp_size": layout.dp_size,
        "sglang_version": importlib.metadata.version("sglang"),
        "torch_version": torch.__version__,
        "model": opts.model or f"{opts.shape} (generated config, load_format={opts.load_format})",
        "dtype": opts.dtype,
        "attention_backend": engine.attention_backend,
        "layer_ids": list(engine.layer_ids),
        "lengths": _lengths(opts),
        # With --data, what the samples came from and all of them (the timed ones are those below).
        "data": bench.data,
        "num_samples": sum(coord.all_gather(sum(len(b.samples) for b in timed) if layout.writes else 0)),
        "num_tokens": bench.timed_tokens,
        "num_image_tokens": sum(
            coord.all_gather(image_tokens(s for b in timed for s in b.samples) if layout.writes else 0)
        ),
        "tokens_per_batch": opts.tokens_per_batch,
        "chunk_tokens": engine.chunk_tokens,
        "longest_sample": max(s.num_tokens for s in bench.samples),
    }


def _bare_result(bench: _Bench, bare: _BareFigures, cold: dict) -> dict:
    tokens, first_pass = bench.timed_tokens, bare.first_pass
    return {
        # On warm kernels: the same batches ran once before (`first_pass`), so that nothing compiles while a mode
        # is timed; `timed_compiled` counts what did.
        "bare_prefill_tok_s": tokens / bare.seconds,
        "bare_first_pass_tok_s": tokens / first_pass["seconds"],
        "bare_first_pass_s": first_pass["seconds"],
        "bare_first_pass_compiled": first_pass["compiled"],
        "first_pass_over_warm": bare.seconds / first_pass["seconds"],
        "bare_forward_s": bare.forward_s,
        "bare_wall_s": bare.seconds,
        # Start-up and tail, from CUDA events (see _ForwardClock): this rank's, not the slowest's.
        **{f"bare_{k}": v for k, v in bare.phases.items()},
        "bare_ranks": bare.ranks,
        # The cold start of this process: command -> model loaded -> first warm-up batches, timed as they ran
        # (this rank's); `bare_prefill_tok_s` is the warm figure beside them.
        **cold,
        "cold_over_warm": cold["cold_tok_s"] / (tokens / bare.seconds) if cold.get("cold_tok_s") else None,
        "mfu_bare": _mfu(bench.text_config, bench.samples, tokens / bare.seconds / bench.layout.world_size),
        **({"bare_tok_s_by_chunk": bare.by_chunk} if bare.by_chunk else {}),
    }


def _extract_result(
    extraction: _Extraction, bare: _BareFigures, extract_s: float, copy_only_s: float, ranks: list[dict]
) -> dict:
    bench, engine, clock = extraction.bench, extraction.engine, extraction.clock
    tokens = bench.timed_tokens
    return {
        "extract_tok_s": tokens / extract_s,
        "extract_over_bare": bare.seconds / extract_s,
        # Files added to the JIT caches from the end of the first pass to the end of this extraction: 0 says
        # every timed mode ran on warm kernels.
        "timed_compiled": max(bench.coord.all_gather(jit_cache_entries(engine.jit_caches) - bare.jit_cache_entries)),
        # Diagnostics: copy-out without writing, and where the main thread's time went.
        "copy_only_tok_s": tokens / copy_only_s,
        "extract_forward_s": clock.seconds,
        "extract_wall_s": extract_s,
        **{f"extract_{k}": v for k, v in clock.phases().items()},
        # Every rank's own (TP ranks that do not write included), forward by forward, and on writing ranks where
        # the host's time went around the forwards: waits for staging (the consumer is behind), for the copies,
        # in the consumer, for shard buffers (the writes are behind), and each shard's write (_rank_report).
        "extract_ranks": ranks,
        "mfu_extract": _mfu(bench.text_config, bench.samples, tokens / extract_s / bench.layout.world_size),
        # Counting causal attention (attention_flops) as well as the matmuls; of the language model (a vision
        # tower's are not counted).
        "flops_per_token": model_flops_per_token(bench.text_config, bench.samples),
    }


def _stored_result(
    extraction: _Extraction, out: str, disk_rate: float, written: int, extract_s: float, bare: _BareFigures
) -> dict:
    """Where the states went and what they weighed there."""
    bench, encoding, engine = extraction.bench, extraction.encoding, extraction.engine
    tokens = bench.timed_tokens
    row_bytes = sum(encoding.bytes_per_token(len(engine.layer_ids), engine.hidden_size).values())
    return {
        "jit_cache": engine.jit_caches,
        "jit_cache_cold": bench.opts.cold,
        "writers": bench.opts.writers,
        "image_threads": bench.tokenizer.image_threads,  # with --data, the threads preparing its images
        "out": out,
        "out_kind": out_kind(out),
        "disk_write_bytes_s": sum(bench.coord.all_gather(disk_rate)),
        "store": encoding.store,
        "compress": encoding.compress,
        # Per token before compression (states, fp8 scales, input_ids, loss_mask), and as written (compression,
        # offsets, metadata and headers included).
        "bytes_per_token": row_bytes,
        "bytes_per_token_written": written / tokens,
        "compression_ratio": tokens * row_bytes / written,
        "extract_bytes_s": tokens * row_bytes / extract_s,
        "written_bytes_s": written / extract_s,
        **({"fp8_cosine_vs_bf16": bare.fp8_error} if encoding.store == "fp8" else {}),
    }


def _host_result(bench: _Bench, engine: Engine) -> dict:
    coord = bench.coord
    gpu_peak = torch.cuda.max_memory_allocated() if _on_gpu(engine) else None
    return {
        "host_peak_rss_bytes": max(coord.all_gather(_host_peak_rss())),
        # Intra-op threads of the host-side copies into shard buffers, once the model is loaded.
        "host_torch_threads": torch.get_num_threads(),
        "gpu_peak_bytes": None if gpu_peak is None else max(coord.all_gather(gpu_peak)),
    }


def _hf_row(bench: _Bench, engine: Engine, results: list[dict]) -> peers.Pending:
    """HF's loop over the same batches, its rate into every result, and its row among the peers (cross-checked
    with the rest where it ran on the same weights as ours)."""
    opts = bench.opts
    check = [s.input_ids for b in bench.timed for s in b.samples][: opts.peer_options.cross_check_samples]
    # Only the same weights make HF's states comparable with ours; the dummy loader draws its own.
    weights = bench.model_dir if opts.load_format != "dummy" else None
    start = time.perf_counter()
    hf_s, hf_states = _hf_baseline(
        bench.config,
        engine,
        bench.warm,
        bench.timed,
        bench.coord,
        weights,
        lambda model: peers.states_of(model, engine.layer_ids, check) if weights else None,
    )
    for r in results:
        r["hf_tok_s"] = r["num_tokens"] / hf_s
        r["extract_over_hf"] = hf_s * r["extract_tok_s"] / r["num_tokens"]
    pending = peers.hf_row(results[0]["hf_tok_s"], opts.command, hf_states)
    print(peers.summary(pending.row, time.perf_counter() - start), file=sys.stderr, flush=True)
    bench.files.peer(pending.row)
    return pending


def _add_scaling(results: list[dict], single_gpu_results: tuple[str, ...]) -> None:
    """Each result's aggregate tokens/s over one GPU's writing to the same kind of target (tmpfs, disk), both
    measured in one session on the same corpus settings."""
    singles = {}
    for path in single_gpu_results:
        single = json.loads(Path(path).read_text())
        singles[single["out_kind"]] = (path, single)
    for r in results:
        if r["out_kind"] not in singles:
            raise ValueError(f"no --single-gpu-result for {r['out_kind']} (given: {', '.join(singles)})")
        path, single = singles[r["out_kind"]]
        r["scaling"] = r["extract_tok_s"] / single["extract_tok_s"]
        r["bare_scaling"] = r["bare_prefill_tok_s"] / single["bare_prefill_tok_s"]
        r["single_gpu_result"] = path


def fed_batches(
    opts: BenchOptions,
    run: ExtractOptions,
    tokenizer: SampleTokenizer,
    layout: Layout,
    warm: list[Batch],
    timed: list[Batch],
    engine: Engine | None = None,
    apart: TokenizerProcesses | None = None,
) -> Iterator[Batch]:
    """`timed` made again while the forwards run, as bin/extract.py makes its batches: the corpus's records read,
    tokenized (by `apart`'s processes where given) and their images decoded and prepared (and hashed for `engine`)
    on the feed's thread ahead of the forwards (`prepared_ahead`), the warm-up batches' records passed over as a
    resumed run passes over those done."""
    warm_records = [s.index for b in warm for s in b.samples]
    done = np.zeros(max(warm_records, default=-1) + 1, dtype=bool)
    done[warm_records] = True
    tally = Tally(None, strict=False, nonfinite=run.nonfinite)
    samples = pending_samples(run.data, Share(layout, np.zeros(0, dtype=bool)), tokenizer, done, tally, apart)
    count = sum(len(b.samples) for b in timed)
    batches = batch_by_tokens(itertools.islice(samples, count), budget(opts, Path(run.model)), run.seqs_per_batch)
    return prepared_ahead(batches, engine)


def _fed_figures(
    coord: Coordinator,
    clock: _ForwardClock,
    host_times: dict,
    writer: ShardWriter | None,
    timed: list[Batch],
    total_tokens: int,
    fed_s: float,
    bare_s: float,
    extract_s: float,
) -> dict:
    """The extraction fed from the corpus as a run is (`fed_batches`) against bare prefill and the extraction of
    the batches made beforehand, with the seconds the forwards waited for the next batch, the slowest rank's:
    what reading, tokenizing and the images' decoding and preparing left on the GPU's path. Every rank's side
    of it is reported as the timed extraction's is (`_rank_report`): a fed run that falls behind the batches
    made beforehand without waiting for input shows there whether its forwards' thread or its writers lost
    the time."""
    if clock.tokens != sum(b.num_tokens for b in timed):
        raise RuntimeError(
            f"the fed extraction forwarded {clock.tokens} tokens, the timed batches hold "
            f"{sum(b.num_tokens for b in timed)}: the corpus is not the one read at the start"
        )
    return {
        "extract_fed_tok_s": total_tokens / fed_s,
        "extract_fed_over_bare": bare_s / fed_s,
        "extract_fed_over_extract": extract_s / fed_s,
        "extract_fed_wall_s": fed_s,
        "extract_fed_input_wait_s": max(coord.all_gather(host_times["input_wait_s"])),
        "extract_fed_forward_s": clock.seconds,
        **{f"extract_fed_{k}": v for k, v in clock.phases().items()},
        "extract_fed_ranks": coord.all_gather(_rank_report(coord.layout, clock, host_times, writer)),
    }


def _lengths(opts: BenchOptions) -> str:
    if opts.data:
        return f"from --data, max length {opts.longest}"
    return "fixed" if opts.lengths == "fixed" else f"lognormal mean {opts.mean_length} cap {opts.longest}"


def summary_line(r: dict) -> str:
    """One result in a line: every timed figure on warm kernels, beside the cold ones (the warm-up batches on
    the fresh engine, and bare prefill's first pass over the timed batches)."""
    warm = "warm kernels" if r["timed_compiled"] == 0 else f"{r['timed_compiled']} JIT cache files added while timed"
    return (
        f"bench {r['store']}/{r['compress']} -> {r['out']} ({r['out_kind']}), tok/s on {warm}: bare "
        f"{r['bare_prefill_tok_s']:,.0f}, extract {r['extract_tok_s']:,.0f} ({r['extract_over_bare']:.3f} of bare), "
        f"copy-only {r['copy_only_tok_s']:,.0f}; cold: bare's first pass {r['bare_first_pass_tok_s']:,.0f} "
        f"({r['bare_first_pass_compiled']} JIT cache files added), warm-up batches "
        + (f"{r['cold_tok_s']:,.0f}" if r.get("cold_tok_s") else "none")
    )


def peers_first(
    opts: BenchOptions, files: ResultFiles, model_dir: Path, tokenizer, batches: list[list[np.ndarray]], num_layers: int
) -> list[peers.Pending]:
    """The peers of --baseline that run in their own processes, before our engine takes the GPU: each one's
    row is saved as soon as it finishes."""
    pending = []
    for peer in peers.run_subprocess_peers(
        opts.baselines,
        opts.peer_options,
        model_dir=model_dir,
        tokenizer=tokenizer,
        batches=batches,
        warmup=opts.warmup_batches,
        max_length=opts.longest,
        dtype=opts.dtype,
        num_layers=num_layers,
        load_format=opts.load_format,
    ):
        pending.append(peer)
        files.peer(peer.row)
    return pending


def shard_writes(writes: list[tuple[float, float, int]], started: float) -> dict:
    """A writer's shard writes (`ShardWriter.writes`) counted from `started`: each as [start s, seconds,
    bytes], the most written at once, and the bytes/s while any was being written."""
    spans = sorted((a - started, a - started + seconds, n) for a, seconds, n in writes)
    busy, reach = 0.0, float("-inf")
    for a, b, _ in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    # At a tie an end sorts before a start: a write that starts as another ends is not beside it.
    edges = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans])
    return {
        "shard_writes": [[round(a, 4), round(b - a, 4), n] for a, b, n in spans],
        "shards_written_at_once_max": max(itertools.accumulate(step for _, step in edges), default=0),
        "write_bytes_s_while_writing": sum(n for _, _, n in spans) / busy if busy else None,
    }


def _rank_report(
    layout: Layout, clock: _ForwardClock, host_times: dict | None = None, writer: ShardWriter | None = None
) -> dict:
    """This rank's side of the last timed mode: its forwards (`_ForwardClock`), and on a writing rank where
    the host's time went around them (`HostOffload.times`) and the writer's waits and writes."""
    report = {
        "rank": layout.rank,
        "writes": layout.writes,
        "forward_s": clock.seconds,
        "wall_s": clock.wall_s,
        "tokens": clock.tokens,
        "sequences_with_images": clock.sequences_with_images,
        **clock.phases(),
        **(host_times or {}),
        "per_forward": clock.per_forward(),
    }
    if writer is not None:
        report["writer_buffer_wait_s"] = writer.buffer_wait_s
        report.update(shard_writes(writer.writes, clock.started))
    return report


def _cold_start(engine: Engine, batches: list[Batch], timeline: Timeline) -> dict:
    """Runs the warm-up `batches` one by one, each waited for, on the freshly loaded engine: the start-up
    (command to model loaded, and to the first forward) and what the first batches cost while kernels
    compile and caches fill. Each rank's own."""
    on_gpu = _on_gpu(engine)
    seconds = []
    timeline.mark("first forward")
    for b in batches:
        start = time.perf_counter()
        _bare(engine, [b])
        if on_gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    tokens = sum(b.num_tokens for b in batches)
    return {
        "startup_to_engine_s": timeline.marks["engine"],
        "engine_load_s": timeline.between("engine", "loaded"),
        "startup_to_first_forward_s": timeline.marks["first forward"],
        "cold_batch_s": seconds,
        "cold_tok_s": tokens / sum(seconds) if seconds else None,
        # SGLang's nvcc-built modules, built while the model loaded; the first batch waited for the rest.
        **engine.compiles.report(),
    }


def _fp8_error(engine: Engine, batches: list[Batch], max_tokens: int) -> dict:
    """Per-token cosine of fp8-decoded states against the bf16 states that --store bf16 writes, from the
    same forward passes: the worst and the median token per layer over about `max_tokens` tokens."""
    fp8, k = Encoding("fp8"), len(engine.layer_ids)
    cosines: dict[str, list[torch.Tensor]] = {}
    seen = 0
    for batch in batches:
        if seen >= max_tokens:
            break
        captured = engine.capture([s.input_ids for s in batch.samples], [s.images for s in batch.samples])
        seen += batch.num_tokens
        bf16 = {STATE_TENSORS[0]: captured.aux.to(torch.bfloat16), FINAL_STATE_TENSOR: captured.last.to(torch.bfloat16)}
        decoded = fp8.decode(fp8.encode(bf16[STATE_TENSORS[0]], bf16[FINAL_STATE_TENSOR], k))
        for name, layers in (
            (STATE_TENSORS[0], [f"layer {i}" for i in engine.layer_ids]),
            (FINAL_STATE_TENSOR, ["last"]),
        ):
            rows = bf16[name].shape[0]
            cos = torch.nn.functional.cosine_similarity(
                decoded[name].float().reshape(rows, len(layers), -1),
                bf16[name].float().reshape(rows, len(layers), -1),
                dim=-1,
            )
            for j, layer in enumerate(layers):
                cosines.setdefault(layer, []).append(cos[:, j].cpu())
    result = {}
    for layer, parts in cosines.items():
        cos = torch.cat(parts)
        result[layer] = {"worst": cos.min().item(), "median": cos.median().item(), "tokens": cos.numel()}
    return result


def _mfu(config, samples: list[Sample], tok_s_per_gpu: float) -> float | None:
    peak = _peak_flops()
    return None if peak is None else model_flops_per_token(config, samples) * tok_s_per_gpu / peak


def _hf_baseline(config, engine: Engine, warm, timed, coord: Coordinator, weights: Path | None, after):
    """Seconds of the HF loop over `timed`, and what `after(model)` returns before the model is freed."""
    from transformers import AutoModelForCausalLM

    if weights is None:
        # Random weights of the same shape: speed does not depend on the values.
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    else:
        model = (
            AutoModelForCausalLM.from_pretrained(weights, dtype=torch.bfloat16, attn_implementation="sdpa")
            .cuda()
            .eval()
        )
    _hf_pass(model, warm, engine.layer_ids, "cuda")
    seconds = _timed(coord, functools.partial(_hf_pass, model, timed, engine.layer_ids, "cuda"))
    kept = after(model)
    del model
    torch.cuda.empty_cache()
    return seconds, kept


def _chunk_sweep(engine: Engine, coord: Coordinator, batch: Batch, sizes: tuple[int, ...]) -> dict[str, float]:
    """Bare chunked prefill tokens/s of `batch`'s samples at each chunk size, to choose --chunk-tokens."""
    long = [s for s in batch.samples if s.num_tokens > engine.cfg.max_tokens_per_batch]
    if not long:
        raise ValueError(
            f"--chunk-sweep needs samples longer than --tokens-per-batch {engine.cfg.max_tokens_per_batch}; "
            f"the first timed batch has none"
        )
    tokens = sum(s.num_tokens for s in long)
    rates = {}
    for size in sizes:
        seconds = _timed(coord, lambda: [engine.prefill_chunked(s.input_ids, size) for s in long])
        rates[str(size)] = tokens / seconds
    return rates


def _profile(fn, out_dir: Path, name: str) -> None:
    """Torch-profiler tables of where the time of `fn` goes, GPU kernels first, and its trace."""
    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    (out_dir / f"{name}_profile.txt").write_text(
        f"{name}: by GPU time of each kernel itself\n"
        + averages.table(sort_by="self_device_time_total", row_limit=50)
        + f"\n\n{name}: by CPU time, children included\n"
        + averages.table(sort_by="cpu_time_total", row_limit=50)
    )
    trace = out_dir / f"{name}_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def _generated_config(shape: str, longest: int, layout: Layout, coord: Coordinator) -> Path:
    """A config and tokenizer for `shape` with no weights (SGLang's dummy loader draws them), whose
    positions reach `longest` tokens."""
    path = Path(f"/tmp/offline_extract_bench_{shape}_{longest}")
    if layout.local_rank == 0 and not (path / "config.json").exists():
        build_model(shape, path, dtype=torch.bfloat16, weights=False)
        # SGLang refuses a context longer than the config's positions.
        if json.loads((path / "config.json").read_text()).get("max_position_embeddings", 0) < longest:
            build_model(
                shape, path, dtype=torch.bfloat16, weights=False, overrides={"max_position_embeddings": longest}
            )
    coord.barrier()
    return path


class ResultFiles:
    """The run's result JSONs, one per --store x --compress x --out, rewritten whole as each part of the run
    finishes (each peer, ours, each cross-check), so that a run cut short (by a time limit, say)
    leaves a valid JSON of what it measured. `parts` lists the parts done and those left; until ours is
    measured a file holds the command, the peers and `parts` only."""

    def __init__(self, opts: BenchOptions, layout: Layout):
        self._dir = Path(opts.results_dir)
        self._writes = layout.leads
        stamp = time.strftime("%Y%m%d-%H%M%S")
        model = opts.shape if not opts.model else Path(opts.model).name
        corpus = f"data-{Path(opts.data[0]).stem}" if opts.data else opts.lengths
        kinds = [out_kind(out) for out in opts.outs]
        # Numbered where two --out share a kind: one file would otherwise take the other's place.
        targets = [kind if kinds.count(kind) == 1 else f"{kind}{i + 1}" for i, kind in enumerate(kinds)]
        self._names = [
            f"bench_{model}_{corpus}_{target}_{store}_{compress}_w{layout.world_size}_tp{layout.tp_size}_{stamp}.json"
            for store, compress in opts.encodings
            for target in targets
        ]
        self._command = opts.command
        self.ours: list[dict | None] = [None] * len(self._names)  # in the order run_bench measures them
        self._peers = [] if opts.baselines else None
        # The order run_bench takes them in: the peers in their own processes first (see peers/README.md).
        own_process = [n for n in opts.baselines if n in peers.OWN_PROCESS]
        in_process = [n for n in opts.baselines if n not in peers.OWN_PROCESS]
        self._planned = [
            *(f"peer {n}" for n in own_process),
            "ours",
            *(f"peer {n}" for n in in_process),
            *(f"cross-check {n}" for n in own_process + in_process),
        ]
        self._done: set[str] = set()

    def measured(self, index: int, result: dict) -> None:
        """Ours, for the `index`-th file."""
        self.ours[index] = result
        self.write()

    def peer(self, row: peers.PeerRow) -> None:
        """A peer's row, before its cross-check (which fills the same row)."""
        self._peers.append(row)
        self.done(f"peer {row.name}")

    def done(self, part: str) -> None:
        self._done.add(part)
        self.write()

    def documents(self) -> list[dict]:
        docs = []
        for ours in self.ours:
            done = [p for p in self._planned if p in self._done or (p == "ours" and ours is not None)]
            docs.append(
                {
                    **(ours or {"command": self._command}),
                    **({"peers": [row.to_json() for row in self._peers]} if self._peers is not None else {}),
                    "parts": {"done": done, "left": [p for p in self._planned if p not in done]},
                }
            )
        return docs

    def write(self, final: bool = False) -> list[dict]:
        docs = self.documents()
        if not self._writes:
            return docs
        self._dir.mkdir(parents=True, exist_ok=True)
        for name, doc in zip(self._names, docs):
            # A rename replaces the file whole: a run killed mid-write leaves the previous version.
            tmp = self._dir / f".{name}.tmp"
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            os.replace(tmp, self._dir / name)
            if final:
                print(json.dumps(doc, indent=2), file=sys.stderr)
        parts = docs[-1]["parts"]  # the last file's: ours is measured into the files in their order
        print(
            f"bench: saved {len(docs)} result file(s) in {self._dir} (done: {', '.join(parts['done']) or 'nothing'}; "
            f"left: {', '.join(parts['left']) or 'nothing'})",
            file=sys.stderr,
            flush=True,
        )
        return docs
