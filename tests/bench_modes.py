"""The two modes run_bench times, bare prefill then extraction into shards, on given batches: for the CPU tests
of bin/bench.py --data, in the test process and in one of its own (an image model's engine)."""

from benchmarks.extraction_vs_prefill import _bare, _ForwardClock, _rank_report, _timed
from offline_extract.feed import extract_batches
from offline_extract.store.schema import Encoding
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run


def both_modes(engine, batches, out, coord) -> tuple[dict, dict]:
    """Each mode's rank report (what its forwards were handed, `_ForwardClock`); the shards go to `out`."""
    clock = _ForwardClock(engine)
    _timed(coord, lambda: _bare(clock, batches), clock)
    bare = _rank_report(coord.layout, clock)
    encoding = Encoding("bf16")
    widths = encoding.widths(len(engine.layer_ids), engine.hidden_size)
    writer = ShardWriter(out, synthetic_run(engine.layer_ids), shard_bytes=1 << 20, widths=widths)
    _timed(coord, lambda: (extract_batches(clock, batches, writer), writer.close()), clock)
    return bare, _rank_report(coord.layout, clock, writer=writer)
