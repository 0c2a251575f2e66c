"""Summarize offline_extract shards: counts, run facts, per-layer statistics, or one sample's tokens;
or verify an output directory."""

import json
from dataclasses import asdict
from pathlib import Path

import click

from offline_extract.cli import command
from offline_extract.formatting import plural


@command()
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--sample",
    "sample_id",
    help='Show the sample of this id (the record\'s "id", else NAME:LINE, NAME the '
    "corpus file's name), or of SOURCE:LINE as --data named the source: its text, the tokens in the loss "
    "highlighted (in [[ ]] where the output takes no colours: a pipe, a file).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the result (the summary, the sample, or --verify's report) as JSON instead of tables.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Re-hash every shard against manifest.json and check shapes, dtypes, offsets and index.json; "
    "list every problem and say which shards are damaged (delete those and re-run the extraction). "
    "An interrupted run's complete shards, not yet in manifest.json, are listed as unfinished, not "
    "as problems. Exit status: 0 complete and sound, 1 problems, 3 unfinished but sound.",
)
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Summarize an extraction that has not finished (or has lost shards) as it is; without this "
    "it is refused, saying how many samples are missing. --sample works on it either way.",
)
def main(path: str, sample_id: str | None, as_json: bool, verify: bool, allow_partial: bool) -> None:
    """Summarize extracted shards: sample and token counts, the run's facts, and each stored layer's mean,
    std, absmax and NaN/Inf counts; or show one sample (--sample), or verify an output directory (--verify).

    PATH is a shard file or an output directory of shards (a directory for --verify)."""
    # Here, not at the top: torch and safetensors take seconds to import, which --help and --version need not
    # wait for.
    from rich.console import Console

    from offline_extract.store import inspection
    from offline_extract.store.schema import ShardError

    if verify and sample_id is not None:
        raise click.UsageError("--verify checks the whole output and --sample shows one sample: give one of them")
    if verify:
        _verify(path, as_json)
    try:
        result = inspection.summarize(path, allow_partial) if sample_id is None else _sample(path, sample_id)
    except ShardError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif sample_id is not None:
        inspection.render_sample(result, Console())
    else:
        inspection.render_summary(result, Console())


def _verify(path: str, as_json: bool) -> None:
    """--verify: the report of the output directory `path`, and what to do about it; exits with its status."""
    from offline_extract.store import integrity, manifest
    from offline_extract.store.index import shard_paths
    from offline_extract.store.schema import ShardError

    given = Path(path)
    if not given.is_dir():
        raise click.BadParameter(
            f"--verify checks an output directory, not one file: give {given.parent}, which holds {given.name}"
            if given.exists()
            else f"{path} does not exist",
            param_hint="PATH",
        )
    if not (Path(path) / manifest.MANIFEST_NAME).exists() and not shard_paths(path):
        # Else verify would list what such a run lacks and advise re-running an extraction that never was.
        raise click.ClickException(
            f"{path} is not an extraction's output: it holds neither {manifest.MANIFEST_NAME} nor shard files"
        )
    try:
        report = integrity.verify(path)
    except ShardError as e:  # e.g. another tool's manifest.json: named, as --verify cannot judge the folder
        raise click.ClickException(str(e)) from e
    status = 1 if report.problems or report.refused else 3 if report.unfinished else 0
    if as_json:
        click.echo(json.dumps({"path": path, **asdict(report), "exit_status": status}, indent=2))
        raise SystemExit(status)
    for line in (
        [report.ignored] * bool(report.ignored) + report.problems + [f"unfinished: {n}" for n in report.unfinished]
    ):
        click.echo(line)
    verdict = plural(len(report.problems), "problem") if report.problems else "no problems"
    click.echo(
        f"verified {plural(report.shards, 'shard')} holding {plural(report.samples, 'sample')} in {path}: {verdict}"
    )
    if report.refused:  # its words end with what to do
        click.echo(f"refused: the run {report.refused}")
    _advise(report, path)
    raise SystemExit(status)


def _advise(report, path: str) -> None:
    """What to do about what --verify found in `path`: which shards to delete, and what a re-run repairs."""
    from offline_extract.store import manifest

    # Without manifest.json nothing records the corpus, and a re-run is refused unless --force says it is the same.
    rerun = (
        "re-run the extraction"
        if report.manifest
        else f"re-run the extraction with --force and the same --data (no {manifest.MANIFEST_NAME} records its corpus)"
    )
    if report.strays:
        one = len(report.strays) == 1
        click.echo(
            f"move {', '.join(report.strays)} out of {path}: {'it is no shard' if one else 'they are none'} of the "
            "run (samples another shard holds, or not listed in its finished manifest), which no reader or run "
            "takes as they are; then verify again"
        )
    if report.damaged:
        their = "its" if len(report.damaged) == 1 else "their"
        click.echo(f"delete {', '.join(report.damaged)} and {rerun}, which redoes exactly {their} samples")
    elif report.problems and not report.strays:  # with strays, the rest may be theirs alone: verified again, it is said
        click.echo(
            "no shard is damaged: delete nothing, re-running the extraction repairs the rest"
            if report.manifest
            else f"no shard is damaged as far as can be told without checksums: delete nothing; {rerun}, which "
            f"rebuilds {manifest.MANIFEST_NAME} (checksumming the shards as they are now) and the rest"
        )
    if report.unfinished and report.running:
        click.echo(
            f"an extraction is writing {path} now ({report.running}): the shards marked unfinished are its "
            "complete ones so far; wait for it to end, then verify again"
        )
    elif report.unfinished:
        click.echo(
            "the run was interrupted: the shards marked unfinished are sound and kept (delete nothing for "
            "them); re-running the same extraction command finishes it"
        )


def _sample(path: str, sample_id: str) -> dict:
    """--sample: the sample's view; where there is none, what rejects.jsonl says of its id."""
    from offline_extract.store import inspection

    try:
        return inspection.sample_view(path, sample_id)
    except inspection.SampleNotFound as e:
        why = _left_out(Path(path), sample_id)
        raise click.ClickException(f"{e.what}; {why}" if why else str(e)) from e


def _left_out(out: Path, sample_id: str) -> str | None:
    """Why the run holds no sample of this id, where its rejects.jsonl says (rejected, skipped or dropped)."""
    from offline_extract.data.corpus import Reject
    from offline_extract.store.schema import REJECTS_FILE

    rejects = out / REJECTS_FILE
    if not rejects.is_file():
        return None
    # Our rejects are ASCII (json.dumps), so a byte that is not UTF-8 is damage, which is skipped like a line cut short.
    for line in rejects.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = Reject(**json.loads(line))
            # A record too broken to give its id (invalid JSON) is known by the id it would have had, NAME:LINE
            # (NAME the file's name, or the source as given where two shared it), and as SOURCE:LINE.
            known_as = (r.id, f"{Path(r.source).name}:{r.line}", f"{r.source}:{r.line}")
        except (ValueError, TypeError):
            # Damaged (not JSON, or not a reject's fields): not this command's to judge; the sample is still not there.
            continue
        if sample_id in known_as:
            return f"{REJECTS_FILE} lists it as {r.kind} ({r.source}:{r.line}): {r.reason}"
    return None
