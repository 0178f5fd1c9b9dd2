"""The config of a data-parallel run (butterfly all-reduce, BTARD): `RunConfig` and its run-level sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from ...algorithms.btard.attacks import PROTOCOL_ATTACKS, make_policy
from ...algorithms.robust.attacks import AttackSchedule, make_attack
from ...runtime.dp.catchup import CatchupConfig
from ...runtime.dp.checkpoint import CheckpointConfig
from ...runtime.dp.peer import TrainConfig
from ...runtime.rounds.btard_state import SECURE_REDUCERS, BTARDConfig
from ...runtime.rounds.butterfly import AllReduceConfig
from ...runtime.rounds.mprng import MPRNGConfig
from ...training.plugin import TaskConfig
from ..attack_axes import check_name, check_params
from ..config import KindConfig, NetworkConfig, check


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
            check(getattr(self, key) >= 0, f"faults.{key}", getattr(self, key), "must be >= 0")
        for key in ("leave_rate", "join_rate"):
            value = getattr(self, key)
            check(math.isfinite(value) and 0 <= value <= 1, f"faults.{key}", value, "must be a probability in [0, 1]")

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
        check(self.count >= 0, "byzantine.count", self.count, "must be >= 0")
        axis = check_name("byzantine.attack", self.attack, ("gradient", "protocol"))
        check(self.every >= 1, "byzantine.every", self.every, "must be >= 1")
        check(self.start_step >= 0, "byzantine.start_step", self.start_step, "must be >= 0")
        check(self.joiners >= 0, "byzantine.joiners", self.joiners, "must be >= 0")
        schedule = AttackSchedule(self.start_step, self.every)
        build = (partial(make_attack, self.attack, schedule, **self.params) if axis == "gradient"
                 else partial(make_policy, self.attack, schedule, 0, frozenset(), **self.params))
        check_params("byzantine.params", self.params, "byzantine.attack", self.attack, build)
        check(self.mprng in ("honest", "withhold", "wrong", "split"), "byzantine.mprng", self.mprng, "allowed: honest, withhold, wrong, split")


@dataclass(frozen=True)
class RunConfig(KindConfig):
    KIND: ClassVar[str] = "data-parallel"
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
            check(self.mprng_every == 0, "mprng_every", self.mprng_every, "must be 0 with btard.enabled (BTARD runs its own MPRNG round every step)")
            check(self.allreduce.reducer in SECURE_REDUCERS, "allreduce.reducer", self.allreduce.reducer, f"cannot be verified by BTARD; use one of {', '.join(SECURE_REDUCERS)}")
            check(self.allreduce.topology == "butterfly", "allreduce.topology", self.allreduce.topology, "must be 'butterfly' with btard.enabled (BTARD has no trusted server)")
        elif self.byzantine.attack in PROTOCOL_ATTACKS:
            check(False, "byzantine.attack", self.byzantine.attack, "is a BTARD protocol attack: set btard.enabled=true")
        check(self.peers >= 1, "peers", self.peers, "must be >= 1")
        check(self.byzantine.joiners <= self.faults.join, "byzantine.joiners", self.byzantine.joiners, f"must be <= faults.join ({self.faults.join})")
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(self.eval_peers >= 1, "eval_peers", self.eval_peers, "must be >= 1")
        check(self.mprng_every >= 0, "mprng_every", self.mprng_every, "must be >= 0")
        check(self.min_step_seconds >= 0, "min_step_seconds", self.min_step_seconds, "must be >= 0 seconds")
        check(
            self.faults.crash + self.byzantine.count <= self.peers - min(self.eval_peers, self.peers),
            "faults.crash",
            self.faults.crash,
            f"plus byzantine.count ({self.byzantine.count}) must leave the {self.eval_peers} evaluating peers honest"
            f" and running (peers={self.peers})",
        )

