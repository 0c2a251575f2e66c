"""The consumer side: PyTorch datasets over an output directory and export to other formats."""
