"""Small convolutional classifier for 1x8x8 digit images."""
from __future__ import annotations

from torch import Tensor, nn


class CNN(nn.Module):
    """conv3x3 -> ReLU -> conv3x3 -> ReLU -> maxpool2 -> linear -> ReLU -> linear.

    Accepts flattened [N, 64] or image-shaped [N, 1, 8, 8] input.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 64, num_classes: int = 10,
                 side: int = 8) -> None:
        super().__init__()
        c1, c2 = channels
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * (side // 2) ** 2, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(-1, 1, self.side, self.side)
        return self.classifier(self.features(x))
