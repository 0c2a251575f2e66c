"""The feed through the real engine on CPU: which piece of a run it tells the writer is the last, and
that the shards hold every byte it handed over."""

import threading
import time
from dataclasses import asdict, replace

import numpy as np
import pytest
from shard_checks import KeepingWriter, check_written

from offline_extract.data.batching import Batch, batch_by_tokens
from offline_extract.data.tokenization import Sample
from offline_extract.data.corpus import BadRecordError, Reject
from offline_extract import feed as feed_module
from offline_extract.feed import extract_batches, prepared_ahead, warm_up_encoding
from offline_extract.store import checksum, manifest, schema
from offline_extract.store import writer as writer_module
from offline_extract.store.journal import Journal
from offline_extract.store.schema import Encoding
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run


def _sample(i: int, n: int) -> Sample:
    ids = np.random.default_rng(i).integers(3, 200, n).astype(np.int32)
    return Sample(i, f"s{i}", "c.jsonl", i + 1, ids, np.ones(n, np.uint8), n, False)


class _Recording(ShardWriter):
    """A writer that notes, for every hand-over, the samples it completes and whether it was the last."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self._begun = None

    def add_staged(self, samples, *args, ending=False, **kwargs):
        self.calls.append(([s.index for s in samples], ending))
        super().add_staged(samples, *args, ending=ending, **kwargs)

    def begin_sample(self, sample, *args, **kwargs):
        self._begun = sample.index
        return super().begin_sample(sample, *args, **kwargs)

    def end_sample(self, keep=True, ending=False):
        self.calls.append(([self._begun], ending))
        super().end_sample(keep, ending)


@pytest.mark.parametrize("long_last", [True, False], ids=["long-sample-last", "batch-last"])
def test_the_runs_last_batches_are_handed_over_as_ending(tiny_engine, tmp_path, long_last):
    """Only the last ENDING_BATCHES batches: whatever shard they complete is written as parts side by side,
    which a whole shard of any of them, written by one thread, would not be by the last forward's end."""
    budget = tiny_engine.cfg.max_tokens_per_batch
    short = [Batch((_sample(i, 40), _sample(i + 10, 30))) for i in range(feed_module.ENDING_BATCHES)]
    long = Batch((_sample(9, budget + 50),))  # over the budget: two chunks
    batches = [*short, long] if long_last else [long, *short]
    writer = _Recording(tmp_path, synthetic_run(tiny_engine.layer_ids))
    extract_batches(tiny_engine, batches, writer)
    writer.close()
    indices = [[s.index for s in b.samples] for b in batches]
    assert writer.calls == [(ids, i > 0) for i, ids in enumerate(indices)]


@pytest.mark.parametrize("store, compress", [("bf16", "none"), ("fp8", "zstd")])
def test_the_shards_hold_every_byte_the_feed_handed_over(tiny_engine, tmp_path, monkeypatch, store, compress):
    """The engine's states through the feed (batches, a long sample in chunks, streamed, the last piece
    `ending`) into four writer threads: shards, index, training reader and inspect --verify's check give
    back every sample as handed over, in order, bit for bit; small checksum blocks and tail parts make
    many of both from a few hundred tokens."""
    budget = tiny_engine.cfg.max_tokens_per_batch
    rng = np.random.default_rng(7)
    lengths = [*rng.integers(1, 300, 30), budget + 700, *rng.integers(1, 300, 12), budget // 2 + 1]
    samples = [_sample(i, int(n)) for i, n in enumerate(lengths)]
    run = synthetic_run(tiny_engine.layer_ids, tiny_engine.hidden_size, store=store, compress=compress)
    row_bytes = run.encoding.state_bytes_per_token(run.num_aux_layers, run.hidden_size)
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 4096 + 8)
    monkeypatch.setattr(writer_module, "LAST_SHARD_PART_BYTES", 40 * row_bytes)
    shard_bytes = 500 * row_bytes
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        writer = KeepingWriter(
            tmp_path, run, shard_bytes=shard_bytes, writers=4, on_written=lambda s: journal.append(asdict(s))
        )
        extract_batches(tiny_engine, batch_by_tokens(samples, budget, 8), writer)
        paths = writer.close()
    assert [f.info.index for f in writer.handed] == list(range(len(samples)))
    assert [f.input_ids.tolist() for f in writer.handed] == [s.input_ids.tolist() for s in samples]
    assert len(paths) > 4
    check_written(tmp_path, run, writer, paths, shard_bytes)


