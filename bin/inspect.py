#!/usr/bin/env python
"""`offline-extract-inspect` from this checkout; the command is offline_extract/commands/inspect.py."""

import _bin_path  # noqa: F401  (must come first: see its docstring)
from offline_extract.commands.inspect import main

if __name__ == "__main__":
    main()
