"""Export extracted hidden states to another trainer's offline layout.

\b
    python bin/export.py --format specforge OUT_DIR --to DEST
    python bin/export.py --format speculators OUT_DIR --to DEST

\b
specforge: DEST/rows_{start}-{end}/data_{i}.ckpt (.ckpt.gz with --gzip, the default for a run stored
as fp8 or zstd), one torch.save dict per sample with input_ids [T] and loss_mask [T] (int64) and, for
an eagle3 run, hidden_state [1, T, H] (post-norm) and aux_hidden_state [1, T, k*H] (bf16); for a
dflash run hidden_states [1, T, k*H]; for dspark also target_last_hidden_states [1, T, H]. i counts
samples in sample-index order; give DEST to SpecForge's offline training as its hidden-states path.

\b
speculators: DEST is its training data directory: a datasets table (input_ids, loss_mask, seq_len),
DEST/hidden_states/hs_{i}.safetensors (hidden_states [T, k+1, H], the pre-norm final state last, and
token_ids [T]; from an fp8 run e4m3 values and hidden_states_scales [T, k+1, 1], read with
--hidden-states-backend fp8), DEST/token_freq.pt, and DEST/speculators_train.yaml for
`speculators train --config`. speculators' layer ids are ours + 1 (HF hidden_states indices; the final
state is num_layers): the YAML and export_manifest.json give its --target-layer-ids for this run.

A run holding the other final state (post-norm for speculators, pre-norm for SpecForge) is converted
with the final norm the run recorded: pre -> post exactly; post -> pre as each token's direction,
which is all speculators' EAGLE-3 training uses (it applies the norm itself).

DEST/export_manifest.json maps i to sample ids. Rerunning the same export into DEST resumes it.
"""
from pathlib import Path

import click

from offline_extract.cli import Interrupted, command
from offline_extract.words import plural
from offline_extract.store.schema import ShardError
from offline_extract.training.export import DEFAULT_ROWS_PER_FOLDER, FORMATS, ExportError, export


@command(help=__doc__)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Destination directory: new, empty, or an interrupted export of the same data.")
@click.option("--format", "format_", type=click.Choice(FORMATS), default="specforge", show_default=True,
              help="Which trainer's layout to write (each described above).")
@click.option("--rows-per-folder", default=DEFAULT_ROWS_PER_FOLDER, show_default=True, type=click.IntRange(min=1),
              help="Samples per rows_{start}-{end} folder (specforge).")
@click.option("--gzip/--no-gzip", "gzipped", default=None,
              help="Write data_{i}.ckpt.gz, which SpecForge's reader opens (specforge). Default: gzip a run stored as "
                   "fp8 or zstd, to keep the export near the run's size; plain .ckpt otherwise.")
@click.option("--allow-partial", is_flag=True,
              help="Export an extraction that has not finished (or has lost shards) as it is, with a warning; "
                   "without this it is refused, saying how many samples are missing.")
@click.option("--no-progress", is_flag=True, help="No progress bar (e.g. for logs).")
def main(out_dir, dest, format_, rows_per_folder, gzipped, allow_partial, no_progress):
    ctx = click.get_current_context()
    given = [option for name, option in (("rows_per_folder", "--rows-per-folder"), ("gzipped", "--gzip/--no-gzip"))
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if format_ != "specforge" and given:
        # Dropped silently, they would leave an export other than the one asked for.
        raise click.UsageError(f"{' and '.join(given)}: for --format specforge only, not {format_}")
    try:
        options = {"rows_per_folder": rows_per_folder, "gzipped": gzipped} if format_ == "specforge" else {}
        summary = export(format_, out_dir, dest, progress=not no_progress, allow_partial=allow_partial, **options)
    except (ShardError, ExportError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a full disk, say: the message names the errno and the file
        raise click.ClickException(f"{e}\nOnce the cause is fixed, rerunning the same export resumes into {dest}") from e
    except KeyboardInterrupt:
        if not Path(dest).exists():  # stopped before its first file: there is nothing to resume
            raise Interrupted(f"interrupted before anything was written to {dest}") from None
        raise Interrupted(f"interrupted; rerunning the same export resumes into {dest}") from None
    skipped = f", {summary.samples_skipped} already there" if summary.samples_skipped else ""
    click.echo(
        f"wrote {plural(summary.samples_written, 'sample')} ({summary.bytes_written / 1e9:.2f} GB) to {summary.dest}"
        f"{skipped}",
        err=True,
    )
    for note in summary.notes:
        click.echo(note, err=True)

