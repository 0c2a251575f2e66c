"""How our messages word counts: on the bottom floor, since every part of the package words its
errors and notes."""
from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """'1 shard', '3 shards': counts in messages are often 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def listing(names: list[str], limit: int = 5) -> str:
    """'a, b, c and 371 more': a list that may run to thousands, kept to one short line."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
