"""Small shards of exact values written through the real ShardWriter, for the store's in-process tests."""
import numpy as np
import torch
from extract_runs import sha256

from offline_extract.store.schema import SampleInfo
from offline_extract.store.shard import read_header
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run

RUN = synthetic_run((1, 3), 4, config_sha256="c", weights="w")


def write_shards(out, groups, numbers=None, on_written=None) -> list:
    """Shard numbers[k] (default k) holds group k of (sample index, length); every value is exact in bf16."""
    paths = []
    for k, group in enumerate(groups):
        writer = ShardWriter(out, RUN, shard_numbers=iter([numbers[k] if numbers else k]), on_written=on_written)
        infos = [SampleInfo(i, f"s{i}", "c.jsonl", i + 1, n, False) for i, n in group]
        total = sum(n for _, n in group)
        rows = torch.arange(total, dtype=torch.float32)[:, None]
        writer.add_batch(infos, np.arange(total), np.ones(total), rows.repeat(1, 8), rows.repeat(1, 4),
                         lengths=[n for _, n in group])
        paths += writer.close()
    return paths


def journal_entry(path) -> dict:
    header = read_header(path)
    return {"name": path.name, "sha256": sha256(path), "bytes": path.stat().st_size,
            "num_samples": len(header.samples), "num_tokens": header.num_tokens}
