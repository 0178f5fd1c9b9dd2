"""Task abstraction: model + public data + loss + evaluation, and flat-vector helpers.

The runtime and the experiment harness see training only through `Task` and
the functions here: gradients and parameters travel as flat float32 CPU vectors,
whatever device (train.device) the model computes on.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cnn import CNN
from .data import CharCorpus, batch_indices, load_digits_split
from .device import to_model
from .gpt import GPT, GPTConfig
from .mlp import MLP
from .staging import contiguous_stages


def seeded(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with the global RNG seeded to `seed`, leaving the caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


class Task(ABC):
    """What phalanx trains: a model, public batches, a loss and an evaluation.

    Write a subclass (or a factory returning one) and name it with
    `--set task.factory=package.module:function`; see examples/csv_cnn/.

    Required:
      dataset_size      number of distinct training samples (windows for LM), > 0
      build_model(seed) a freshly initialised nn.Module, identical for identical seeds
                        (build it inside `seeded(seed, ...)` so the caller's RNG is untouched)
      batch(run_seed, peer, step, batch_size) -> (x, y)
                        the public batch of `peer` at `step`: a pure function of its
                        arguments, so validators can recompute any peer's gradient;
                        draw indices with `batch_indices` and look them up (CPU tensors:
                        phalanx moves them to the model's device, train.device)
      evaluate(model)   {"loss": ..., "accuracy": ...} on a fixed held-out split; the model
                        may be on a GPU: move data with phalanx.training.to_model(model, x, y)
    Optional (defaults shown):
      name = "task", num_classes = None, tokens_per_sample = 1 (block_size for LM)
      output_loss(output, y)  mean cross-entropy of [..., classes] outputs against integer targets;
                        the pipeline kind applies it to the last stage's output at the data node
      loss(model, x, y) output_loss(model(x), y)
      examples(indices) -> (x, y)  training samples by index; the Aspis kind needs it (its files
                        are sample indices)
      stages(model, k)  k contiguous modules whose composition is model's forward; the pipeline
                        kind asks for them. Default: model.stages(k) if the model has one, an
                        nn.Sequential's children cut evenly, or a GPT-like model's
                        [embed, *blocks, head] cut evenly
    """

    name: str = "task"
    num_classes: int | None = None  # None for language modelling
    dataset_size: int  # number of distinct training samples (windows for LM)
    tokens_per_sample: int = 1  # 1 for classification, block_size for LM

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model; identical for identical seeds."""

    @abstractmethod
    def batch(self, run_seed: int, peer: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Public batch (x, y) of `peer` at `step`: a pure function of the arguments."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """{"loss", "accuracy"} on the fixed held-out split."""

    def output_loss(self, output: Tensor, y: Tensor) -> Tensor:
        """Mean cross-entropy of [..., classes] outputs against integer targets of the leading shape."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1))

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """Mean loss of the model on (x, y)."""
        return self.output_loss(model(x), y)

    def examples(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Training samples (x, y) at `indices` (any shape); needed by the Aspis kind."""
        raise NotImplementedError(f"task {self.name!r} has no examples(indices): the Aspis kind needs one")

    def stages(self, model: nn.Module, k: int) -> list[nn.Module]:
        """Cut `model` into k contiguous pipeline pieces sharing its parameters."""
        return default_stages(model, k)


def sequential_units(model: nn.Sequential) -> list[nn.Module]:
    """The children grouped so each unit holds parameters: a layer with the parameter-free ones after it.

    Leading parameter-free children (an Unflatten, say) join the first unit, so
    no pipeline stage is left without parameters to train.
    """
    def has_params(modules: list[nn.Module]) -> bool:
        return any(True for m in modules for _ in m.parameters())

    units: list[list[nn.Module]] = []
    for child in model:
        if has_params([child]) or not units:
            units.append([child])
        else:
            units[-1].append(child)
    if len(units) > 1 and not has_params(units[0]):
        units = [units[0] + units[1], *units[2:]]
    return [group[0] if len(group) == 1 else nn.Sequential(*group) for group in units]


def default_stages(model: nn.Module, k: int) -> list[nn.Module]:
    """model.stages(k), an nn.Sequential's children cut evenly, or a GPT-like [embed, *blocks, head] cut evenly.

    ValueError (saying what the pipeline kind needs) for any other model or a k
    outside [1, number of pieces].
    """
    own = getattr(model, "stages", None)
    if callable(own):
        return own(k)
    if isinstance(model, nn.Sequential):
        units = sequential_units(model)
        return contiguous_stages(units, k, f"an nn.Sequential of {len(units)} layers with parameters")
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and all(isinstance(getattr(model, a, None), nn.Module) for a in ("embed", "head")):
        units = [model.embed, *blocks, model.head]
        return contiguous_stages(units, k, f"a GPT-like model of {len(blocks)} blocks")
    raise ValueError(
        f"{type(model).__name__} cannot be cut into pipeline stages: use an nn.Sequential, a model with "
        "embed/blocks (nn.ModuleList)/head, or give the task a stages(model, k) method"
    )


class DigitsTask(Task):
    """Ten-class classification of 8x8 sklearn digits with an MLP or a CNN.

    `hidden` shapes the MLP and `channels` the CNN; each is ignored by the other.
    """

    num_classes = 10
    tokens_per_sample = 1

    def __init__(self, arch: str = "mlp", hidden: Sequence[int] = (128,),
                 channels: tuple[int, int] = (16, 32)) -> None:
        if arch not in ("mlp", "cnn"):
            raise ValueError(f"unknown digits architecture {arch!r}; allowed: 'mlp', 'cnn'")
        self.arch = arch
        self.name = f"digits-{arch}"
        self.hidden = tuple(hidden)
        self.channels = channels
        self.data = load_digits_split()
        self.dataset_size = len(self.data.y_train)

    def build_model(self, seed: int) -> nn.Module:
        if self.arch == "mlp":
            return seeded(seed, lambda: MLP(64, self.hidden, self.num_classes))
        return seeded(seed, lambda: CNN(self.channels, num_classes=self.num_classes))

    def batch(self, run_seed: int, peer: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        return self.examples(batch_indices(run_seed, peer, step, batch_size, self.dataset_size))

    def examples(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.data.x_train[indices], self.data.y_train[indices]

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return _evaluate(model, self.data.x_test, self.data.y_test)


class CharGPTTask(Task):
    """Next-character prediction on a CharCorpus with a small GPT.

    A training sample is a window of block_size characters starting at any
    position of the train split; evaluation uses `eval_windows` evenly spaced
    windows of the val split (fixed, no randomness).
    """

    num_classes = None

    def __init__(self, corpus: CharCorpus | str | Path | None = None, block_size: int = 64,
                 n_layer: int = 2, n_head: int = 2, n_embd: int = 64, eval_windows: int = 64) -> None:
        if corpus is None:
            corpus = CharCorpus.default()
        elif isinstance(corpus, (str, Path)):
            corpus = CharCorpus.from_file(corpus)  # else a CharCorpus, or a files.TokenCorpus of any tokenizer
        self.name = "chars-gpt"
        self.corpus = corpus
        self.cfg = GPTConfig(corpus.vocab_size, block_size, n_layer, n_head, n_embd)
        self.tokens_per_sample = block_size
        self.dataset_size = len(corpus.train) - block_size
        n_val_starts = len(corpus.val) - block_size
        if self.dataset_size < 1 or n_val_starts < 1:
            raise ValueError(f"corpus {corpus.name} is too small for block_size {block_size} "
                             f"(train {len(corpus.train)}, val {len(corpus.val)} characters)")
        starts = torch.linspace(0, n_val_starts - 1, min(eval_windows, n_val_starts)).long()
        self.x_val, self.y_val = self._windows(corpus.val, starts)

    def _windows(self, ids: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        offsets = starts[:, None] + torch.arange(self.cfg.block_size)
        return ids[offsets], ids[offsets + 1]

    def build_model(self, seed: int) -> nn.Module:
        return seeded(seed, lambda: GPT(self.cfg))

    def batch(self, run_seed: int, peer: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        starts = batch_indices(run_seed, peer, step, batch_size, self.dataset_size)
        return self._windows(self.corpus.train, starts)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return _evaluate(model, self.x_val, self.y_val)


def _evaluate(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """Mean loss and accuracy in one no-grad eval-mode batch; restores the model's mode."""
    was_training = model.training
    x, y = to_model(model, x, y)
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
            logits = logits.reshape(-1, logits.shape[-1])
            y = y.reshape(-1)
            loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=-1) == y).float().mean().item()
    finally:
        model.train(was_training)
    return {"loss": loss, "accuracy": accuracy}


TASKS: dict[str, Callable[..., Task]] = {
    "digits-mlp": lambda **p: DigitsTask("mlp", **p),
    "digits-cnn": lambda **p: DigitsTask("cnn", **p),
    "chars-gpt": CharGPTTask,
}


def make_task(name: str, **params) -> Task:
    """Build a task by name; keyword params go to its constructor."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(sorted(TASKS))}")
    return TASKS[name](**params)


# ---------------------------------------------------------------------------
# flat vectors: parameters and gradients in model.parameters() order


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flat_params(model: nn.Module) -> Tensor:
    """A detached float32 copy of all parameters as one 1-D CPU vector."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).cpu()


def set_flat_params(model: nn.Module, vec: Tensor) -> None:
    """Copy a flat vector (as from flat_params) into the model's parameters."""
    _check_length(model, vec)
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(vec[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def flat_grad(model: nn.Module) -> Tensor:
    """All parameter gradients as one float32 1-D CPU vector (zeros where grad is None)."""
    return torch.cat([
        (p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)).float()
        for p in model.parameters()
    ]).cpu()


def set_flat_grad(model: nn.Module, vec: Tensor) -> None:
    """Set every parameter's .grad from a flat vector (e.g. an aggregated gradient)."""
    _check_length(model, vec)
    offset = 0
    for p in model.parameters():
        p.grad = vec[offset:offset + p.numel()].detach().view_as(p).to(device=p.device, dtype=p.dtype).clone()
        offset += p.numel()


def _check_length(model: nn.Module, vec: Tensor) -> None:
    n = num_params(model)
    if vec.dim() != 1 or vec.numel() != n:
        raise ValueError(f"expected a 1-D vector of {n} elements, got shape {tuple(vec.shape)}")


def compute_gradient(task: Task, model: nn.Module, x: Tensor, y: Tensor,
                     label_map: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, float]:
    """Flat gradient (float32, contiguous, 1-D, on the CPU) of task.loss on (x, label_map(y)), and the loss.

    The batch is moved to the model's device (train.device) first.

    Clears existing gradients first and leaves the new ones in the model's .grad.
    """
    if label_map is not None:
        y = label_map(y)
    x, y = to_model(model, x, y)
    model.zero_grad(set_to_none=True)
    loss = task.loss(model, x, y)
    loss.backward()
    return flat_grad(model).contiguous(), loss.item()


def train_flops(task: Task, model: nn.Module, batch_size: int) -> float:
    """Rough forward+backward cost of one batch: 6 * params * tokens.

    The dense-layer rule of thumb: it ignores attention scores and counts conv
    weights once rather than once per position, so treat it as a relative cost.
    """
    return 6.0 * num_params(model) * batch_size * task.tokens_per_sample


def measure_float32_error(task, seed: int = 0, batch_size: int = 32, device: str = "cpu") -> float:
    """||g_float32 - g_float64|| / ||g_float64|| of one public batch's gradient on `device`: the rounding
    error of float32 backprop that the cross-device tolerance (see device.py) is derived from."""
    x, y = task.batch(seed, "float32-probe", 0, batch_size)
    model32 = task.build_model(seed).to(device)
    g32, _ = compute_gradient(task, model32, x, y)
    model64 = task.build_model(seed).double()
    x64 = x.double() if x.is_floating_point() else x
    model64.zero_grad(set_to_none=True)
    task.loss(model64, x64, y).backward()
    g64 = torch.cat([p.grad.reshape(-1) for p in model64.parameters()])
    return float((g32.double() - g64).norm() / g64.norm())
