"""What one extraction attempt counted: every record read is exactly one of extracted, resumed, skipped,
rejected or dropped (`Tally` counts them as they go by), and the report and verdict made of the counts."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

from offline_extract.data.batching import Batch
from offline_extract.data.corpus import BadRecordError, Reject
from offline_extract.data.tokenization import Sample
from offline_extract.formatting import human_bytes, number, plural
from offline_extract.lifecycle.progress import note
from offline_extract.store.journal import Journal
from offline_extract.store.schema import REJECTS_FILE
from offline_extract.store.writer import ShardWriter


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
        return Summary(
            **{
                f.name: f.metadata.get("merge", operator.add)(getattr(self, f.name), getattr(other, f.name))
                for f in fields(self)
            }
        )

    def no_sample_verdict(self, data: Sequence[str]) -> str | None:
        left_out = {"rejected": self.rejected, "skipped": self.skipped, "dropped": self.dropped}
        return no_sample_verdict(data, self.records, left_out)

    def report(self, out: str | os.PathLike) -> str:
        # Resumed samples count as extracted, so that the four counts add up to the records read.
        extracted = f"extracted {number(self.extracted + self.resumed)}"
        if self.resumed:
            extracted += f" ({number(self.resumed)} by earlier attempts)"
        lines = [
            f"records {number(self.records)}: {extracted}, skipped {number(self.skipped)}, rejected "
            f"{number(self.rejected)}, dropped {number(self.dropped)}",
        ]
        if self.tokens or self.shards:
            lines += [
                # A resumed run's count is of this attempt's samples alone, not of the corpus.
                f"tokens {number(self.tokens)}{' extracted now' if self.resumed else ''}: "
                f"{number(round(self.tokens / max(self.extract_seconds, 1e-9)))} tok/s over "
                f"{self.extract_seconds:.1f} s of extraction ({self.seconds:.1f} s with start-up)",
                f"{plural(len(self.shards), 'new shard')}, {human_bytes(self.bytes_written)} -> {out}",
            ]
        if self.nonfinite_kept:
            hold = "holds" if self.nonfinite_kept == 1 else "hold"
            lines.append(f"{plural(self.nonfinite_kept, 'extracted sample')} {hold} NaN or Inf (--nonfinite keep)")
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
    which = f"all {number(records)} records" if records > 1 else "its only record"
    if len(kinds) == 1:
        return f"{which} {next(iter(kinds))}"
    return f"{which} left out ({', '.join(f'{number(n)} {kind}' for kind, n in kinds.items())})"


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
            note(f"warning: sample {sample.id!r} ({sample.source}:{sample.line}) kept with {reason}")

    def batch_done(self, batch: Batch) -> None:
        """Counts the batch's tokens."""
        self.summary.tokens += batch.num_tokens

    def records_read(self) -> int:
        """The records read since the last call, bad and resumed ones included, so that a progress bar over
        the records reaches its total, also when the last records (or all of them) give no batch."""
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
