#!/usr/bin/env python
"""Export extracted hidden states to another trainer's offline layout.

\b
    python bin/export.py --format specforge OUT_DIR --to DEST

\b
specforge: DEST/rows_{start}-{end}/data_{i}.ckpt, one torch.save dict per sample with input_ids [T]
and loss_mask [T] (int64), hidden_state [1, T, H] and aux_hidden_state [1, T, k*H] (bf16), i counting
samples in sample-index order; give DEST to SpecForge's offline EAGLE-3 training as its hidden-states
path.
DEST/export_manifest.json maps i to sample ids. Rerunning the same export into DEST resumes it.
"""
import _bin_path  # noqa: F401  (must come first: see its docstring)
import click

from offline_extract.store.shards import ShardError
from offline_extract.training.export import DEFAULT_ROWS_PER_FOLDER, FORMATS, ExportError, export


@click.command(help=__doc__)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Destination directory: new, empty, or an interrupted export of the same data.")
@click.option("--format", "format_", type=click.Choice(FORMATS), default="specforge", show_default=True)
@click.option("--rows-per-folder", default=DEFAULT_ROWS_PER_FOLDER, show_default=True,
              help="Samples per rows_{start}-{end} folder.")
@click.option("--no-progress", is_flag=True, help="No progress bar (e.g. for logs).")
def main(out_dir, dest, format_, rows_per_folder, no_progress):
    try:
        summary = export(format_, out_dir, dest, rows_per_folder=rows_per_folder, progress=not no_progress)
    except (ShardError, ExportError) as e:
        raise click.ClickException(str(e)) from e
    skipped = f", {summary.samples_skipped} already there" if summary.samples_skipped else ""
    click.echo(
        f"wrote {summary.samples_written} samples ({summary.bytes_written / 1e9:.2f} GB) to {summary.dest}{skipped}",
        err=True,
    )


if __name__ == "__main__":
    main()
