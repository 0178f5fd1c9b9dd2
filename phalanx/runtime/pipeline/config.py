"""The pipeline runtime's own knobs (timeouts, capacity, routing), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigError

ROUTINGS = ("swarm", "gwtf")


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline of `stages` relay stages runs; data nodes hold stage 0 (first layers) and the loss."""

    stages: int = 2
    microbatches: int = 4  # per data node per iteration
    capacity: int = 4  # microbatches a relay holds at once (memory): used when a relay has no capacity of its own
    routing: str = "swarm"  # swarm | gwtf
    complete_timeout: float = 5.0  # seconds to wait for COMPLETE before treating the next peer as crashed
    microbatch_timeout: float = 60.0  # a data node restarts a microbatch with no output or gradient by then
    iteration_timeout: float = 300.0  # microbatches unfinished by then are deferred to the next iteration
    aggregation_timeout: float = 30.0  # seconds to wait for BEGIN AGGREGATION and CAN TAKE
    flops_scale: float = 1.0  # charged compute = real FLOPs x this (to model larger stages in the simulator)
    ema: float = 0.3  # weight of a new latency sample in a router's moving average
    flow_period: float = 0.2  # gwtf: seconds between two rounds of the flow algorithm
    flow_warmup: float = 2.0  # gwtf: seconds the flow algorithm runs before the first iteration

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"pipeline.stages={self.stages} must be >= 1")
        if self.microbatches < 1:
            raise ConfigError(f"pipeline.microbatches={self.microbatches} must be >= 1")
        if self.capacity < 1:
            raise ConfigError(f"pipeline.capacity={self.capacity} must be >= 1")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"pipeline.routing={self.routing!r} is not known; allowed: {', '.join(ROUTINGS)}")
        for name in ("complete_timeout", "microbatch_timeout", "iteration_timeout", "aggregation_timeout", "flops_scale", "flow_period"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"pipeline.{name}={value!r} must be a finite number > 0")
        if not (math.isfinite(self.flow_warmup) and self.flow_warmup >= 0):
            raise ConfigError(f"pipeline.flow_warmup={self.flow_warmup!r} must be a finite number >= 0")
        if not 0 < self.ema <= 1:
            raise ConfigError(f"pipeline.ema={self.ema!r} must be in (0, 1]")
