#!/usr/bin/env python
"""How fast the host turns records into batches, without a GPU: a corpus read, tokenized and batched as a run
does it (read_corpus, SampleTokenizer, batch_by_tokens), one record a call of the tokenizer and
`--together` records a call (SampleTokenizer.many, which a run uses: the fast tokenizer's own threads spread
them over the cores), in records/s and tokens/s, chats and text apart. A run's GPU waits for its input where
these fall below its forwards' tokens/s.

\b
    python benchmarks/feed_rate.py --model DIR --data corpus.jsonl [--json OUT.json]

`--threads 1` holds the tokenizer to one core (RAYON_NUM_THREADS, read when it first tokenizes), for the
rate of one core.
"""

import os
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402


def _rate(records, tokenize, budget: int) -> dict:
    from offline_extract.data.batching import batch_by_tokens
    from offline_extract.data.tokenization import Sample

    start = time.perf_counter()
    samples = [s for s in tokenize(records) if isinstance(s, Sample)]
    tokenized = time.perf_counter()
    batches = list(batch_by_tokens(samples, budget, 256))
    seconds = time.perf_counter() - start
    tokens = sum(s.num_tokens for s in samples)
    return {
        "records": len(records),
        "samples": len(samples),
        "tokens": tokens,
        "batches": len(batches),
        "records_s": len(records) / seconds,
        "tokens_s": tokens / seconds,
        "batching_s": seconds - (tokenized - start),
    }


@program(help=__doc__)
@click.option("--model", required=True, help="A model directory with its tokenizer.")
@click.option("--data", required=True, help="A JSONL corpus (text and chat records).")
@click.option("--max-length", default=8192, show_default=True)
@click.option("--tokens-per-batch", default=16384, show_default=True)
@click.option("--together", default=64, show_default=True, help="Records a call of the tokenizer (a run's: 64).")
@click.option(
    "--threads", default=None, type=int, help="The tokenizer's threads (RAYON_NUM_THREADS); default: all cores."
)
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(model, data, max_length, tokens_per_batch, together, threads, json_path):
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    from transformers import AutoTokenizer

    from offline_extract.data.corpus import Record, read_corpus
    from offline_extract.data.tokenization import SampleTokenizer

    st = SampleTokenizer(AutoTokenizer.from_pretrained(model), max_length=max_length)
    records = [r for r in read_corpus([data]) if isinstance(r, Record)]
    st.many(records[:8])  # the tokenizer's first call sets up its threads
    result = {
        "command": command_line("python benchmarks/feed_rate.py"),
        "cpu_count": os.cpu_count(),
        "tokenizer_threads": threads or "all cores",
    }
    for kind in ("text", "chat"):
        chosen = [r for r in records if (r.format == "text") == (kind == "text")]
        if not chosen:
            continue
        result[kind] = {
            "one_by_one": _rate(chosen, lambda rs: [st(r) for r in rs], tokens_per_batch),
            "together": _rate(
                chosen,
                lambda rs: [s for i in range(0, len(rs), together) for s in st.many(rs[i : i + together])],
                tokens_per_batch,
            ),
        }
    emit(result, json_path)


if __name__ == "__main__":
    main()
