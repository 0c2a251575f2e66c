#!/usr/bin/env python
"""How big SpecForge's export of a run is against the run, per store and compression, plain and gzipped.

SpecForge trains on the tensors its files hold, in bf16, so an export decodes fp8 and zstd; gzip
(`.ckpt.gz`, which its reader opens) is what can bring the files back towards the run's size. The states
are activation-like (Gaussian, a few large channels, tokens of varied norm), 3 aux layers + the final state.

    python -m benchmarks.export_sizes --json benchmarks/results/export_sizes_cpu.json
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import click
import torch

from benchmarks import command_line, emit, program

from offline_extract.testing.shards import synthetic_run, write_samples
from offline_extract.testing.states import activation_like
from offline_extract.training.export import export_specforge

K = 3


@program(__doc__.split("\n\n")[0])
@click.option("--hidden", default=1024, show_default=True)
@click.option("--samples", default=6, show_default=True)
@click.option("--sample-tokens", default=1500, show_default=True)
@click.option("--json", "json_path", default=None, help="Also write the result to this file.")
def main(hidden: int, samples: int, sample_tokens: int, json_path: str | None) -> dict:
    n, t = samples, sample_tokens
    x = activation_like(n * t, K + 1, hidden)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="export-sizes-"))
    try:
        for store, compress in (("bf16", "none"), ("bf16", "zstd"), ("fp8", "none"), ("fp8", "zstd")):
            out = root / f"{store}-{compress}"
            run = synthetic_run((1, 3, 4), num_layers=8, store=store, compress=compress)
            write_samples(
                out,
                run,
                [t] * n,
                torch.zeros(n * t, dtype=torch.int32),
                torch.ones(n * t, dtype=torch.uint8),
                x[:, :K].reshape(n * t, -1),
                x[:, K],
            )
            run_bytes = sum(p.stat().st_size for p in out.glob("shard_*"))
            for gzipped in (False, True):
                start = time.perf_counter()
                summary = export_specforge(
                    out, root / f"sf-{store}-{compress}-{gzipped}", gzipped=gzipped, progress=False
                )
                rows.append(
                    {
                        "store": store,
                        "compress": compress,
                        "gzip": gzipped,
                        "run_bytes": run_bytes,
                        "export_bytes": summary.bytes_written,
                        "export_over_run": round(summary.bytes_written / run_bytes, 3),
                        "export_s": round(time.perf_counter() - start, 2),
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "command": command_line("python -m benchmarks.export_sizes"),
        "hidden": hidden,
        "tokens": n * t,
        "rows": rows,
    }
    return emit(result, json_path)


if __name__ == "__main__":
    main()
