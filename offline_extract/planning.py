"""The dry run: what a corpus will cost before any GPU time is spent.

It reads and tokenizes the whole corpus exactly as extraction would (same policies, same rejects) and
turns the token count into bytes per output tensor, set against the free space at the output.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from offline_extract.data.corpus import BadRecordError, Record, Reject, read_corpus
from offline_extract.data.tokenization import Sample, SampleTokenizer
from offline_extract.progress import human_bytes
from offline_extract.store.schema import Encoding

# Rejected records listed by a dry run, with their reasons; the run itself lists every one in rejects.jsonl.
REJECTS_SHOWN = 10
# Per sample, besides its rows of the per-sample tensors: its metadata entry (about 150 bytes of JSON).
_SAMPLE_METADATA_BYTES = 150


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

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tensor.values())

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.free_bytes


def plan(
    data, tokenizer: SampleTokenizer, out: str | Path, hidden_size: int, num_aux_layers: int,
    encoding: Encoding = Encoding(), strict: bool = False,
) -> Plan:
    """Under `strict`, the first bad record raises BadRecordError, as it stops the real run. Compressed
    states are sized as they are before compression: how much zstd saves depends on the states."""
    records = samples = skipped = rejected = tokens = loss_tokens = 0
    first_rejects = []
    for item in read_corpus(data):
        records += 1
        if isinstance(item, Record):
            item = tokenizer(item)
        if isinstance(item, Sample):
            samples += 1
            tokens += item.num_tokens
            loss_tokens += int(item.loss_mask.sum())
        elif item.kind == "skipped":
            skipped += 1
        elif strict:
            raise BadRecordError(item)
        else:
            rejected += 1
            if len(first_rejects) < REJECTS_SHOWN:
                first_rejects.append(item)
    # The hidden states first (the encoding lists them first): they are nearly all of it.
    sizes = {
        name + (" (before zstd)" if name in encoding.compressed else ""): tokens * n
        for name, n in encoding.bytes_per_token(num_aux_layers, hidden_size).items()
    }
    per_sample = [t for t in encoding.tensors if t.rows in ("n", "n+1")]
    sample_bytes = sum(t.dtype.itemsize for t in per_sample) + _SAMPLE_METADATA_BYTES
    sizes[", ".join(t.name for t in per_sample) + ", metadata"] = samples * sample_bytes
    existing = Path(out)
    while not existing.exists():
        existing = existing.parent
    return Plan(records, samples, skipped, rejected, tokens, loss_tokens, sizes, shutil.disk_usage(existing).free,
                writable=os.access(existing, os.W_OK), first_rejects=tuple(first_rejects))


def render(p: Plan, out: str | Path) -> str:
    lines = [
        f"records {p.records}: {p.samples} samples, {p.skipped} skipped, {p.rejected} rejected",
        *(f"  rejected {r.source}:{r.line}{f' (id {r.id!r})' if r.id else ''}: {r.reason}" for r in p.first_rejects),
        *([f"  ... and {p.rejected - len(p.first_rejects)} more"] if p.rejected > len(p.first_rejects) else []),
        f"tokens {p.tokens:,} ({p.loss_tokens:,} in the loss, {p.loss_tokens / max(p.tokens, 1):.1%})",
    ]
    lines += [f"  {name:<32} {human_bytes(size):>12}" for name, size in p.bytes_by_tensor.items()]
    lines.append(f"  {'total':<32} {human_bytes(p.total_bytes):>12}")
    lines.append(f"free at {out}: {human_bytes(p.free_bytes)} -> {'fits' if p.fits else 'DOES NOT FIT'}")
    if not p.writable:
        lines.append(f"{out} cannot be written here (read-only, or no permission)")
    return "\n".join(lines)
