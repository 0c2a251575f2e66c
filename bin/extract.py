#!/usr/bin/env python
"""`offline-extract` from this checkout; the command is offline_extract/commands/extract.py."""

import _bin_path  # noqa: F401  (must come first: see its docstring)
from offline_extract.commands.extract import main

if __name__ == "__main__":
    main()
