"""Synthetic hidden states shaped like a transformer's residual stream, for the codec tests and the benchmarks of
the store, on CPU and GPU."""

from __future__ import annotations

import torch


def _gaussian_states(
    rows: int,
    layers: int,
    hidden: int,
    seed: int,
    outliers: int,
    outlier_scale: float,
    norm_low: float,
    norm_spread: float,
) -> torch.Tensor:
    """bf16 [rows, layers, hidden]: Gaussian, the first `outliers` channels of each layer `outlier_scale` times
    larger, each token's layer scaled by a uniform draw from [norm_low, norm_low + norm_spread)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layers, hidden, generator=g)
    x[:, :, :outliers] *= outlier_scale
    x *= torch.rand(rows, layers, 1, generator=g) * norm_spread + norm_low
    return x.bfloat16()


def residual_like(rows: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, layers * hidden]: Gaussian, with a few large outlier channels per layer and tokens of very
    different norms, which is what makes per-token, per-layer fp8 scales matter."""
    return _gaussian_states(
        rows, layers, hidden, seed, outliers=3, outlier_scale=80, norm_low=0.1, norm_spread=10
    ).reshape(rows, layers * hidden)


def activation_like(rows: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, layers, hidden]: Gaussian, 8 channels 30 times larger, token norms within 0.5-4.5x: milder
    than `residual_like`, the states the store's benchmarks (writer throughput, zstd parameters, export sizes)
    measured their committed results on."""
    return _gaussian_states(rows, layers, hidden, seed, outliers=8, outlier_scale=30, norm_low=0.5, norm_spread=4)
