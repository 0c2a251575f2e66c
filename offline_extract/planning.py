"""The dry run: what a corpus will cost before any GPU time is spent.

It reads and tokenizes the whole corpus exactly as extraction would (same policies, same rejects) and
turns the token count into bytes per output tensor, set against the free space at the output. During a
run, `OutputWatch` sets the shards written so far (compressed, if so, as no dry run can know) against it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from offline_extract.data.corpus import BadRecordError, Record, Reject, read_corpus
from offline_extract.data.tokenization import Sample, SampleTokenizer
from offline_extract.formatting import human_bytes, number, plural
from offline_extract.lifecycle.progress import note
from offline_extract.store.schema import Encoding

# Rejected records listed by a dry run, with their reasons; the run itself lists every one in rejects.jsonl.
REJECTS_SHOWN = 10
# Per sample, besides its rows of the per-sample tensors: its metadata entry (about 150 bytes of JSON).
_SAMPLE_METADATA_BYTES = 150


class _Counts(TypedDict):
    """What `_count` counts of a corpus, by the names of Plan's fields."""

    records: int
    samples: int
    skipped: int
    rejected: int
    tokens: int
    loss_tokens: int
    kept: int
    image_tokens: int
    image_samples: int


@dataclass(frozen=True)
class Plan:
    records: int
    samples: int
    skipped: int
    rejected: int
    tokens: int
    loss_tokens: int
    bytes_by_tensor: dict[str, int]
    free_bytes: int
    # The directory --out would be created in (or --out itself) can take files: a read-only mount or a
    # directory of someone else's fails the real run at its first write.
    writable: bool = True
    # The first rejected records, each with its source, line and reason (`rejected` counts them all).
    first_rejects: tuple[Reject, ...] = ()
    # Of total_bytes, what --compress zstd compresses (the states), sized before compression.
    compressible_bytes: int = 0
    # --out already holds this run's finished output: the run says "already complete" and extracts nothing.
    finished: bool = False
    # Otherwise, the real run's words refusing --out while another live run holds it (--force does not help).
    in_use: str | None = None
    # Samples an earlier attempt left in complete shards of --out, and those shards: the run resumes, so
    # `samples`, `tokens` and the bytes are what it has left to extract.
    kept: int = 0
    kept_shards: int = 0
    # Of `tokens`, those that stand for images (a vision-language model's image chats), and the samples holding them.
    image_tokens: int = 0
    image_samples: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tensor.values())

    @property
    def fits(self) -> bool:
        """Fits even if zstd saved nothing."""
        return self.total_bytes <= self.free_bytes

    @property
    def ratio_needed(self) -> float | None:
        """For a compressed output that does not fit as it is before compression: how many times zstd must
        shrink the states for it to fit (inf: the rest alone does not); None otherwise. How much it does
        depends on the states, which only the run sees."""
        if self.fits or not self.compressible_bytes:
            return None
        room = self.free_bytes - (self.total_bytes - self.compressible_bytes)
        return self.compressible_bytes / room if room > 0 else float("inf")

    def _zstd_condition(self) -> str | None:
        """What fitting takes of zstd, when compression could make it fit; None when it fits anyway or cannot."""
        ratio = self.ratio_needed
        return None if ratio is None or ratio == float("inf") else f"zstd shrinks the states {ratio:.2f}x or more"

    def verdict(self) -> str:
        if self.fits:
            return "fits"
        condition = self._zstd_condition()
        return f"fits only if {condition} (unknown until they are written)" if condition else "DOES NOT FIT"

    def refusal(self, out: str | Path) -> str | None:
        """Why the dry run says no to running into `out` as it stands (--force overrides); None: it fits, or
        the run has nothing left to write."""
        if self.fits or self.finished:
            return None
        condition = self._zstd_condition()
        if condition is None:
            return f"the output would not fit in {out}; free space first or pass --force"
        return (
            f"the output fits in {out} only if {condition}, which only the run can tell; free space first, or "
            f"pass --force to try (a run that fills the disk stops with its complete shards kept, and re-running "
            f"it resumes once there is room)"
        )


def plan(
    data,
    tokenizer: SampleTokenizer,
    out: str | Path,
    hidden_size: int,
    num_aux_layers: int,
    encoding: Encoding = Encoding(),
    strict: bool = False,
    advance: Callable[[int], None] | None = None,
    done: np.ndarray | None = None,
    kept_shards: int = 0,
) -> Plan:
    """Under `strict`, the first bad record raises BadRecordError, as it stops the real run. Compressed
    states are sized as they are before compression: how much zstd saves depends on the states. `advance`
    is told of each record read, with its sample's tokens (0 for one left out). `done[i]` marks record i as
    kept in one of the `kept_shards` complete shards already in `out` (`resume.done_mask`): as the run
    resuming there does, it is counted and not sized again."""
    counts, first_rejects = _count(data, tokenizer, strict, advance, done)
    tokens = counts["tokens"]
    # The hidden states first (the encoding lists them first): they are nearly all of it.
    per_token = encoding.bytes_per_token(num_aux_layers, hidden_size)
    sizes = {
        name + (" (before zstd)" if name in encoding.compressed else ""): tokens * n for name, n in per_token.items()
    }
    compressible = tokens * sum(n for name, n in per_token.items() if name in encoding.compressed)
    per_sample = [t for t in encoding.tensors if t.rows in ("n", "n+1")]
    sample_bytes = sum(t.dtype.itemsize for t in per_sample) + _SAMPLE_METADATA_BYTES
    sizes[", ".join(t.name for t in per_sample) + ", metadata"] = counts["samples"] * sample_bytes
    existing = Path(out)
    while not existing.exists():
        existing = existing.parent
    return Plan(
        **counts,
        bytes_by_tensor=sizes,
        free_bytes=shutil.disk_usage(existing).free,
        writable=os.access(existing, os.W_OK),
        first_rejects=tuple(first_rejects),
        compressible_bytes=compressible,
        kept_shards=kept_shards if counts["kept"] else 0,
    )


