#!/usr/bin/env python
"""Summarize offline_extract shards: counts, run facts, per-layer statistics, or one sample's tokens."""
import _bin_path  # noqa: F401  (must come first: see its docstring)
import json

import click
from rich.console import Console

from offline_extract import inspection
from offline_extract.shards import ShardError


@click.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--sample", "sample_id", help="Show this sample's text, loss-masked tokens highlighted.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of tables.")
def main(path: str, sample_id: str | None, as_json: bool) -> None:
    """PATH is a shard file or an output directory of shards."""
    try:
        if sample_id is not None:
            result = inspection.sample_view(path, sample_id)
        else:
            result = inspection.summarize(path)
    except ShardError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif sample_id is not None:
        inspection.render_sample(result, Console())
    else:
        inspection.render_summary(result, Console())


if __name__ == "__main__":
    main()
