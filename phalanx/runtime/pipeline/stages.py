"""A task's model cut into the pieces a pipeline serves, with the shapes and costs at every boundary.

Part 0 belongs to the data nodes (embedding or first layer); parts 1..S to the
relay stages; the loss (the task's output_loss on the last part's output) is
computed back at the data node. Every node builds the parts from the run seed,
so all replicas of a stage start identical.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...core.errors import ConfigError
from ...training.device import OnDevice, resolve_device
from ...training.task import Task, num_params


class StagedModel:
    """The S+1 parts of a task's model and the activation shape after each part."""

    def __init__(self, task: Task, seed: int, stages: int, batch_size: int, device: str = "cpu") -> None:
        model = task.build_model(seed)
        try:
            self.parts: list[nn.Module] = list(task.stages(model, stages + 1))
        except ValueError as exc:
            raise ConfigError(f"pipeline.stages={stages} needs {stages + 1} pieces of {task.name}: {exc}") from None
        if len(self.parts) != stages + 1:
            raise ConfigError(f"task {task.name!r} returned {len(self.parts)} pieces from stages(model, {stages + 1})")
        self.stages = stages
        x, _ = task.batch(seed, "shape-probe", 0, batch_size)
        shapes = []
        model.eval()  # dropout off while the composition is compared with forward
        with torch.no_grad():
            h = x
            for part in self.parts:
                h = part(h)
                shapes.append(tuple(h.shape))
            if not torch.allclose(h, model(x), rtol=1e-4, atol=1e-5):
                raise ConfigError(f"task {task.name!r}: its {stages + 1} stages applied in order differ from the model's "
                                  "forward; give the task a stages(model, k) method that cuts it faithfully")
        model.train()
        self.out_shapes = shapes  # out_shapes[s]: shape of part s's output (part s+1's input)
        where = resolve_device(device)
        if where.type != "cpu":  # parameters on the device; activations in and out stay CPU float32
            self.parts = [OnDevice(part, where) for part in self.parts]
        tokens = batch_size * task.tokens_per_sample
        self.forward_flops = [2.0 * num_params(p) * tokens for p in self.parts]

    def input_shape(self, stage: int) -> tuple[int, ...]:
        """Shape of the activation that stage `stage` (>= 1) receives; stage S+1 is the loss."""
        return self.out_shapes[stage - 1]


def flat(tensors: list[Tensor | None], params: list[nn.Parameter]) -> Tensor:
    """Gradients (None = zero) as one float32 CPU vector in parameter order."""
    return torch.cat([
        (g.reshape(-1) if g is not None else torch.zeros(p.numel(), device=p.device)).float() for g, p in zip(tensors, params)
    ]).cpu()


def contribution(total: torch.Tensor, work: int, replicas: int) -> torch.Tensor:
    """One replica's vector for the stage all-reduce: `replicas * total / work`.

    `total` sums the replica's gradients of the c finished microbatches it served, so this is its
    mean gradient times its share `replicas * c / work` of the `work` microbatches the group served.
    The mean of the group's vectors is then the mean gradient over all `work` microbatches (what
    [sum, count] gave before), and a replica that served nothing sends zeros; with balanced routing
    every honest vector is about one mean gradient, which is what a robust rule compares.
    """
    if work == 0:
        return torch.zeros_like(total)
    return total * (replicas / work)


def clipped(vector: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`vector` scaled down to L2 norm `max_norm` when it is longer (`max_norm` 0: unchanged), as
    torch.nn.utils.clip_grad_norm_ scales a stage's gradients."""
    if max_norm <= 0:
        return vector
    scale = max_norm / (float(vector.norm()) + 1e-6)
    return vector * scale if scale < 1 else vector