def _count(
    data, tokenizer: SampleTokenizer, strict: bool, advance: Callable[[int], None] | None, done: np.ndarray | None
) -> tuple[_Counts, list[Reject]]:
    """`plan`'s counts of the corpus and its first rejects, as `plan` says."""
    n = _Counts(
        records=0, samples=0, skipped=0, rejected=0, tokens=0, loss_tokens=0, kept=0, image_tokens=0, image_samples=0
    )
    first_rejects: list[Reject] = []
    for item in read_corpus(data):
        n["records"] += 1
        if done is not None and item.index < len(done) and done[item.index]:
            n["kept"] += 1
            if advance is not None:
                advance(0)
            continue
        made = tokenizer(item) if isinstance(item, Record) else item
        if advance is not None:
            advance(made.num_tokens if isinstance(made, Sample) else 0)
        if isinstance(made, Sample):
            n["samples"] += 1
            n["tokens"] += made.num_tokens
            n["loss_tokens"] += int(made.loss_mask.sum())
            if made.images is not None:
                n["image_samples"] += 1
                n["image_tokens"] += int(made.images.token_mask.sum())
        elif made.kind == "skipped":
            n["skipped"] += 1
        elif strict:
            raise BadRecordError(made)
        else:
            n["rejected"] += 1
            if len(first_rejects) < REJECTS_SHOWN:
                first_rejects.append(made)
    return n, first_rejects


def render(p: Plan, out: str | Path) -> str:
    kept = f"{number(p.kept)} kept, " if p.kept else ""
    lines = [
        f"records {number(p.records)}: {kept}{plural(p.samples, 'sample')}{' to extract' if p.kept else ''}, "
        f"{number(p.skipped)} skipped, {number(p.rejected)} rejected",
        *(f"  rejected {r.source}:{r.line}{f' (id {r.id!r})' if r.id else ''}: {r.reason}" for r in p.first_rejects),
        *([f"  ... and {number(p.rejected - len(p.first_rejects))} more"] if p.rejected > len(p.first_rejects) else []),
        f"tokens {number(p.tokens)} ({number(p.loss_tokens)} in the loss, {p.loss_tokens / max(p.tokens, 1):.1%})",
        *(
            [
                f"  image tokens {number(p.image_tokens)} ({p.image_tokens / max(p.tokens, 1):.1%}), in "
                f"{plural(p.image_samples, 'sample')} with images"
            ]
            if p.image_samples
            else []
        ),
    ]
    # As wide as a tensor's name (nvfp4's block scales before zstd run to 43); the small ones, listed together, run past.
    width = max([32, *(len(name) for name in p.bytes_by_tensor if "," not in name)])
    lines += [f"  {name:<{width}} {human_bytes(size):>12}" for name, size in p.bytes_by_tensor.items()]
    lines.append(f"  {'total':<{width}} {human_bytes(p.total_bytes):>12}")
    lines.append(f"free at {out}: {human_bytes(p.free_bytes)} -> {p.verdict()}")
    if not p.writable:
        lines.append(f"{out} cannot be written here (read-only, or no permission)")
    if p.finished:
        lines.append(f"{out} already holds this run's finished output: running it extracts nothing")
    elif p.kept:
        lines.append(
            f"{out} holds {plural(p.kept, 'sample')} of an earlier attempt in "
            f"{plural(p.kept_shards, 'complete shard')}: the run resumes, extracting the "
            f"{plural(p.samples, 'sample')} left (sized above)"
        )
    if p.in_use:
        lines.append(f"{out} is in use by another extraction now: the run would be refused")
    return "\n".join(lines)


class OutputWatch:
    """Warns once, during a run, when the output is on course to outgrow the free space at `out`: the bytes
    a token of the shards written so far, times the tokens still to come (the records left, at the tokens a
    record so far). `replicas` processes write their shares of the records into `out` alike. The run goes
    on: a full disk stops it with its complete shards kept, and the space may be freed meanwhile."""

    def __init__(self, out: str | Path, replicas: int = 1):
        self.out, self.replicas = Path(out), replicas
        self._bytes_seen = 0  # bytes written at the last look: one look a new shard
        self.warned = False

    def check(
        self, records_done: int, records_total: int | None, tokens_done: int, tokens_written: int, bytes_written: int
    ) -> None:
        if (
            self.warned
            or records_total is None
            or not records_done
            or not tokens_written
            or bytes_written == self._bytes_seen
        ):
            return
        self._bytes_seen = bytes_written
        tokens_left = max(tokens_done * records_total / records_done - tokens_written, 0)
        needed = tokens_left * bytes_written / tokens_written * self.replicas
        free = shutil.disk_usage(self.out).free
        if needed > free:
            self.warned = True
            note(
                f"warning: at the {number(round(bytes_written / tokens_written))} bytes a token written so far, the output needs "
                f"about {human_bytes(needed)} more and {self.out} has {human_bytes(free)} free: the run will stop when "
                f"the disk is full, keeping its complete shards (free space, then re-run the same command to resume)"
            )
