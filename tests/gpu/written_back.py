#!/usr/bin/env python
"""A run's every byte read back as the feed handed it to the writer, at a real run's scale.

The engine's states go through the feed (extract_batches: token-budget batches, a long sample in chunks,
streamed into its shard, the last piece `ending`) into ShardWriter at its real sizes (64 MiB checksum
blocks and tail parts, --shard-size-mb shards, --writers threads); a writer that keeps a copy of all it
is handed is then held against the shards, the index, the training reader and inspect --verify's check,
bit for bit and in order, and every journaled checksum against its file (tests/shard_checks.py). Run in
a process of its own: SGLang's engine keeps process globals and its GPU memory until the process ends.

    python tests/gpu/written_back.py --model MODEL --out OUT --writers 8             # the H200
    python tests/gpu/written_back.py --model TINY --out OUT --device cpu --tokens 20000 --long 3000 \
        --shard-size-mb 1                                                            # its CPU path
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
from shard_checks import KeepingWriter, check_written  # noqa: E402

from offline_extract.data.batching import batch_by_tokens  # noqa: E402
from offline_extract.data.tokenization import Sample  # noqa: E402
from offline_extract.engine.distributed import free_port  # noqa: E402
from offline_extract.engine.sglang_adapter import Engine, EngineConfig  # noqa: E402
from offline_extract.feed import extract_batches  # noqa: E402
from offline_extract.store import manifest  # noqa: E402
from offline_extract.store.journal import Journal  # noqa: E402
from offline_extract.testing.shards import synthetic_run  # noqa: E402


def corpus(tokens: int, long: int, vocab: int, seed: int) -> list[Sample]:
    """Lognormal lengths (a chat corpus's shape) adding up to about `tokens`, with one sample of `long`
    tokens two thirds of the way through; random ids below `vocab`."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(max(rng.lognormal(6.5, 1.0), 1), 8192)))
    lengths.insert(2 * len(lengths) // 3, long)
    return [
        Sample(
            i,
            f"s{i}",
            "corpus.jsonl",
            i + 1,
            rng.integers(10, vocab, n).astype(np.int32),
            (rng.random(n) < 0.7).astype(np.uint8),
            n,
            False,
        )
        for i, n in enumerate(lengths)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--store", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--compress", default="none", choices=["none", "zstd"])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=250_000, help="tokens of lognormal samples")
    parser.add_argument("--long", type=int, default=131_072, help="tokens of the one long sample")
    parser.add_argument("--shard-size-mb", type=float, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    engine = Engine(
        EngineConfig(
            model_path=args.model,
            device=args.device,
            dtype="bfloat16" if cuda else "float32",
            max_tokens_per_batch=16384 if cuda else 2048,
            context_length=max(args.long, 8192 if cuda else 4096),
            nccl_port=free_port(),
        )
    )
    samples = corpus(args.tokens, args.long, 380, args.seed)
    run = synthetic_run(engine.layer_ids, engine.hidden_size, store=args.store, compress=args.compress)
    shard_bytes = int(args.shard_size_mb * (1 << 20))
    args.out.mkdir(parents=True)
    start = time.perf_counter()
    with Journal(manifest.journal_path(args.out, 0)) as journal:
        writer = KeepingWriter(
            args.out, run, shard_bytes=shard_bytes, writers=args.writers, on_written=lambda s: journal.append(asdict(s))
        )
        extract_batches(
            engine, batch_by_tokens(samples, engine.cfg.max_tokens_per_batch, engine.cfg.max_seqs_per_batch), writer
        )
        paths = writer.close()
    extracted = time.perf_counter() - start
    assert [f.info.index for f in writer.handed] == [s.index for s in samples], "the feed handed over other samples"
    check_written(args.out, run, writer, paths, shard_bytes)
    print(
        f"ok: {len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens, {len(paths)} shards, "
        f"{writer.bytes_written / 1e9:.2f} GB ({args.store}, {args.compress}, {args.writers} writers) read back as "
        f"handed over; extracted in {extracted:.1f} s, checked in {time.perf_counter() - start - extracted:.1f} s"
    )


if __name__ == "__main__":
    main()
