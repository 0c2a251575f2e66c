"""The export command: an extraction's output to another trainer's offline layout (training/formats.py's
EXPORTERS, one entry a --format)."""

from pathlib import Path

import click

from offline_extract.cli import Interrupted, command
from offline_extract.formatting import human_bytes, number, plural
from offline_extract.training.formats import DEFAULT_ROWS_PER_FOLDER, EXPORTERS, FORMATS

HELP = "\n\n".join(
    [
        "Export extracted hidden states to another trainer's offline layout.",
        "\b\n" + "\n".join(f"    python bin/export.py --format {name} OUT_DIR --to DEST" for name in EXPORTERS),
        *(f"{name}: {exporter.help}" for name, exporter in EXPORTERS.items()),
        "Each trainer takes one final state ("
        + ", ".join(f"{name}: {exporter.final_state}" for name, exporter in EXPORTERS.items())
        + "); a run holding the other is converted with the final norm the run recorded: pre -> post exactly; "
        "post -> pre as each token's direction, which is all speculators' EAGLE-3 training uses (it applies the "
        "norm itself).",
        "DEST/export_manifest.json maps i to sample ids. Rerunning the same export into DEST resumes it.",
    ]
)


@command(help=HELP)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option(
    "--to",
    "dest",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    help="Destination directory: new, empty, or an interrupted export of the same data.",
)
@click.option(
    "--format",
    "format_",
    type=click.Choice(FORMATS),
    default="specforge",
    show_default=True,
    help="Which trainer's layout to write (each described above).",
)
@click.option(
    "--rows-per-folder",
    default=DEFAULT_ROWS_PER_FOLDER,
    show_default=True,
    type=click.IntRange(min=1),
    help="Samples per rows_{start}-{end} folder (specforge).",
)
@click.option(
    "--gzip/--no-gzip",
    "gzipped",
    default=None,
    help="Write data_{i}.ckpt.gz, which SpecForge's reader opens (specforge). Default: gzip a run stored as "
    "fp8 or zstd, to keep the export near the run's size; plain .ckpt otherwise.",
)
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Export an extraction that has not finished (or has lost shards) as it is, with a warning; "
    "without this it is refused, saying how many samples are missing.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (e.g. for logs).")
def main(out_dir, dest, format_, rows_per_folder, gzipped, allow_partial, no_progress):
    # Here, not at the top: torch and datasets take seconds to import, which --help and --version need not wait for.
    from offline_extract.store.schema import ShardError
    from offline_extract.training.export import ExportError, export

    ctx = click.get_current_context()
    takes = EXPORTERS[format_].options
    others = {name for exporter in EXPORTERS.values() for name in exporter.options} - set(takes)
    given = [
        param
        for param in ctx.command.params
        if param.name in others and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        # Dropped silently, they would leave an export other than the one asked for.
        names = {param.name for param in given}
        formats = " or ".join(f for f, exporter in EXPORTERS.items() if names <= set(exporter.options))
        raise click.UsageError(
            f"{' and '.join('/'.join(p.opts + p.secondary_opts) for p in given)}: for --format "
            f"{formats} only, not {format_}"
        )
    try:
        options = {name: ctx.params[name] for name in takes}
        summary = export(format_, out_dir, dest, progress=not no_progress, allow_partial=allow_partial, **options)
    except (ShardError, ExportError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a full disk, say: the message names the errno and the file
        raise click.ClickException(
            f"{e}\nOnce the cause is fixed, rerunning the same export resumes into {dest}"
        ) from e
    except KeyboardInterrupt:
        if not Path(dest).exists():  # stopped before its first file: there is nothing to resume
            raise Interrupted(f" before anything was written to {dest}") from None
        raise Interrupted(f"; rerunning the same export resumes into {dest}") from None
    skipped = f", {number(summary.samples_skipped)} already there" if summary.samples_skipped else ""
    click.echo(
        f"wrote {plural(summary.samples_written, 'sample')} ({human_bytes(summary.bytes_written)}) to {summary.dest}"
        f"{skipped}",
        err=True,
    )
    for note in summary.notes:
        click.echo(note, err=True)
