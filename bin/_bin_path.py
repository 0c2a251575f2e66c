"""Imported first by every script here.

`python bin/X.py` puts bin/ at the head of sys.path, where bin/inspect.py would shadow the standard
library's `inspect` for every later import (click, torch, ...). This takes bin/ off the path again, and
puts this checkout's root in its place, so that a script runs the package beside it rather than whichever
checkout an editable install points at.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
