#!/usr/bin/env python
"""CPU read throughput of our shards (HiddenStateDataset) vs SpecForge's per-sample torch.save files.

Builds a synthetic output directory and its SpecForge export in a temporary directory (about
2 GB each with the defaults), reads both from a warm page cache, and writes the figures as JSON.
See offline_extract/read_benchmark.py for the method.

\b
    python benchmarks/read_throughput.py
    python benchmarks/read_throughput.py --samples 64 --hidden-size 1024 --out /tmp/small.json
"""
import json
from pathlib import Path

import click

from offline_extract.read_benchmark import BenchConfig, run_benchmark

DEFAULTS = BenchConfig()
RESULTS = Path(__file__).resolve().parent / "results" / "read_throughput_cpu.json"


@click.command(help=__doc__)
@click.option("--samples", default=DEFAULTS.num_samples, show_default=True)
@click.option("--hidden-size", default=DEFAULTS.hidden_size, show_default=True)
@click.option("--num-aux", default=DEFAULTS.num_aux, show_default=True, help="EAGLE-3 layers (k).")
@click.option("--median-len", default=DEFAULTS.median_len, show_default=True,
              help="Median sample length; lengths are log-normal, clipped to [--min-len, --max-len].")
@click.option("--sigma", default=DEFAULTS.sigma, show_default=True, help="Log-normal sigma of the lengths.")
@click.option("--min-len", default=DEFAULTS.min_len, show_default=True)
@click.option("--max-len", default=DEFAULTS.max_len, show_default=True)
@click.option("--shard-mb", default=DEFAULTS.shard_mb, show_default=True)
@click.option("--passes", default=DEFAULTS.passes, show_default=True, help="Timed passes per reader.")
@click.option("--seed", default=DEFAULTS.seed, show_default=True)
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Where to build the data (default: the system temporary directory).")
@click.option("--keep", is_flag=True, help="Keep the generated data.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(samples, hidden_size, num_aux, median_len, sigma, min_len, max_len, shard_mb, passes, seed, work_dir,
         keep, out):
    config = BenchConfig(
        num_samples=samples, hidden_size=hidden_size, num_aux=num_aux, median_len=median_len, sigma=sigma,
        min_len=min_len, max_len=max_len, shard_mb=shard_mb, passes=passes, seed=seed,
    )
    result = run_benchmark(config, work_dir=work_dir, keep=keep)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, r in result["results"].items():
        click.echo(f"{name:16s} {r['samples_per_s']:10.1f} samples/s {r['gb_per_s']:8.2f} GB/s")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
