"""The pipeline runtime's own knobs (timeouts, capacity, routing), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigError

ROUTINGS = ("swarm", "swarm-paper", "gwtf")
CAPACITY_MODES = ("held", "iteration")
HANDOVERS = ("warmup", "always", "off")


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline of `stages` relay stages runs; data nodes hold stage 0 (first layers) and the loss."""

    stages: int = 2
    microbatches: int = 4  # per data node per iteration
    capacity: int = 4  # microbatches a relay holds at once (memory): used when a relay has no capacity of its own
    # held: capacity counts microbatches held at once (a slot frees at the backward; data nodes retry);
    # iteration: capacity counts microbatches admitted per iteration (GWTF's flow slots); what finds no
    # slot anywhere is deferred to the next iteration at once
    capacity_mode: str = "held"
    # swarm: stochastic wiring that skips peers which refused a microbatch, a broken backward restarts it;
    # swarm-paper: as the SWARM paper, a broken backward gets a new peer for the broken stage, and refusals
    # are not remembered (no memory awareness); gwtf: the flow algorithm
    routing: str = "swarm"
    complete_timeout: float = 5.0  # seconds to wait for COMPLETE before treating the next peer as crashed
    microbatch_timeout: float = 60.0  # a data node restarts a microbatch with no output or gradient by then
    iteration_timeout: float = 300.0  # microbatches unfinished by then are deferred to the next iteration
    aggregation_timeout: float = 30.0  # seconds to wait for BEGIN AGGREGATION and CAN TAKE
    flops_scale: float = 1.0  # charged compute = real FLOPs x this (to model larger stages in the simulator)
    ema: float = 0.3  # weight of a new latency sample in a router's moving average
    flow_period: float = 0.2  # gwtf: seconds between two rounds of the flow algorithm
    flow_warmup: float = 2.0  # gwtf: seconds the flow algorithm runs before the first iteration
    # gwtf: when a chain may change data node (FlowConfig.handover): off; always (handovers then relabel
    # chains while microbatches run on them: a round trip takes ~2 x (stages + 1) flow periods, the quiet
    # window between iterations is the aggregation, far shorter); warmup = only until the node's first
    # iteration starts: a handover needs the chain built, then pending_timeout flow periods before its unit
    # is asked about, then ~2 x (stages + 1) periods; in Table II's regime (flow_warmup = 20 periods) warmup
    # completed none in 20 runs, as off (issue-15 session 20), hence `off` by default
    flow_handover: str = "off"
    activation_bytes: int = 0  # > 0: an activation or gradient weighs this many bytes on the wire (padded)
    watch_period: float = 0.0  # > 0: every node looks this often whether a peer it passed a microbatch to left
    # (0: only when pipeline traffic wakes it, which keeps the simulator's event order of runs without churn)
    # > 0: every stage clips the gradient it steps with (the stage all-reduce's result) to this L2 norm (0: off).
    # A stage sees only its own gradient, so this is the norm per stage, not over the whole model. One
    # gradient spike (chars-gpt: x500 the usual norm in one step) otherwise fills Adam's second moment for
    # hundreds of steps and stalls that stage's learning (issue-15 session 21)
    grad_clip: float = 0.0

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
        if self.capacity_mode not in CAPACITY_MODES:
            raise ConfigError(f"pipeline.capacity_mode={self.capacity_mode!r} is not known; allowed: {', '.join(CAPACITY_MODES)}")
        if self.flow_handover not in HANDOVERS:
            raise ConfigError(f"pipeline.flow_handover={self.flow_handover!r} is not known; allowed: {', '.join(HANDOVERS)}")
        if type(self.activation_bytes) is not int or self.activation_bytes < 0:
            raise ConfigError(f"pipeline.activation_bytes={self.activation_bytes!r} must be an integer >= 0 (0: no padding)")
        if not (math.isfinite(self.watch_period) and self.watch_period >= 0):
            raise ConfigError(f"pipeline.watch_period={self.watch_period!r} must be a finite number >= 0 (0: off)")
        if not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ConfigError(f"pipeline.grad_clip={self.grad_clip!r} must be a finite number >= 0 (0: off)")
        if not (math.isfinite(self.flow_warmup) and self.flow_warmup >= 0):
            raise ConfigError(f"pipeline.flow_warmup={self.flow_warmup!r} must be a finite number >= 0")
        if not 0 < self.ema <= 1:
            raise ConfigError(f"pipeline.ema={self.ema!r} must be in (0, 1]")
