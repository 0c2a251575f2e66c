"""The feed through the real engine on CPU: which piece of a run it tells the writer is the last."""
import numpy as np
import pytest

from offline_extract.data.batching import Batch
from offline_extract.data.tokenization import Sample
from offline_extract.feed import extract_batches
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
def test_only_the_runs_last_piece_is_handed_over_as_the_last(tiny_engine, tmp_path, long_last):
    budget = tiny_engine.cfg.max_tokens_per_batch
    short = Batch((_sample(0, 40), _sample(1, 30)))
    long = Batch((_sample(2, budget + 50),))  # over the budget: two chunks
    batches = [short, long] if long_last else [long, short]
    writer = _Recording(tmp_path, synthetic_run(tiny_engine.layer_ids))
    extract_batches(tiny_engine, batches, writer)
    writer.close()
    want = [([0, 1], False), ([2], True)] if long_last else [([2], False), ([0, 1], True)]
    assert writer.calls == want
