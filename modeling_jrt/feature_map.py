"""The 2nd-order Taylor feature map of Based and JRT-RNN's linear attention."""

from __future__ import annotations

import math

import torch


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """2nd-order Taylor feature map (docs/reference_architecture.md §1.3): queries or keys of one head `(..., K)` ->
    `(..., 1 + K + K**2)` = `[1, x / K**0.25, vec(x x^T) / (sqrt(2) sqrt(K))]`, all ordered pairs, row-major."""
    feature_dim = x.shape[-1]
    ones = torch.ones_like(x[..., :1])
    linear = x / feature_dim**0.25
    quadratic = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (math.sqrt(2.0) * math.sqrt(feature_dim))
    return torch.cat([ones, linear, quadratic], dim=-1)


def num_taylor_features(feature_dim: int) -> int:
    """F = 1 + K + K^2, the features of the 2nd-order Taylor map of K-dimensional queries and keys."""
    return 1 + feature_dim + feature_dim**2


__all__ = ["num_taylor_features", "taylor_feature_map"]
