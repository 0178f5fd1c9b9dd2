"""The config of an Aspis run (a coordinator-led cluster): `AspisRunConfig` and its attack section.

The presets are in `presets.py`, the run itself in `run.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...algorithms.aspis.attacks import DISTORTIONS
from ...core.errors import ConfigError
from ...runtime.aspis.roles import AspisConfig
from ...runtime.dp.peer import TrainConfig
from ...training.plugin import TaskConfig
from ..attack_axes import check_name
from ..config import KindConfig, NetworkConfig


@dataclass(frozen=True)
class AspisAttackConfig:
    """How the Byzantine workers are chosen and orchestrated, and how they distort."""

    orchestration: str = "none"  # none | att1 | att2 | att3 | majority
    distortion: str = "alie"  # alie | ipm | reversed | constant | sign_flip | random_direction
    count: int = -1  # Byzantine workers (-1: aspis.q)
    redraw_every: int = 50  # att3: T_b, iterations between fresh random Byzantine sets

    def __post_init__(self) -> None:
        check_name("attack.orchestration", self.orchestration, ("redundancy",))
        check_name("attack.distortion", self.distortion, ("gradient",), honest=False, only=DISTORTIONS)
        if self.count < -1 or self.redraw_every < 1:
            raise ConfigError("attack.count must be >= 0 (or -1 for aspis.q) and attack.redraw_every >= 1")


@dataclass(frozen=True)
class AspisRunConfig(KindConfig):
    """An Aspis run: 1 coordinator + K = peers - 1 workers for `steps` iterations."""
    KIND: ClassVar[str] = "aspis"

    preset: str = "aspis-custom"
    peers: int = 16
    steps: int = 100
    seed: int = 0
    aspis: AspisConfig = field(default_factory=AspisConfig)
    attack: AspisAttackConfig = field(default_factory=AspisAttackConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(task="digits-mlp", lr=0.05))
    task: TaskConfig = field(default_factory=TaskConfig)  # a user's task (task.factory); it needs examples(indices)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        if self.peers < 2 or self.steps < 1:
            raise ConfigError(f"peers={self.peers} must be >= 2 (a coordinator and a worker) and steps={self.steps} >= 1")
        if not self.task.enabled and not self.train.task.startswith("digits"):
            raise ConfigError(f"train.task={self.train.task!r}: Aspis runs use a digits task (digits-mlp or digits-cnn)")
        self.aspis.check_workers(self.workers)
        if self.attack.orchestration == "att2" and 2 * self.byzantine_count > self.workers:
            raise ConfigError(f"att2 needs 2q <= K: {self.byzantine_count} Byzantines and as many targets among K={self.workers}")
        if self.byzantine_count >= self.workers:
            raise ConfigError(f"attack.count={self.byzantine_count} must be < K={self.workers}")

    @property
    def workers(self) -> int:
        return self.peers - 1

    @property
    def byzantine_count(self) -> int:
        return self.aspis.q if self.attack.count < 0 else self.attack.count

