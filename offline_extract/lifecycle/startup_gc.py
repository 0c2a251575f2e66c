"""Python's garbage collector while a run starts.

A full collection walks every object the process holds. While torch, transformers and SGLang import and the
model loads, that is millions of objects, none of them garbage, walked again each time their number has grown
by a quarter. Inside `start_up`, full collections are held off until `start_up_done`, called once the model is
loaded, freezes what the start-up made, so that no later collection walks it again (SGLang's servers freeze
theirs once their CUDA graphs are captured), and lets full collections run again over what the run makes; a
command that ends before (an error, Ctrl-C, a run found complete) gets its collector back as it was. The young
generations are collected throughout, so the start-up's short-lived cycles are freed as before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Above any count of younger collections a start-up reaches.
_NEVER = 1 << 30
_deferred: tuple[int, int, int] | None = None  # the thresholds to restore, while deferred


@contextmanager
def start_up() -> Iterator[None]:
    global _deferred
    if _deferred is not None:  # within another's start-up: that one restores
        yield
        return
    _deferred = gc.get_threshold()
    gc.set_threshold(_deferred[0], _deferred[1], _NEVER)
    try:
        yield
    finally:
        if _deferred is not None:
            gc.set_threshold(*_deferred)
            _deferred = None


def start_up_done() -> None:
    """Inside `start_up`: what the process holds now frozen and the thresholds restored; else nothing (a
    library's caller keeps its collector as it set it)."""
    global _deferred
    if _deferred is not None:
        gc.freeze()
        gc.set_threshold(*_deferred)
        _deferred = None
