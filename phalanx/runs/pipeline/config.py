"""Run configuration of a pipeline-parallel run (data nodes + relay stages), composed like `RunConfig`.

`peers` counts data nodes and relays; relay r (0-based) starts in stage
1 + r mod stages. Relay capacities are `pipeline.capacity` for all, or drawn
from [capacity_min, capacity_max] per relay (heterogeneous, GWTF's 1-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from ...algorithms.btard.attacks import ProtocolPolicy, make_policy
from ...algorithms.robust.attacks import AttackSchedule
from ...algorithms.sentinel.attacks import TARGETS, LinkAttack, make_link_attack
from ...runtime.dp.peer import TrainConfig
from ...runtime.pipeline.config import PipelineConfig
from ...runtime.pipeline.verifier import VerifierConfig
from ...runtime.rounds.btard_state import SECURE_REDUCERS, BTARDConfig
from ...runtime.rounds.butterfly import AllReduceConfig
from ...training.plugin import TaskConfig
from ..attack_axes import check_name, check_params
from ..config import KindConfig, check


@dataclass(frozen=True)
class PipelineNetworkConfig:
    """Simulated links and machines of a pipeline run: each directed link draws its bandwidth in [min, max]."""

    latency: float = 0.005  # seconds, one way
    bandwidth_min: float = 125e6  # bytes per second
    bandwidth_max: float = 125e6
    loss: float = 0.0
    detection_delay: float = 2.0
    flops: float = 50e9  # median relay speed, FLOP/s
    flops_spread: float = 0.0  # sigma of a log-normal spread of speeds

    def __post_init__(self) -> None:
        for key in ("latency", "bandwidth_min", "bandwidth_max", "loss", "detection_delay", "flops", "flops_spread"):
            check(math.isfinite(getattr(self, key)), f"network.{key}", getattr(self, key), "must be a finite number")
        check(self.latency >= 0, "network.latency", self.latency, "must be >= 0 seconds")
        check(self.bandwidth_min > 0, "network.bandwidth_min", self.bandwidth_min, "must be > 0 bytes/s")
        check(self.bandwidth_max >= self.bandwidth_min, "network.bandwidth_max", self.bandwidth_max, "must be >= network.bandwidth_min")
        check(0 <= self.loss < 1, "network.loss", self.loss, "must be in [0, 1)")
        check(self.detection_delay >= 0, "network.detection_delay", self.detection_delay, "must be >= 0")
        check(self.flops > 0, "network.flops", self.flops, "must be > 0")
        check(self.flops_spread >= 0, "network.flops_spread", self.flops_spread, "must be >= 0")


@dataclass(frozen=True)
class ChurnConfig:
    """Relays leaving and joining, per relay and iteration (GWTF's join-leave chance)."""

    leave_rate: float = 0.0  # chance that a live relay crashes during an iteration
    join_rate: float = 0.0  # chance that a crashed relay comes back (as a joiner) at an iteration's start
    leave_span: float = 0.0  # a leave falls uniformly within this many seconds after its iteration opens (0: within
    # the last iteration's duration, the run's own pace); set, two runs of a seed at different speeds share the moment
    crash_relay: int = -1  # crash this relay (index among relays) once ...
    crash_at: float = 0.0  # ... at this many seconds into iteration `crash_iteration`
    crash_iteration: int = 0
    crash_stage: int = 0  # > 0: instead, crash the first relay of this stage to finish a forward in
    # iteration `crash_iteration`, `crash_at` seconds after that forward
    crash_after: str = "fwd"  # crash_stage's trigger: the first forward (fwd) or backward (bwd) of that stage
    crash_data_node: int = -1  # crash this data node (index) at `crash_at` seconds into `crash_iteration`
    rejoin_after: int = 0  # launch only: this many iterations after the kill, a fresh relay process joins (0: none)
    stage_floor: int = 0  # churn leaves a stage at least this many unbanned live replicas (0: 2 under BTARD per stage, else 1)
    stay: str = ""  # comma-separated relay indices churn never takes (an attacker that wants to stay): their
    # leave is dropped (each relay draws from a stream of its own: the others draw as in any run)

    def __post_init__(self) -> None:
        check(0 <= self.leave_rate <= 1, "faults.leave_rate", self.leave_rate, "must be a probability in [0, 1]")
        check(0 <= self.join_rate <= 1, "faults.join_rate", self.join_rate, "must be a probability in [0, 1]")
        check(self.leave_span >= 0, "faults.leave_span", self.leave_span, "must be >= 0 seconds (0: the last iteration's duration)")
        check(self.stage_floor >= 0, "faults.stage_floor", self.stage_floor, "must be >= 0 (0: 2 under BTARD per stage, else 1)")
        check(self.crash_relay >= -1, "faults.crash_relay", self.crash_relay, "must be a relay index or -1 (none)")
        check(self.crash_at >= 0, "faults.crash_at", self.crash_at, "must be >= 0 seconds")
        check(self.crash_iteration >= 0, "faults.crash_iteration", self.crash_iteration, "must be >= 0")
        check(self.rejoin_after >= 0, "faults.rejoin_after", self.rejoin_after, "must be >= 0 (0: no joiner)")
        check(self.crash_stage >= 0, "faults.crash_stage", self.crash_stage, "must be >= 0 (0: use faults.crash_relay)")
        check(self.crash_after in ("fwd", "bwd"), "faults.crash_after", self.crash_after, "must be fwd or bwd")
        try:
            indices = self.staying
        except ValueError:
            indices = [-1]
        check(all(i >= 0 for i in indices), "faults.stay", self.stay,
              "must be comma-separated relay indices >= 0, e.g. faults.stay=0,4")

    @property
    def staying(self) -> list[int]:
        return sorted({int(part) for part in str(self.stay).split(",") if part.strip()})


@dataclass(frozen=True)
class LinkAttackConfig:
    """Malicious relays (SENTINEL's threat model): which relays lie on their links, how and from when."""

    name: str = "none"  # a link attack of algorithms.sentinel.attacks (zeros, random, scaling, sign_flip, delay, ...)
    relays: str = ""  # comma-separated relay indices (relay r starts in stage 1 + r mod pipeline.stages)
    target: str = "both"  # activations, gradients, both (the links) or aggregation (its stage all-reduce vector)
    start: int = 0  # first attacked iteration
    fraction: float = 1.0  # of the relay's microbatches attacked
    delay: int = 20  # delay attack only: iterations by which the replayed tensors are stale
    factor: float = -1.0  # scaling attack only: what the relay multiplies its honest tensor by
    lead: int = 1  # target weights only: the relay claims to hold this many versions more than it has

    def __post_init__(self) -> None:
        check(self.delay >= 1, "attack.delay", self.delay, "must be an iteration count >= 1")
        check_name("attack.name", self.name, ("link",))
        check(self.target in TARGETS, "attack.target", self.target, f"must be one of {', '.join(TARGETS)}")
        check(self.start >= 0, "attack.start", self.start, "must be an iteration >= 0")
        check(0 <= self.fraction <= 1, "attack.fraction", self.fraction, "must be in [0, 1]")
        check(math.isfinite(self.factor), "attack.factor", self.factor, "must be a finite number")
        check(type(self.lead) is int and self.lead >= 0, "attack.lead", self.lead, "must be an integer >= 0 (versions)")
        try:
            indices = self.indices
        except ValueError:
            indices = [-1]
        check(all(i >= 0 for i in indices), "attack.relays", self.relays,
               "must be comma-separated relay indices >= 0, e.g. attack.relays=0,3")
        check_params("attack", {"target": self.target, "start": self.start, "fraction": self.fraction, "delay": self.delay},
                     "attack.name", self.name, partial(self.policy, 0, "config-check"))

    @property
    def indices(self) -> list[int]:
        return sorted({int(part) for part in str(self.relays).split(",") if part.strip()})

    def policy(self, seed: int, worker: str) -> LinkAttack:
        """The `LinkAttack` a malicious relay runs."""
        extra = {"delay": self.delay} if self.name == "delay" else {"factor": self.factor} if self.name == "scaling" else {}
        return make_link_attack(self.name, target=self.target, start_step=self.start, fraction=self.fraction,
                                seed=seed, worker=worker, **extra)


@dataclass(frozen=True)
class StageByzantineConfig:
    """Relays that lie in their stage's BTARD round (btard.enabled): a protocol attack of the catalogue."""

    attack: str = "none"  # a BTARD protocol attack (phalanx.algorithms.btard.attacks), e.g. agg_shift
    relays: str = ""  # comma-separated relay indices (relay r starts in stage 1 + r mod pipeline.stages)
    start_step: int = 0  # first attacked iteration
    every: int = 1
    params: dict[str, float | str] = field(default_factory=dict)  # the attack's parameters: --set byzantine.params.scale=10

    def __post_init__(self) -> None:
        check_name("byzantine.attack", self.attack, ("protocol",))
        check(self.start_step >= 0, "byzantine.start_step", self.start_step, "must be an iteration >= 0")
        check(self.every >= 1, "byzantine.every", self.every, "must be >= 1")
        try:
            indices = self.indices
        except ValueError:
            indices = [-1]
        check(all(i >= 0 for i in indices), "byzantine.relays", self.relays,
               "must be comma-separated relay indices >= 0, e.g. byzantine.relays=0,3")
        check_params("byzantine.params", self.params, "byzantine.attack", self.attack,
                     partial(make_policy, self.attack, AttackSchedule(self.start_step, self.every), 0, frozenset(), **self.params))

    @property
    def indices(self) -> list[int]:
        return sorted({int(part) for part in str(self.relays).split(",") if part.strip()})

    def policy(self, seed: int, colluders: frozenset[str]) -> ProtocolPolicy:
        """The `ProtocolPolicy` a lying replica runs in its stage rounds (its colluders: every listed relay)."""
        return make_policy(self.attack, AttackSchedule(self.start_step, self.every), seed, colluders, **self.params)


@dataclass(frozen=True)
class PipelineRunConfig(KindConfig):
    KIND: ClassVar[str] = "pipeline"
    preset: str = "custom-pipeline"
    peers: int = 7  # data nodes + relays
    data_nodes: int = 1
    steps: int = 20  # iterations
    seed: int = 0
    capacity_min: int = 0  # 0: every relay has pipeline.capacity
    capacity_max: int = 0
    train: TrainConfig = field(default_factory=lambda: TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=8))
    task: TaskConfig = field(default_factory=TaskConfig)  # a user's task (task.factory); overrides train.task
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    network: PipelineNetworkConfig = field(default_factory=PipelineNetworkConfig)
    faults: ChurnConfig = field(default_factory=ChurnConfig)
    sentinel: VerifierConfig = field(default_factory=VerifierConfig)
    attack: LinkAttackConfig = field(default_factory=LinkAttackConfig)
    # BTARD per relay stage; validators > 0: validators recompute stage gradients from committed, sealed inputs
    btard: BTARDConfig = field(default_factory=lambda: BTARDConfig(validators=0))
    byzantine: StageByzantineConfig = field(default_factory=StageByzantineConfig)

    def __post_init__(self) -> None:
        check(self.data_nodes >= 1, "data_nodes", self.data_nodes, "must be >= 1")
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(
            self.peers >= self.data_nodes + self.pipeline.stages, "peers", self.peers,
            f"must be at least data_nodes + pipeline.stages = {self.data_nodes + self.pipeline.stages} (one relay per stage)",
        )
        check(self.capacity_min >= 0, "capacity_min", self.capacity_min, "must be >= 0")
        check(self.capacity_max >= self.capacity_min, "capacity_max", self.capacity_max, "must be >= capacity_min")
        check(
            self.faults.crash_data_node < self.data_nodes - 1, "faults.crash_data_node", self.faults.crash_data_node,
            f"must be -1 or a data node index below {self.data_nodes - 1} (one data node must survive)",
        )
        check(
            self.faults.crash_relay < self.relays, "faults.crash_relay", self.faults.crash_relay,
            f"must be below the number of relays ({self.relays})",
        )
        check(all(i < self.relays for i in self.attack.indices), "attack.relays", self.attack.relays,
               f"must list relay indices below the number of relays ({self.relays})")
        if self.btard.enabled:
            check(self.allreduce.reducer in SECURE_REDUCERS, "allreduce.reducer", self.allreduce.reducer,
                   f"cannot be verified by BTARD; use one of {', '.join(SECURE_REDUCERS)} with btard.enabled")
        check(self.byzantine.attack == "none" or self.btard.enabled, "byzantine.attack", self.byzantine.attack,
               "is a BTARD protocol attack on the stage all-reduce: set btard.enabled=true")
        check(all(i < self.relays for i in self.byzantine.indices), "byzantine.relays", self.byzantine.relays,
               f"must list relay indices below the number of relays ({self.relays})")
        check(all(i < self.relays for i in self.faults.staying), "faults.stay", self.faults.stay,
               f"must list relay indices below the number of relays ({self.relays})")
        check(
            not (self.sentinel.enabled and self.sentinel.placement == "data_node" and self.pipeline.routing != "swarm"),
            "sentinel.placement", self.sentinel.placement,
            "data_node (client-routed) needs pipeline.routing=swarm; use sentinel.placement=boundary with gwtf",
        )

    @property
    def relays(self) -> int:
        return self.peers - self.data_nodes

    def stage_of(self, index: int) -> int:
        """The initial stage of peer `index` (data nodes are stage 0)."""
        return 0 if index < self.data_nodes else 1 + (index - self.data_nodes) % self.pipeline.stages

