"""Imported first by every script here.

`python bin/X.py` puts bin/ at the head of sys.path, where bin/inspect.py would shadow the standard
library's `inspect` for every later import (click, torch, ...). This takes bin/ off the path again.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
