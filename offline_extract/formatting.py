"""How our messages word counts and sizes: on the bottom floor, since every part of the package words its
errors and notes. Every count a message shows goes through `number` (or `plural`), every size in bytes
through `human_bytes`, so that one line does not say 20000 and the next 20,000, nor 328.6 KB and 0.000 GB;
every message bound for a terminal through `for_terminal`, so that one of several hundred characters reads."""

from __future__ import annotations

import os
import re
import textwrap
from typing import TextIO

# The widest a message is laid out on a terminal: past it, the eye loses its way from one line to the next.
WIDEST = 100
_KEEP = "\x00"


def number(n: int) -> str:
    """'20,000': thousands grouped, as a count of records, samples or tokens reads at a glance."""
    return f"{n:,}"


def plural(n: int, noun: str) -> str:
    """'1 shard', '20,000 shards': counts in messages are often 1."""
    return f"{number(n)} {noun}{'' if n == 1 else 's'}"


def human_bytes(n: float) -> str:
    """'328.6 KB', '1.2 GB' (powers of 1000, as disks are sold); whole bytes below a kilobyte."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def listing(names: list[str], limit: int = 5) -> str:
    """'a, b, c and 371 more': a list that may run to thousands, kept to one short line."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {number(len(names) - limit)} more"


def for_terminal(text: str, stream: TextIO) -> str:
    """`text` as it is to be written to `stream`: on a terminal, each of its lines broken at spaces to the
    terminal's width (at most WIDEST), the rest of a line indented two past its start; elsewhere (a log, a pipe,
    a test's capture) as it is, one line a fact, as grep and the scripts reading logs expect. A word wider than
    the width (a path) is kept whole."""
    try:
        if not stream.isatty():
            return text
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):  # a stream without a descriptor of its own, or closed
        return text
    width = min(columns or WIDEST, WIDEST)  # a terminal that reports no size (0 columns) gets the widest
    return "\n".join(_broken(line, width) if len(line) > width else line for line in text.split("\n"))


def _broken(line: str, width: int) -> str:
    indent = line[: len(line) - len(line.lstrip(" "))]
    # A figure and the word after it ("0.0 s", "24 samples") stay on one row: joined by a character that
    # textwrap does not break at, put back afterwards.
    joined = re.sub(r"(?<=\d) (?=\S)", _KEEP, line)
    broken = textwrap.fill(
        joined, width, subsequent_indent=indent + "  ", break_long_words=False, break_on_hyphens=False
    )
    return broken.replace(_KEEP, " ")
