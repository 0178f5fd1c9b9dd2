"""The flow algorithm's knobs (GWTF Sec. V-C's T and alpha, and this implementation's round counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigError


@dataclass(frozen=True)
class FlowConfig:
    """Knobs of the flow algorithm; the defaults are the paper's T and alpha."""

    temperature: float = 1.7
    cooling: float = 0.95
    objective: str = "sum"  # "sum" of f*d (Eq. 2) or "max" (the paper's local min-max variant)
    query_every: int = 2
    pending_timeout: int = 6
    deny_after: int = 6
    audit_every: int = 8
    offer_every: int = 8
    min_gain: float = 1e-6
    sink_slack: float = 0.0  # a sink grants ceil(demand * (1 + slack)) units: spare chains for repairs
    handover: bool = True  # stage-0 relays offer chains to data nodes they would cost less (see `handover`)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"flow.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.cooling <= 1:
            raise ConfigError(f"flow.cooling must be in (0, 1], got {self.cooling}")
        if self.objective not in ("sum", "max"):
            raise ConfigError(f"flow.objective must be 'sum' or 'max', got {self.objective!r}")
        for name in ("query_every", "pending_timeout", "deny_after", "audit_every", "offer_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"flow.{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.sink_slack) and self.sink_slack >= 0):
            raise ConfigError(f"flow.sink_slack must be a finite number >= 0, got {self.sink_slack}")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ConfigError(f"flow.min_gain must be a finite number >= 0, got {self.min_gain}")
