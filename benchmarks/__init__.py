"""Benchmarks of a source checkout (not installed with the package): each module is a program, run as
`python benchmarks/NAME.py` or, for extraction_vs_prefill, through bin/bench.py."""

import json
from pathlib import Path


def emit(result: dict, json_path: str | None) -> dict:
    """A CPU benchmark's result: printed, and saved beside its command when --json names a file."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    return result
