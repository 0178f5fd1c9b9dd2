"""Config machinery shared by every run kind, and the simulated network.

Every component owns a small frozen dataclass config (TrainConfig next to the
data-parallel peer, AllReduceConfig next to butterfly all-reduce, ...); each
kind composes them into its run config (`dp/config.py`, `pipeline/config.py`,
`aspis/config.py`). This module holds what they share: `override`, which
applies `key=value` strings such as `train.lr=0.05` and names the key and what
is allowed when a user gets one wrong, `apply_file` for .toml/.json files,
the run kind a config.json names, and `check` / `build_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

from ..core.errors import ConfigError


@dataclass(frozen=True)
class NetworkConfig:
    """Simulated links and machines (ignored by real runs)."""

    latency: float = 0.005  # seconds, one way
    bandwidth: float = 125e6  # bytes per second per directed link
    loss: float = 0.0  # probability that any one message is lost
    detection_delay: float = 2.0  # seconds before a crashed peer leaves membership views
    flops: float = 50e9  # compute speed of a median peer, FLOP/s
    flops_spread: float = 0.0  # sigma of a log-normal spread of peer speeds (0: all equal)

    def __post_init__(self) -> None:
        for key in ("latency", "bandwidth", "loss", "detection_delay", "flops", "flops_spread"):
            check(math.isfinite(getattr(self, key)), f"network.{key}", getattr(self, key), "must be a finite number")
        check(self.latency >= 0, "network.latency", self.latency, "must be >= 0 seconds")
        check(self.bandwidth > 0, "network.bandwidth", self.bandwidth, "must be > 0 bytes/s")
        check(0 <= self.loss < 1, "network.loss", self.loss, "must be in [0, 1)")
        check(self.detection_delay >= 0, "network.detection_delay", self.detection_delay, "must be >= 0")
        check(self.flops > 0, "network.flops", self.flops, "must be > 0")
        check(self.flops_spread >= 0, "network.flops_spread", self.flops_spread, "must be >= 0")


class KindConfig:
    """What every run kind's config does with config.json: `to_dict` writes the kind (`KIND`) beside the fields,
    `from_dict` refuses another kind's config and rebuilds (and so validates) every section."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict:
        return {"kind": self.KIND, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Self:
        return build_config(cls, without_kind(data, cls.KIND), "")


def kind_name(data: dict) -> str:
    """The run kind a config.json names. Run directories written before configs named their kind
    hold none: data-parallel, or Aspis when they carry an `aspis` section."""
    if "kind" in data:
        return str(data["kind"])
    return "aspis" if "aspis" in data else "data-parallel"


def without_kind(data: dict, expected: str) -> dict:
    """`data` without its `kind` key; a ConfigError if it names another kind than `expected`."""
    if kind_name(data) != expected:
        raise ConfigError(f"this config is of a {kind_name(data)!r} run, not a {expected!r} run")
    return {k: v for k, v in data.items() if k != "kind"}


def check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {rule}")


def build_config(cls: type, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix + unknown[0]!r}; allowed: {', '.join(sorted(prefix + n for n in names))}")
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        kwargs[name] = build_config(kind, value, f"{prefix}{name}.") if dataclasses.is_dataclass(kind) else value
    return cls(**kwargs)


def override(config, assignments: list[str]):
    """Apply `key=value` strings (dotted keys for nested configs) to a frozen config.

    All assignments are applied first and the result is validated once, so
    their order does not matter (`byzantine.count=20 peers=40` works).
    """
    data = dataclasses.asdict(config)
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {assignment!r}")
        _assign(type(config), data, key.split("."), text, "")
    return build_config(type(config), data, "")


def apply_file(config, path: Path):
    """`config` with the values of a TOML or JSON file laid over it (sections = nested keys, e.g. [task])."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ConfigError(f"--config {path}: name a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    base = dataclasses.asdict(config)
    _merge(base, {k: v for k, v in data.items() if k != "kind"})
    return build_config(type(config), base, "")


def _merge(base: dict, data: dict) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _assign(cls: type, data: dict, path: list[str], text: str, prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    name = path[0]
    if name not in fields:
        raise ConfigError(f"unknown key {prefix + name!r}; allowed: {', '.join(prefix + f for f in fields)}")
    kind = hints[name]
    if typing.get_origin(kind) is dict:
        if len(path) != 2:
            raise ConfigError(f"{prefix + name!r} is a mapping; set one entry, e.g. {prefix + name}.scale=10")
        data[name][path[1]] = _scalar(text)
    elif dataclasses.is_dataclass(kind):
        if len(path) == 1:
            example = dataclasses.fields(kind)[0].name
            raise ConfigError(f"{prefix + name!r} is a group; set one of its keys, e.g. {prefix + name}.{example}=...")
        _assign(kind, data[name], path[1:], text, f"{prefix}{name}.")
    elif len(path) > 1:
        raise ConfigError(f"{prefix + name!r} has no sub-keys")
    else:
        data[name] = _parse(text, kind, prefix + name)


def _scalar(text: str) -> float | str | bool:
    """A mapping entry from the command line: a number, true/false, or else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _parse(text: str, kind: type, key: str):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a valid {kind.__name__}") from None
    raise ConfigError(f"{key} cannot be set from the command line")
