"""A small MLP (16 -> 64 -> 8) with a seeded init: the repository's cheapest real model.

It exercises batching, codecs and backends without the cost of a vision model,
and its weights come from a fixed seed, so every machine builds the same model
and tests can compare against an eager copy.
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 16
HIDDEN_FEATURES = 64
OUT_FEATURES = 8
DEFAULT_SEED = 20240601


class MLP(nn.Module):
    """Linear -> ReLU -> Linear over float32 ``[batch, 16]`` -> ``[batch, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN_FEATURES),
            nn.ReLU(),
            nn.Linear(HIDDEN_FEATURES, OUT_FEATURES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


def build_mlp(seed: int = DEFAULT_SEED) -> MLP:
    """The MLP in eval mode, initialised from ``seed`` alone."""
    # fork_rng keeps the caller's global RNG stream untouched; devices=[] skips CUDA.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP()
    return model.eval()
