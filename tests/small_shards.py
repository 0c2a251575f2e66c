"""Small shards of exact values written through the real ShardWriter, for the store's in-process tests."""

import torch

from offline_extract.store import checksum
from offline_extract.store.shard import read_header
from offline_extract.testing.shards import synthetic_run, write_samples

RUN = synthetic_run((1, 3), 4, config_sha256="c", weights="w")


def write_shards(out, groups, numbers=None, on_written=None) -> list:
    """Shard numbers[k] (default k) holds group k of (sample index, length); every value is exact in bf16."""
    paths = []
    for k, group in enumerate(groups):
        indices, lengths = zip(*group)
        rows = torch.arange(sum(lengths), dtype=torch.float32)[:, None]
        paths += write_samples(
            out,
            RUN,
            lengths,
            rows[:, 0].int(),
            torch.ones(len(rows)),
            rows.repeat(1, 8),
            rows.repeat(1, 4),
            indices=indices,
            index=False,
            shard_numbers=iter([numbers[k] if numbers else k]),
            on_written=on_written,
        )
    return paths


def journal_entry(path) -> dict:
    header = read_header(path)
    return {
        "name": path.name,
        checksum.KEY: checksum.file_checksum(path),
        "bytes": path.stat().st_size,
        "num_samples": len(header.samples),
        "num_tokens": header.num_tokens,
    }
