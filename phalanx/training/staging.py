"""Cutting a model's units into contiguous pipeline stages (used by MLP.stages and GPT.stages)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def contiguous_stages(units: Sequence[nn.Module], k: int, what: str) -> list[nn.Module]:
    """Split `units` into k contiguous stages, as even as possible, earlier stages taking the remainder.

    The stages share the units' parameters. `what` names the model's size in the
    error raised when k is outside [1, len(units)].
    """
    if not 1 <= k <= len(units):
        raise ValueError(f"k must be in [1, {len(units)}] for {what}, got {k}")
    size, extra = divmod(len(units), k)
    stages, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        stages.append(nn.Sequential(*units[start:end]))
        start = end
    return stages
