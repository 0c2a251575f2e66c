"""The extraction phase of one rank, once the parity gate has passed: the pending samples made into batches, each
batch's forwards and their states handed to this rank's shard writer (`feed`), with the progress shown and the
output's growth set against the free space as it goes (`planning.OutputWatch`). What a run's finish reads of it is
kept: the headers of the shards it wrote, the hot loop's waits and its host's use of its cores. The passes through
the records that come before any forward (`--strict`, `--dry-run`) show their progress as this one does
(`progress`).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Sequence

from offline_extract import planning, preflight
from offline_extract.data.batching import batch_by_tokens
from offline_extract.data.sources import Source
from offline_extract.data.tokenization import Sample
from offline_extract.engine.distributed import Layout, Share
from offline_extract.engine.nonfinite import NonFiniteGuard
from offline_extract.engine.sglang_adapter import Engine
from offline_extract.feed import extract_batches, prepared_ahead
from offline_extract.lifecycle.progress import RunProgress
from offline_extract.lifecycle.timeline import Timeline
from offline_extract.options import ExtractOptions
from offline_extract.store import manifest, resume
from offline_extract.store.journal import Journal
from offline_extract.store.schema import RunInfo
from offline_extract.store.writer import ShardWriter
from offline_extract.summary import Tally


class ExtractPhase:
    """One rank's extraction: its shard writer (`writer`, on a writing rank), the pass of the pending samples
    through the engine to it (`run`), and what that left for the run's finish: the headers of the shards written
    (`written`), the hot loop's waits for its next batch and for a free staging buffer (`waits`), and the host's
    threads on its cores meanwhile (`host_use`, `HostUse.report`)."""

    def __init__(self, opts: ExtractOptions, layout: Layout, checked: preflight.Checked, out: Path, timeline: Timeline):
        self.opts, self.layout, self.checked, self.out, self.timeline = opts, layout, checked, out, timeline
        self.written: list = []  # ShardWriter.headers
        self.waits = {"input_wait_s": 0.0, "writer_wait_s": 0.0}  # feed.extract_batches's
        self.host_use: dict | None = None

    def writer(
        self, meta: RunInfo, existing: resume.Existing, journals: ExitStack, buffers: list, on_gpu: bool
    ) -> ShardWriter:
        """This rank's writer of shards of `meta`, numbered after the shards `existing` kept, each one written
        recorded in this replica's manifest journal (opened in `journals`)."""
        layout = self.layout
        shard_log = journals.enter_context(Journal(manifest.journal_path(self.out, layout.dp_rank), durable=True))
        return ShardWriter(
            self.out,
            meta,
            shard_bytes=self.opts.shard_bytes,
            writers=self.checked.writers,
            shard_numbers=resume.shard_numbers(existing.first_number, layout.dp_rank, layout.dp_size),
            on_written=lambda shard: shard_log.append(asdict(shard)),
            # On a GPU the first shards would otherwise fill fresh pages on the hot path; on CPU
            # (tiny models, tests) that memory would mostly sit unused.
            widths=meta.encoding.widths(meta.num_aux_layers, meta.hidden_size) if on_gpu else None,
            buffers=buffers,
        )

    def run(
        self,
        engine: Engine,
        share: Share,
        samples: Iterator[Sample],
        writer: ShardWriter | None,
        staging: list | None,
        tally: Tally,
    ) -> None:
        """`samples` (this replica's `share`) through `engine` to `writer`, every batch counted in `tally`; the
        writer closed once the last shard is written, or aborted on the way out of a failure."""
        opts, layout = self.opts, self.layout
        label = f"dp {layout.dp_rank}/{layout.dp_size}" if layout.dp_size > 1 else "extract"
        # The leader's share stands for every replica's; its progress counts the records, shown or not.
        watch = planning.OutputWatch(self.out, layout.dp_size) if layout.leads and writer is not None else None
        count = (lambda: count_owned(share, self.checked.sources)) if layout.leads else None
        with progress(opts, label, count, shown=layout.leads) as bar:
            # The records read up to each batch, counted as the batch is made: the batches are made ahead of
            # the forwards (prepared_ahead), so the records read by the time a batch is done run ahead of it.
            read_by_batch: deque[int] = deque()

            def counted(batches: Iterator) -> Iterator:
                for batch in batches:
                    read_by_batch.append(tally.records_read())
                    yield batch

            def advance(batch) -> None:
                # Every batch's forwards are enqueued by now: the last batch's mark stays. (The feed reads
                # batches ahead, so the batches running out says nothing of the last one's forwards.)
                self.timeline.mark("last forward")
                tally.batch_done(batch)
                bar.advance(read_by_batch.popleft(), batch.num_tokens, writer.bytes_written if writer else 0)
                if watch is not None and writer is not None:
                    watch.check(bar.done, bar.total, bar.tokens, writer.tokens_written, writer.bytes_written)

            extract_start = time.perf_counter()
            batches = _marked(
                prepared_ahead(
                    counted(batch_by_tokens(samples, self.checked.tokens_per_batch, opts.seqs_per_batch)), engine
                ),
                self.timeline,
            )
            guard = NonFiniteGuard(opts.nonfinite, engine.layer_ids, tally.nonfinite)
            try:
                times = extract_batches(engine, batches, writer, advance, staging=staging, nonfinite=guard)
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            self.waits = {name: times.get(name, 0.0) for name in self.waits}
            self.host_use = times["host_use"]
            self.timeline.mark("drained")
            if writer is not None:
                tally.written(writer.close(), writer)
                self.written = writer.headers
            # The last shards land after the last batch, and records after it (resumed ones) gave no batch.
            bar.advance(tally.records_read(), 0, writer.bytes_written if writer else 0)
            self.timeline.mark("written")
            tally.summary.extract_seconds = time.perf_counter() - extract_start


def _marked(batches: Iterator, timeline: Timeline) -> Iterator:
    """`batches`, marking on `timeline` when the first is handed to the engine."""
    for i, batch in enumerate(batches):
        if not i:
            timeline.mark("first forward")
        yield batch


def progress(
    opts: ExtractOptions, label: str, count: Callable[[], int | None] | None, shown: bool = True
) -> RunProgress:
    """The bar, or with --no-progress a line every --progress-every seconds, over a pass through the records:
    the extraction, and the reading and tokenizing of the whole corpus that --dry-run and --strict make before
    any forward, which on a large corpus takes minutes that would otherwise pass in silence."""
    return RunProgress(
        count,
        label,
        enabled=shown and (opts.progress or opts.progress_every > 0),
        heartbeat=None if opts.progress else opts.progress_every,
    )


def count_records(sources: Sequence[Source]) -> int | None:
    """The records of the whole corpus, for the progress ETA; None when a source cannot say."""
    counts = [source.count() for source in sources]
    known = [n for n in counts if n is not None]
    return sum(known) if len(known) == len(counts) else None


def count_owned(share: Share, sources: Sequence[Source]) -> int | None:
    """This replica's share of the records, for the progress ETA; None when a source cannot say."""
    total = count_records(sources)
    return None if total is None else share.count(total)
