#!/usr/bin/env python
"""How fast the host turns records into batches, without a GPU: a corpus read, tokenized and batched as a run
does it (read_corpus, the run's SampleTokenizer with the model's HF processor where it has one,
batch_by_tokens), one record a call of the tokenizer and `--together` records a call (SampleTokenizer.many,
which a run uses: the fast tokenizer's own threads spread them over the cores), in records/s and tokens/s,
text, chats and image chats apart (these in images/s too: decoded and prepared by the processor, then each
batch's pixels hashed as the engine hashes them on the feed's thread, `host_inputs_s` of the time). A run's GPU
waits for its input where these fall below its forwards' tokens/s.

\b
    python benchmarks/feed_rate.py --model DIR --data corpus.jsonl [--json OUT.json]
    python benchmarks/image_chats.py /tmp/chats.jsonl --chats 64
    python benchmarks/feed_rate.py --shape qwen2_5_vl_7b --data /tmp/chats.jsonl

`--shape` times a VISION_LANGUAGE_SHAPES model's processor (its config and processor files written with no
weights, as bin/bench.py --shape writes them). `--threads 1` holds the tokenizer (RAYON_NUM_THREADS, read when
it first tokenizes) and torch's image operations to one core, for the rate of one core; `--image-threads` is
the run's option of that name (image chats prepared side by side); `cpu_s`, every thread's CPU seconds.

`fed` is the corpus as a run feeds its forwards (`extraction.pending_samples`, then batched), for each
`--tokenizer-processes` N (0: on the feeding thread itself): its tokens/s, and `feeder_cpu_us_per_token`, the
feeding thread's own CPU time a token: the Python that, in a run, holds the GIL beside the thread launching the
forwards (a small model's forwards on an H200 take about 0.8 us a token).
"""

import os
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402


def _rate(records, tokenize, budget: int, host=None) -> dict:
    """The rate of `tokenize` over `records`, batched under `budget` tokens a forward; with `host` (a model's
    HostWork.prepare, as Engine.prepare_images calls it on the feed's thread), the images' pixels hashed too."""
    from offline_extract.data.batching import batch_by_tokens
    from offline_extract.data.tokenization import Sample

    start, cpu = time.perf_counter(), time.process_time()
    samples = [s for s in tokenize(records) if isinstance(s, Sample)]
    tokenized = time.perf_counter()
    batches = list(batch_by_tokens(samples, budget, 256))
    batched = time.perf_counter()
    for batch in batches if host is not None else ():
        host([s.input_ids for s in batch.samples], [s.images for s in batch.samples])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(s.num_tokens for s in samples)
    images = sum(len(r.images) for r in records)
    return {
        "records": len(records),
        "samples": len(samples),
        "tokens": tokens,
        "batches": len(batches),
        "records_s": len(records) / seconds,
        "tokens_s": tokens / seconds,
        **({"images": images, "images_s": images / seconds} if images else {}),
        # The cores' seconds it took, every thread's: what a rate costs where other work shares the cores.
        "cpu_s": cpu,
        "batching_s": batched - tokenized,
        **({"host_inputs_s": seconds - (batched - start)} if host is not None else {}),
    }


def _fed(run, st, processes: int) -> dict:
    """The corpus read, tokenized (on `processes` processes, or on this thread) and batched as a run feeds its
    forwards, timed on this thread: its wall clock and its own CPU time."""
    import numpy as np

    from offline_extract.data.batching import batch_by_tokens
    from offline_extract.data.tokenizer_processes import TokenizerProcesses
    from offline_extract.engine.distributed import Layout, Share
    from offline_extract.extraction import pending_samples
    from offline_extract.summary import Tally

    apart = TokenizerProcesses(processes, st) if processes else None
    try:
        if apart is not None:  # a run starts them beside the model's load
            apart.ready()
        none = np.zeros(0, dtype=bool)
        tally = Tally(None, strict=False, nonfinite=run.nonfinite)
        samples = pending_samples(run.data, Share(Layout(), none), st, none, tally, apart)
        start, cpu = time.perf_counter(), time.thread_time()
        tokens = sum(b.num_tokens for b in batch_by_tokens(samples, run.tokens_per_batch, run.seqs_per_batch))
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    finally:
        if apart is not None:
            apart.close()
    return {
        "tokenizer_processes": processes,
        "records": tally.summary.records,
        "tokens": tokens,
        "tokens_s": tokens / seconds,
        "feeder_cpu_s": cpu,
        "feeder_cpu_us_per_token": cpu / tokens * 1e6 if tokens else None,
    }


