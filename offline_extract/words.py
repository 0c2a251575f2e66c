"""How our messages word counts: on the bottom floor, since every part of the package words its
errors and notes."""
from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """'1 shard', '3 shards': counts in messages are often 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
