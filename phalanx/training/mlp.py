"""Multi-layer perceptron classifier (default: 64 -> 128 -> 10 for 8x8 digits), cut-able into pipeline stages."""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .staging import contiguous_stages


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

    def units(self) -> list[nn.Module]:
        """The model as a flat sequence: [flatten + first layer, *hidden layers, output layer]."""
        layers = list(self.net)
        units: list[nn.Module] = [nn.Sequential(*layers[i:i + 2]) for i in range(0, len(layers) - 1, 2)]
        units.append(layers[-1])
        units[0] = nn.Sequential(nn.Flatten(1), *units[0]) if len(units) > 1 else nn.Sequential(nn.Flatten(1), units[0])
        return units

    def stages(self, k: int) -> list[nn.Module]:
        """Cut the MLP into k contiguous stages sharing its parameters; applying them in order equals forward()."""
        units = self.units()
        return contiguous_stages(units, k, f"{len(units) - 1} hidden layers")