def model_dir(model: str | None, shape: str | None) -> Path:
    """--model, or --shape's config and processor files (no weights), written once under /tmp."""
    if (model is None) == (shape is None):
        raise click.UsageError("give one of --model and --shape")
    if model is not None:
        return Path(model)
    from offline_extract.testing.models import build_model

    path = Path(f"/tmp/offline_extract_feed_rate_{shape}")
    if not (path / "config.json").exists():
        build_model(shape, path, weights=False)
    return path


def _host_work(path: Path, sample):
    """The model's HostWork.prepare: what the engine does on the feed's thread for a batch's images; run once on
    `sample` first, for SGLang's imports."""
    from transformers import AutoConfig

    from offline_extract.engine.multimodal import HostWork, image_model

    config = AutoConfig.from_pretrained(path)
    spec = image_model(config.architectures[0], str(path))
    HostWork().prepare(config, spec, [sample.input_ids], [sample.images])
    return lambda seqs, images: HostWork().prepare(config, spec, seqs, images)


def _kind(record) -> str:
    if record.images:
        return "image_chat"
    return "text" if record.format == "text" else "chat"


@program(help=__doc__)
@click.option("--model", default=None, help="A model directory with its tokenizer (and processor).")
@click.option("--shape", default=None, help="Instead of --model: a VISION_LANGUAGE_SHAPES key (qwen2_5_vl_7b).")
@click.option("--data", required=True, help="A JSONL corpus (text and chat records).")
@click.option("--max-length", default=8192, show_default=True)
@click.option("--tokens-per-batch", default=16384, show_default=True)
@click.option("--together", default=64, show_default=True, help="Records a call of the tokenizer (a run's: 64).")
@click.option(
    "--threads",
    default=None,
    type=int,
    help="The tokenizer's threads (RAYON_NUM_THREADS) and torch's; default: all cores.",
)
@click.option(
    "--image-threads",
    default=None,
    type=click.IntRange(min=1),
    help="ExtractOptions.image_threads; default: the run's default.",
)
@click.option(
    "--tokenizer-processes",
    "processes",
    multiple=True,
    type=click.IntRange(min=0),
    default=(0,),
    show_default=True,
    help="`fed` with the records tokenized on this many processes (0: the feeding thread); repeatable.",
)
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(model, shape, data, max_length, tokens_per_batch, together, threads, image_threads, processes, json_path):
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    import torch

    from offline_extract.data.corpus import Record, read_corpus
    from offline_extract.data.tokenization import Sample
    from offline_extract.extraction import sample_tokenizer
    from offline_extract.options import ExtractOptions

    if threads:
        torch.set_num_threads(threads)
    path = model_dir(model, shape)
    run = ExtractOptions(
        data=(data,),
        model=str(path),
        max_length=max_length,
        tokens_per_batch=tokens_per_batch,
        image_threads=image_threads,
    )
    st = sample_tokenizer(run, path)
    if st.processor is not None and any(processes):  # refused by TokenizerProcesses: before anything is timed
        raise click.UsageError(f"--tokenizer-processes above 0: {path} prepares image chats with its processor")
    records = [r for r in read_corpus([data]) if isinstance(r, Record)]
    st.many(records[:8])  # the tokenizer's first call sets up its threads
    result = {
        "command": command_line("python benchmarks/feed_rate.py"),
        "cpu_count": os.cpu_count(),
        "tokenizer_threads": threads or "all cores",
        "torch_threads": torch.get_num_threads(),
        "image_threads": st.image_threads,
    }
    for kind in ("text", "chat", "image_chat"):
        chosen = [r for r in records if _kind(r) == kind]
        if not chosen:
            continue
        host = (
            _host_work(path, next(s for s in st.many(chosen[:8]) if isinstance(s, Sample)))
            if kind == "image_chat"
            else None
        )
        result[kind] = {
            "one_by_one": _rate(chosen, lambda rs: [st(r) for r in rs], tokens_per_batch, host),
            "together": _rate(
                chosen,
                lambda rs: [s for i in range(0, len(rs), together) for s in st.many(rs[i : i + together])],
                tokens_per_batch,
                host,
            ),
        }
    result["fed"] = [_fed(run, st, n) for n in processes]
    emit(result, json_path)


if __name__ == "__main__":
    main()
