"""Benchmarks of a source checkout (not installed with the package): each module is a program, run as
`python benchmarks/NAME.py` or, for extraction_vs_prefill, through bin/bench.py."""
