"""Synthetic hidden states shaped like a transformer's residual stream, for the codec tests on CPU and GPU."""
from __future__ import annotations

import torch


def residual_like(rows: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, layers * hidden]: Gaussian, with a few large outlier channels per layer and tokens of very
    different norms, which is what makes per-token, per-layer fp8 scales matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layers, hidden, generator=g)
    x[:, :, :3] *= 80
    x *= torch.rand(rows, layers, 1, generator=g) * 10 + 0.1
    return x.reshape(rows, layers * hidden).bfloat16()
