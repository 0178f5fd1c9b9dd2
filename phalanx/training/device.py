"""Where training runs (train.device: auto, cpu, cuda) and what that does to verification tolerances.

Everything that leaves a peer (gradients, parameters, activations, digests)
is a CPU float32 tensor, whatever device computed it: the wire format and the
checks do not change. On CUDA, TF32 is switched off (`strict_float32`), so a
GPU computes in true float32 and differs from a CPU only in the order of its
float32 sums.

Cross-device tolerance (BTARD validation, `algorithms.btard.checks.GRAD_RTOL`).
A validator on a CPU may recompute the gradient that a peer computed on a GPU.
Both are float32 evaluations of the same exact gradient g; each differs from
g by rounding alone, so ||g_gpu - g_cpu|| <= ||g_gpu - g|| + ||g_cpu - g||. A
float32 sum of K terms in any order carries a relative error of at most
K u (u = 2^-24 = 6e-8) in the worst case and about sqrt(K) u when the
rounding errors are independent, as they are for kernels that block their
sums differently. Backprop through L layers compounds this about L times, and
the norm-wise comparison is dominated by the largest gradient entries, whose
relative error is the typical one. So, for each device,
    ||g_dev - g|| / ||g||  ~  c * L * sqrt(K) * u,
with K the longest reduction (batch x tokens for weight gradients, or a layer
width) and c a small constant for the kernels' extra operations (c <= 4 here).
For the shipped tasks at 16 samples per batch (L <= 6, K <= 1024: 16 x 64
tokens) that is at most 4 * 6 * 32 * 6e-8 = 4.6e-5 per device, 9.3e-5 for the
pair, inside GRAD_RTOL = 1e-4; measured errors are 300x smaller still
(`task.measure_float32_error`, printed by tests/test_device.py: float32-vs-float64
gaps of 1e-7..2e-7 on the digits MLP and CNN and the chars GPT), so a
GPU-vs-CPU pair sits about 100x inside the tolerance, while a lie must still
move the gradient by 1e-4 relative to pass. Larger batches or deeper user
models grow the estimate as L sqrt(K): at 32 x 64 tokens the GPT's outside
estimate (6.5e-5 per device) already exceeds half of GRAD_RTOL, and only the
measured margin keeps it safe; such runs should measure their own gap.
With TF32 left on, u would be 2^-11 = 4.9e-4 and no tolerance below 1e-2
would be safe: that is why strict_float32 is not optional.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def resolve_device(name: str) -> torch.device:
    """The torch device train.device names: auto picks cuda when one is visible, else cpu."""
    if name not in DEVICES:
        raise ConfigError(f"train.device={name!r} is not known; allowed: {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device here; use train.device=cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    strict_float32()
    return torch.device("cuda")


def strict_float32() -> None:
    """True float32 matmuls and convolutions on CUDA (no TF32), so tolerances derived for float32 hold."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device_of(model: nn.Module) -> torch.device:
    """The device of a model's parameters (cpu for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def to_model(model: nn.Module, *tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors` moved to the model's device (a no-op on CPU)."""
    device = device_of(model)
    return tuple(t.to(device) for t in tensors)


class OnDevice(nn.Module):
    """A pipeline piece whose parameters live on `device` while its inputs and outputs stay on the CPU.

    The moves are differentiable, so autograd carries gradients across them.
    """

    def __init__(self, part: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.part = part.to(device)
        self.device = device

    def forward(self, x: Tensor) -> Tensor:
        return self.part(x.to(self.device)).cpu()
