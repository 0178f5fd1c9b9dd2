"""A small CNN on a CSV of pixel values, as a phalanx plug-in task.

    phalanx simulate btard-digits --set task.factory=pixel_task:make_task --set task.params.path=pixels.csv

The CSV has a `label` column and `side * side` pixel columns. The last
`test_fraction` of the rows is the held-out split; every training batch is
drawn by index from (run seed, peer, step), so validators can recompute it.
"""
import csv

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.training import Task, batch_indices, seeded, to_model


class PixelCNNTask(Task):
    def __init__(self, path: str, side: int = 8, max_pixel: float = 16.0, test_fraction: float = 0.2) -> None:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        labels = torch.tensor([int(row["label"]) for row in rows])
        pixels = torch.tensor([[float(v) for k, v in row.items() if k != "label"] for row in rows]) / max_pixel
        n_test = int(len(rows) * test_fraction)
        self.x_train, self.y_train = pixels[:-n_test], labels[:-n_test]
        self.x_test, self.y_test = pixels[-n_test:], labels[-n_test:]
        self.side = side
        self.name = "pixel-cnn"
        self.num_classes = int(labels.max()) + 1
        self.dataset_size = len(self.y_train)

    def build_model(self, seed: int) -> nn.Module:
        side, classes = self.side, self.num_classes
        return seeded(seed, lambda: nn.Sequential(
            nn.Unflatten(1, (1, side, side)),
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(16 * (side // 2) ** 2, 32), nn.ReLU(),
            nn.Linear(32, classes),
        ))

    def examples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x_train[indices], self.y_train[indices]

    def batch(self, run_seed: int, peer: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.examples(batch_indices(run_seed, peer, step, batch_size, self.dataset_size))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x, y = to_model(model, self.x_test, self.y_test)  # the model may be on a GPU (train.device)
        model.eval()
        with torch.no_grad():
            logits = model(x)
        model.train()
        return {"loss": F.cross_entropy(logits, y).item(), "accuracy": (logits.argmax(1) == y).float().mean().item()}


def make_task(path: str = "pixels.csv", side: int = 8) -> PixelCNNTask:
    return PixelCNNTask(path, side=int(side))
