"""The reduction rule a partition owner applies to the parts it received.

`make_reducer` turns a rule name of `aggregators.AGGREGATORS` and a few
numbers (tau, eps, iteration cap, assumed Byzantine count f) into a function
from a stack Tensor[k, m] to Tensor[m]. Rules whose parameter depends on the
number of rows (trim, groups, Krum's f) get it from `aggregators.rule_parameters`,
clamped to what k rows allow, because an owner aggregates however many parts reached it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .aggregators import AGGREGATORS, centered_clip, rule_parameters

Reducer = Callable[[Tensor], Tensor]

REDUCERS: tuple[str, ...] = tuple(AGGREGATORS)


def make_reducer(name: str, *, tau: float = 1.0, eps: float = 1e-6, max_iters: int = 1000, f: int = 0) -> Reducer:
    """A reduction rule by name; raises ValueError naming the allowed rules."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown reducer {name!r}; choose one of {sorted(AGGREGATORS)}")
    if name == "centered_clip":
        if tau == float("inf"):
            return lambda xs: xs.mean(dim=0)  # CenteredClip with an infinite radius is the mean
        return lambda xs: centered_clip(xs.to(torch.float64), tau, eps=eps, max_iters=max_iters).to(xs.dtype)
    rule = AGGREGATORS[name]

    def reduce(xs: Tensor) -> Tensor:
        return rule(xs, **rule_parameters(name, xs.shape[0], f))

    return reduce
