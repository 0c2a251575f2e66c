"""Benchmarks of a source checkout (not installed with the package): each module is a program, run as
`python benchmarks/NAME.py` or, for extraction_vs_prefill, through bin/bench.py."""

import json
import sys
from pathlib import Path

import click

# Where the programs write by default: ad-hoc runs, which git ignores. A run whose figure is published is copied
# into results/ under the naming rule of docs/architecture.md.
RUNS = Path(__file__).resolve().parent / "runs"


def program(help: str):
    """`click.command` for a benchmark program: `help` is its --help, which -h answers too."""
    return click.command(help=help, context_settings={"help_option_names": ["-h", "--help"]})


def command_line(launcher: str) -> str:
    """The command that ran this process, as a result records it: `launcher` (how the program was started,
    `python -m benchmarks.NAME`) and the options as typed."""
    return " ".join([launcher, *sys.argv[1:]])


def emit(result: dict, json_path: str | None) -> dict:
    """A CPU benchmark's result: printed, and saved beside its command when --json names a file."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    return result
