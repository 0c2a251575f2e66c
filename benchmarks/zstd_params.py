#!/usr/bin/env python
"""zstd's plain level 1 against the parameters `--compress zstd` uses (store/codecs.py: level 1, fast
strategy, matches of 7 bytes or more, a 256-entry hash table), on one sample's activation-like states
(Gaussian, a few large channels, tokens of varied norm; 3 aux layers of an 8B model's width): ratio, and
single-thread speed as the best of a few runs.

    python -m benchmarks.zstd_params --json benchmarks/results/zstd_params_cpu.json
"""

from __future__ import annotations

import time

import click
import torch
import zstandard

from benchmarks import command_line, emit, program

from offline_extract.store.codecs import ZSTD_LEVEL, compress_frame, compressor, fp8_quantize
from offline_extract.testing.states import activation_like


def _measure(tensor: torch.Tensor, cctx, repeat: int) -> dict:
    best, frame = float("inf"), b""
    for _ in range(repeat):
        start = time.perf_counter()
        frame = compress_frame(tensor, cctx)
        best = min(best, time.perf_counter() - start)
    nbytes = tensor.numel() * tensor.element_size()
    return {"ratio": round(nbytes / len(frame), 3), "mb_s": round(nbytes / best / 1e6, 1)}


@program(__doc__.split("\n\n")[0])
@click.option("--tokens", default=1700, show_default=True)
@click.option("--width", default=3 * 4096, show_default=True)
@click.option("--repeat", default=5, show_default=True)
@click.option("--seeds", default=2, show_default=True)
@click.option("--json", "json_path", default=None, help="Also write the result to this file.")
def main(tokens: int, width: int, repeat: int, seeds: int, json_path: str | None) -> dict:
    torch.set_num_threads(1)
    plain = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=True)
    rows = []
    for seed in range(seeds):
        bf16 = activation_like(tokens, 1, width, seed).reshape(tokens, width)
        fp8, _ = fp8_quantize(bf16, 3)
        for store, tensor in (("bf16", bf16), ("fp8", fp8)):
            rows.append(
                {
                    "seed": seed,
                    "store": store,
                    "level_1": _measure(tensor, plain, repeat),
                    "ours": _measure(tensor, compressor(), repeat),
                }
            )
    result = {
        "command": command_line("python -m benchmarks.zstd_params"),
        "tokens": tokens,
        "width": width,
        "threads": 1,
        "rows": rows,
    }
    return emit(result, json_path)


if __name__ == "__main__":
    main()
