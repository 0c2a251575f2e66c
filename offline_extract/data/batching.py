"""Batching: ragged token batches under a per-forward token budget, with no padding anywhere.

SGLang's EXTEND batches take sequences of any lengths packed end to end, so a batch is just a run of
consecutive samples. Packing keeps corpus order, which makes batches a pure function of the corpus and
the options. A sample longer than the budget travels alone; the engine prefills it in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from offline_extract.data.tokenization import Sample


@dataclass(frozen=True)
class Batch:
    samples: tuple[Sample, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


def batch_by_tokens(samples: Iterable[Sample], max_tokens: int, max_seqs: int) -> Iterator[Batch]:
    if max_tokens < 1 or max_seqs < 1:
        raise ValueError(f"batch limits must be positive, got {max_tokens} tokens and {max_seqs} sequences")
    pending: list[Sample] = []
    tokens = 0
    for sample in samples:
        if pending and (tokens + sample.num_tokens > max_tokens or len(pending) == max_seqs):
            yield Batch(tuple(pending))
            pending, tokens = [], 0
        pending.append(sample)
        tokens += sample.num_tokens
    if pending:
        yield Batch(tuple(pending))
