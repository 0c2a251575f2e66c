"""Where extraction loses time against bare prefill, read from bin/bench.py result JSONs (one GPU rank).

\b
    python benchmarks/where_lost.py RESULT.json ... [--json OUT]

Each side's wall clock (the writing rank's, from the first forward's launch to the last byte stored) is the
GPU's seconds inside forwards, its idle seconds before the first forward and between forwards, and the
seconds after the last forward: the tail, in which the last batch's states reach the host and the last shards
are written. The difference of each part between extraction and bare prefill says where extraction's extra
seconds went; prints a markdown table, and with --json writes the split with the command that made it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import command_line, program  # noqa: E402

PARTS = ("forwards", "before_first", "between", "tail")


def split(side: dict) -> dict:
    """A side's wall clock in PARTS, and what they leave unexplained (timer rounding)."""
    parts = {
        "forwards": sum(side["per_forward"]["gpu_s"]),
        "before_first": side["first_forward_s"],
        "between": side["gpu_idle_between_forwards_s"],
        "tail": side["after_last_forward_s"],
    }
    return {**parts, "wall": side["wall_s"], "unexplained": side["wall_s"] - sum(parts.values())}


def where_lost(result: dict) -> dict:
    bare, extract = split(result["bare_ranks"][0]), split(result["extract_ranks"][0])
    lost = extract["wall"] - bare["wall"]
    return {
        "extract_over_bare": result["extract_over_bare"],
        "num_tokens": result["num_tokens"],
        "num_samples": result["num_samples"],
        "out_kind": result["out_kind"],
        "store": result["store"],
        "compress": result["compress"],
        "bare": bare,
        "extract": extract,
        "lost_s": lost,
        "lost_by_part_s": {p: extract[p] - bare[p] for p in PARTS},
    }


@program(__doc__.split("\n\n")[0])
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the split here, with this command.",
)
def main(results: tuple[Path, ...], json_path: Path | None) -> None:
    runs = {p.name: where_lost(json.loads(p.read_text())) for p in results}
    click.echo("| run | extract ÷ bare | lost | in forwards | before the first | between forwards | tail |")
    click.echo("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        by = r["lost_by_part_s"]
        click.echo(
            f"| {name} | {r['extract_over_bare']:.3f} | {r['lost_s']:.3f} s | "
            + " | ".join(f"{by[p]:+.3f} s" for p in PARTS)
            + " |"
        )
    if json_path:
        command = command_line("python benchmarks/where_lost.py")
        json_path.write_text(json.dumps({"command": command, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
