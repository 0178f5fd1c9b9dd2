"""A user's own task, named by `task.factory=package.module:function`, loaded and checked once per process.

The factory is imported from the current directory or PYTHONPATH and called with
`task.params` as keyword arguments; what it returns must satisfy the `Task`
interface (task.py). Each way of getting it wrong is a one-line ConfigError
that names the problem: a bad path, a missing method or attribute, a model that
is not an nn.Module, a batch that is not (x, y), and batches that are not a
pure function of (seed, peer, step), found by drawing the same batch twice.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from .task import Task

REQUIRED_METHODS = ("build_model", "batch", "loss", "evaluate")
PROBE_PEER = "phalanx-probe"  # the peer id whose batch is drawn twice by the purity check


@dataclass(frozen=True)
class TaskConfig:
    """A plug-in task: `factory` ("package.module:function", "" = train.task) called with `params`."""

    factory: str = ""
    params: dict[str, float | str | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.factory:
            module, sep, attr = self.factory.partition(":")
            if not sep or not module or not attr:
                raise ConfigError(f"task.factory={self.factory!r} must read package.module:function")
        elif self.params:
            raise ConfigError(f"task.params={self.params!r} are given but task.factory is empty: set task.factory too")

    @property
    def enabled(self) -> bool:
        return bool(self.factory)


def load_task(config: TaskConfig) -> Task:
    """The checked task the factory returns (cached per factory and params in this process)."""
    return _load(config.factory, json.dumps(config.params, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _load(factory: str, params_json: str) -> Task:
    task = _call(_resolve(factory), factory, json.loads(params_json))
    check_task(task, factory)
    return task


def _resolve(factory: str):
    module_name, _, attr = factory.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `phalanx` as a console script: let a module in the current directory load
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"task.factory={factory!r}: cannot import {module_name!r} ({exc}); "
                          "run from its directory or put it on PYTHONPATH") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"task.factory={factory!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"task.factory={factory!r} names a {type(target).__name__}, not a function or class")
    return target


def _call(fn, factory: str, params: dict) -> Task:
    try:
        return fn(**params)
    except TypeError as exc:
        raise ConfigError(f"task.factory={factory!r} does not accept task.params={params!r}: {exc}") from None


def check_task(task: object, factory: str) -> None:
    """Raise a one-line ConfigError unless `task` keeps the Task interface and draws pure batches."""
    where = f"task.factory={factory!r} returned a {type(task).__name__} that"
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)} method (see phalanx.training.Task)")
    size = getattr(task, "dataset_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"{where} has dataset_size={size!r}; it must be the number of training samples, an int >= 1")
    model = task.build_model(0)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where} builds a {type(model).__name__} in build_model(seed), not a torch.nn.Module")
    first = _batch(task, where)
    again = _batch(task, where)
    if not all(torch.equal(a, b) for a, b in zip(first, again)):
        raise ConfigError(f"{where} draws batches that are not a pure function of (seed, peer, step): "
                          f"batch(0, {PROBE_PEER!r}, 0, 4) differed between two calls; index data with batch_indices(...)")
    loss = task.loss(model, *first)
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and math.isfinite(float(loss.detach()))):
        raise ConfigError(f"{where} returns {loss!r} from loss(model, x, y); it must be a finite scalar tensor")
    metrics = task.evaluate(model)
    if not (isinstance(metrics, dict) and "loss" in metrics):
        raise ConfigError(f"{where} returns {metrics!r} from evaluate(model); it must be a dict with 'loss' (and 'accuracy')")


def _batch(task, where: str) -> tuple[Tensor, Tensor]:
    out = task.batch(0, PROBE_PEER, 0, 4)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
        raise ConfigError(f"{where} returns {type(out).__name__} from batch(seed, peer, step, batch_size); it must be a tuple (x, y) of tensors")
    return out
