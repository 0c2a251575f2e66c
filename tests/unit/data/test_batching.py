import numpy as np
import pytest

from offline_extract.data.batching import batch_by_tokens
from offline_extract.data.tokenization import Sample


def _samples(lengths):
    return [
        Sample(
            index=i,
            id=f"s{i}",
            source="c.jsonl",
            line=i + 1,
            input_ids=np.arange(n, dtype=np.int32),
            loss_mask=np.ones(n, dtype=np.uint8),
            source_len=n,
            truncated=False,
        )
        for i, n in enumerate(lengths)
    ]


LENGTHS = [int(n) for n in np.random.default_rng(0).integers(1, 900, 500)]


@pytest.mark.parametrize("max_tokens,max_seqs", [(1024, 256), (4096, 3), (900, 1)])
def test_every_sample_once_in_order_within_budgets(max_tokens, max_seqs):
    batches = list(batch_by_tokens(_samples(LENGTHS), max_tokens, max_seqs))
    flat = [s.index for b in batches for s in b.samples]
    assert flat == list(range(len(LENGTHS)))
    for b in batches:
        assert b.num_tokens <= max_tokens and 1 <= len(b.samples) <= max_seqs
        assert b.num_tokens == sum(LENGTHS[s.index] for s in b.samples)


def test_greedy_packing_leaves_no_batch_that_could_take_the_next_sample():
    batches = list(batch_by_tokens(_samples(LENGTHS), 2048, 256))
    for b, nxt in zip(batches, batches[1:]):
        assert b.num_tokens + nxt.samples[0].num_tokens > 2048


def test_deterministic():
    a = [[s.index for s in b.samples] for b in batch_by_tokens(_samples(LENGTHS), 1500, 7)]
    b = [[s.index for s in b.samples] for b in batch_by_tokens(_samples(LENGTHS), 1500, 7)]
    assert a == b


def test_a_sample_over_the_budget_travels_alone():
    batches = list(batch_by_tokens(_samples([10, 5000, 20, 30]), 1000, 8))
    assert [[s.index for s in b.samples] for b in batches] == [[0], [1], [2, 3]]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="positive"):
        list(batch_by_tokens(_samples([1]), 0, 1))
