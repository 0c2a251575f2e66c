"""Imported first by every script here.

`python bin/X.py` puts bin/ at the head of sys.path, where bin/inspect.py would shadow the standard
library's `inspect` for every later import (click, torch, ...). This takes bin/ off the path again, and
puts this checkout's root in its place, so that a script runs the package beside it rather than whichever
checkout an editable install points at.

It also makes Ctrl-C before the command starts (while torch and SGLang import) end the script as an
interruption, status 130, instead of a traceback of whatever was importing; the command puts Python's
own handler back (offline_extract.cli), so that an interrupted run still cleans up.
"""
import os
import signal
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"interrupted\n")
    os._exit(128 + signal.SIGINT)


signal.signal(signal.SIGINT, _interrupted_while_starting)
