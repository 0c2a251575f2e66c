"""The package's version, on the bottom floor: the run metadata and every script's --version read it
here, and setup.cfg reads it without importing anything."""

__version__ = "0.1.0"