@pytest.mark.parametrize("store, final_store", [("nvfp4", None), ("fp8", "nvfp4"), ("nvfp4", "fp8")])
def test_the_start_ups_encoding_asks_the_quantizers_what_every_batch_asks(
    tiny_engine, tmp_path, monkeypatch, store, final_store
):
    """`warm_up_encoding` hands each store's quantizing a state of the dtype, width and layer count the feed's
    batches, chunks and streamed samples hand it: a kernel compiled for those (nvfp4's Triton kernel on
    the GPU, specialized on them) is the one every batch then runs."""
    asked: set = set()

    def recording(name, fmt):
        def quantize(states, layers):
            asked.add((name, states.dtype, states.shape[1], layers))
            return fmt.quantize(states, layers)

        return replace(fmt, quantize=quantize)

    for name, fmt in list(schema.STORES.items()):
        if fmt.quantize is not None:
            monkeypatch.setitem(schema.STORES, name, recording(name, fmt))
    encoding = Encoding(store, final_store=final_store)
    warm_up_encoding(tiny_engine, encoding)
    warm, asked = set(asked), set()
    assert {name for name, *_ in warm} == {store, final_store} - {None, "bf16"}
    budget = tiny_engine.cfg.max_tokens_per_batch
    samples = [_sample(i, n) for i, n in enumerate((40, 7, budget + 50, 300, 1))]
    run = synthetic_run(tiny_engine.layer_ids, tiny_engine.hidden_size, store=store, final_store=final_store)
    assert run.encoding == encoding
    writer = ShardWriter(tmp_path, run)
    extract_batches(tiny_engine, batch_by_tokens(samples, budget, 8), writer)
    writer.close()
    assert asked == warm


def _slow(batches, seconds: float, made: list | None = None):
    """`batches`, each after `seconds` of work, as reading and tokenizing records takes."""
    for batch in batches:
        time.sleep(seconds)
        if made is not None:
            made.append(time.perf_counter())
        yield batch


@pytest.mark.parametrize("with_writer", [False, True], ids=["no-writer", "writer"])
def test_the_feed_counts_its_wait_for_input_after_the_first_batch(tiny_engine, tmp_path, with_writer):
    batches = [Batch((_sample(i, 30),)) for i in range(4)]
    writer = ShardWriter(tmp_path, synthetic_run(tiny_engine.layer_ids)) if with_writer else None
    times = extract_batches(tiny_engine, _slow(batches, 0.3), writer)
    if writer is not None:
        writer.close()
        assert times["consume_s"] > 0
    # The first batch's 0.3 s is start-up; the three after it are waits between forwards.
    assert 0.9 <= times["input_wait_s"] < 1.2 + 0.5


def test_the_hot_loops_own_threads_keep_their_seconds_for_its_report(tiny_engine, tmp_path, monkeypatch):
    """The batches made ahead and the offload's drain end before the hot loop reports where the host's cores
    went (`host_use`); each says so last, on its own thread, so that its seconds are kept."""
    said = []
    monkeypatch.setattr(feed_module.host_use, "ending", lambda: said.append(threading.current_thread().name))
    batches = [Batch((_sample(i, 30),)) for i in range(3)]
    writer = ShardWriter(tmp_path, synthetic_run(tiny_engine.layer_ids))
    extract_batches(tiny_engine, prepared_ahead(batches), writer)
    writer.close()
    assert sorted(said) == ["batches-ahead", "host-offload"]


def test_batches_prepared_ahead_are_made_while_the_caller_works_and_come_in_order():
    batches = [Batch((_sample(i, 5),)) for i in range(6)]
    made, used = [], []
    for batch in prepared_ahead(_slow(batches, 0.05, made), depth=8):
        used.append((batch.samples[0].index, time.perf_counter()))
        time.sleep(0.2)  # the caller's forward
    assert [i for i, _ in used] == list(range(6))
    # Made beside the caller's work: all six were ready long before the caller took the last.
    assert made[-1] < used[2][1]


def test_batches_prepared_ahead_have_their_images_prepared_for_the_engine_on_the_feeds_thread():
    """With an engine, each batch's sequences and images go to its prepare_images before the caller gets the
    batch, on the thread that makes the batches."""
    batches = [Batch((_sample(i, 5), _sample(i + 10, 3))) for i in range(3)]
    prepared = []

    class Engine:
        def prepare_images(self, seqs, images):
            prepared.append(([len(s) for s in seqs], images, threading.current_thread().name))

    for batch in prepared_ahead(iter(batches), Engine()):
        assert len(prepared) > batches.index(batch), "prepared before the caller has it"
    assert prepared == [([5, 3], [None, None], "batches-ahead")] * 3


def test_an_error_making_batches_reaches_the_caller_after_the_batches_before_it():
    def failing():
        yield Batch((_sample(0, 5),))
        raise BadRecordError(Reject("c.jsonl", 2, 1, "c.jsonl:2", "text is empty"))

    got = prepared_ahead(failing())
    assert next(got).samples[0].index == 0
    with pytest.raises(BadRecordError, match="text is empty"):
        next(got)


def test_a_caller_that_stops_early_stops_the_thread_making_batches():
    made = []
    got = prepared_ahead(_slow((Batch((_sample(i, 5),)) for i in range(1000)), 0.001, made), depth=2)
    next(got)
    got.close()
    time.sleep(0.3)
    stopped = len(made)
    time.sleep(0.3)
    assert len(made) == stopped < 10
    assert not [t for t in threading.enumerate() if t.name == "batches-ahead"]
