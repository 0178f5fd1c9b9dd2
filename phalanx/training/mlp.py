"""Multi-layer perceptron classifier (default: 64 -> 128 -> 10 for 8x8 digits)."""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Linear + ReLU hidden layers and a linear output; flattens any [N, ...] input."""

    def __init__(self, in_dim: int = 64, hidden: Sequence[int] = (128,), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))
