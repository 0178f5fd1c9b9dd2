"""Run configuration: small per-component dataclasses composed into `RunConfig`.

Every component owns its config (TrainConfig next to the data-parallel peer,
AllReduceConfig next to butterfly all-reduce, MPRNGConfig next to MPRNG); this
module adds the run-level pieces and `override`, which applies `key=value`
strings such as `train.lr=0.05` and names the key and what is allowed when a
user gets one wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .algorithms.attacks import AttackSchedule, make_attack
from .algorithms.btard_attacks import PROTOCOL_ATTACKS, make_policy
from .attack_axes import check_name, check_params
from .core.errors import ConfigError
from .runtime.btard import SECURE_REDUCERS, BTARDConfig
from .runtime.butterfly import AllReduceConfig
from .runtime.catchup import CatchupConfig
from .runtime.checkpoint import CheckpointConfig
from .runtime.dp_peer import TrainConfig
from .runtime.mprng import MPRNGConfig
from .training.plugin import TaskConfig


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
            _check(math.isfinite(getattr(self, key)), f"network.{key}", getattr(self, key), "must be a finite number")
        _check(self.latency >= 0, "network.latency", self.latency, "must be >= 0 seconds")
        _check(self.bandwidth > 0, "network.bandwidth", self.bandwidth, "must be > 0 bytes/s")
        _check(0 <= self.loss < 1, "network.loss", self.loss, "must be in [0, 1)")
        _check(self.detection_delay >= 0, "network.detection_delay", self.detection_delay, "must be >= 0")
        _check(self.flops > 0, "network.flops", self.flops, "must be > 0")
        _check(self.flops_spread >= 0, "network.flops_spread", self.flops_spread, "must be >= 0")


@dataclass(frozen=True)
class FaultsConfig:
    """Crashes injected into a simulated run."""

    crash: int = 0  # how many peers crash
    crash_after_step: int = 0  # they crash when the first peer finishes this step
    restart_after: int = 0  # crashed peers restart (same identity, catch-up) this many steps later; 0: never
    join: int = 0  # new peers (new identities) that join the running swarm
    join_after_step: int = 0  # they join when the first peer finishes this step
    leave_rate: float = 0.0  # per step, each non-evaluating peer leaves (crashes) with this probability
    join_rate: float = 0.0  # per step, each peer that left comes back (catch-up) with this probability

    def __post_init__(self) -> None:
        for key in ("crash", "crash_after_step", "restart_after", "join", "join_after_step"):
            _check(getattr(self, key) >= 0, f"faults.{key}", getattr(self, key), "must be >= 0")
        for key in ("leave_rate", "join_rate"):
            value = getattr(self, key)
            _check(math.isfinite(value) and 0 <= value <= 1, f"faults.{key}", value, "must be a probability in [0, 1]")

    @property
    def churn(self) -> bool:
        """Whether peers join mid-run (so replicas must serve catch-up)."""
        return bool(self.restart_after or self.join or self.leave_rate or self.join_rate)


@dataclass(frozen=True)
class ByzantineConfig:
    """Peers that run the protocol and lie."""

    count: int = 0
    attack: str = "none"  # a gradient attack (phalanx.algorithms.attacks), a BTARD protocol attack, or "none"
    start_step: int = 0
    every: int = 1
    mprng: str = "honest"  # honest | withhold | wrong | split: how they behave in MPRNG rounds
    params: dict[str, float | str] = field(default_factory=dict)  # the attack's parameters: --set byzantine.params.scale=10
    joiners: int = 0  # of the faults.join new peers, how many (the first ones) run the attack too

    def __post_init__(self) -> None:
        _check(self.count >= 0, "byzantine.count", self.count, "must be >= 0")
        axis = check_name("byzantine.attack", self.attack, ("gradient", "protocol"))
        _check(self.every >= 1, "byzantine.every", self.every, "must be >= 1")
        _check(self.start_step >= 0, "byzantine.start_step", self.start_step, "must be >= 0")
        _check(self.joiners >= 0, "byzantine.joiners", self.joiners, "must be >= 0")
        schedule = AttackSchedule(self.start_step, self.every)
        build = (partial(make_attack, self.attack, schedule, **self.params) if axis == "gradient"
                 else partial(make_policy, self.attack, schedule, 0, frozenset(), **self.params))
        check_params("byzantine.params", self.params, "byzantine.attack", self.attack, build)
        _check(self.mprng in ("honest", "withhold", "wrong", "split"), "byzantine.mprng", self.mprng, "allowed: honest, withhold, wrong, split")


@dataclass(frozen=True)
class RunConfig:
    preset: str = "custom"
    peers: int = 16
    steps: int = 100
    seed: int = 0
    eval_peers: int = 2  # peers (by index) that evaluate on the held-out split
    mprng_every: int = 0  # run an MPRNG round after every k-th step (0: never)
    min_step_seconds: float = 0.0  # pace: a step lasts at least this long (wall or simulated time; 0: no pace)
    train: TrainConfig = field(default_factory=TrainConfig)
    task: TaskConfig = field(default_factory=TaskConfig)  # a user's task (task.factory); overrides train.task
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    mprng: MPRNGConfig = field(default_factory=MPRNGConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    byzantine: ByzantineConfig = field(default_factory=ByzantineConfig)
    btard: BTARDConfig = field(default_factory=BTARDConfig)
    catchup: CatchupConfig = field(default_factory=CatchupConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.btard.enabled:
            _check(self.mprng_every == 0, "mprng_every", self.mprng_every, "must be 0 with btard.enabled (BTARD runs its own MPRNG round every step)")
            _check(self.allreduce.reducer in SECURE_REDUCERS, "allreduce.reducer", self.allreduce.reducer, f"cannot be verified by BTARD; use one of {', '.join(SECURE_REDUCERS)}")
            _check(self.allreduce.topology == "butterfly", "allreduce.topology", self.allreduce.topology, "must be 'butterfly' with btard.enabled (BTARD has no trusted server)")
        elif self.byzantine.attack in PROTOCOL_ATTACKS:
            _check(False, "byzantine.attack", self.byzantine.attack, "is a BTARD protocol attack: set btard.enabled=true")
        _check(self.peers >= 1, "peers", self.peers, "must be >= 1")
        _check(self.byzantine.joiners <= self.faults.join, "byzantine.joiners", self.byzantine.joiners, f"must be <= faults.join ({self.faults.join})")
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(self.eval_peers >= 1, "eval_peers", self.eval_peers, "must be >= 1")
        _check(self.mprng_every >= 0, "mprng_every", self.mprng_every, "must be >= 0")
        _check(self.min_step_seconds >= 0, "min_step_seconds", self.min_step_seconds, "must be >= 0 seconds")
        _check(
            self.faults.crash + self.byzantine.count <= self.peers - min(self.eval_peers, self.peers),
            "faults.crash",
            self.faults.crash,
            f"plus byzantine.count ({self.byzantine.count}) must leave the {self.eval_peers} evaluating peers honest"
            f" and running (peers={self.peers})",
        )

    def to_dict(self) -> dict:
        return {"kind": "data-parallel", **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return _build(cls, without_kind(data, "data-parallel"), "")


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


def _check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {rule}")


def _build(cls: type, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix + unknown[0]!r}; allowed: {', '.join(sorted(prefix + n for n in names))}")
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        kwargs[name] = _build(kind, value, f"{prefix}{name}.") if dataclasses.is_dataclass(kind) else value
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
    return _build(type(config), data, "")


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
    return _build(type(config), base, "")


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
