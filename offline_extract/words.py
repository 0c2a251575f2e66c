"""How our messages word counts and sizes: on the bottom floor, since every part of the package words its
errors and notes. Every count a message shows goes through `number` (or `plural`), every size in bytes
through `human_bytes`, so that one line does not say 20000 and the next 20,000, nor 328.6 KB and 0.000 GB."""

from __future__ import annotations


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
