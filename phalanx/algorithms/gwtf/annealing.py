"""Simulated annealing's schedule for Request Change / Redirect (GWTF Sec. V-C).

A move that raises the objective by delta is still taken when exp(-delta / T) > U(0, 1); T starts at
`temperature` and is multiplied by `cooling` after each accepted move. T and `min_gain` are in units of
`cost_unit`: 1 for unit-free costs (the benches' graphs); the runtime sets it to its mean measured edge
cost, so that T=1.7 means the same relative worsening whether costs are in seconds or milliseconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .config import FlowConfig


@dataclass
class Annealing:
    """One node's temperature, cost unit and count of accepted moves."""

    config: FlowConfig
    cost_unit: float = 1.0
    accepted_moves: int = 0

    def __post_init__(self) -> None:
        self.temperature = self.config.temperature

    def accept(self, delta: float, rng: random.Random) -> bool:
        """Improvements always, worsening with prob exp(-delta/T)."""
        if delta < -self.min_gain():
            return True
        if self.temperature <= 0 or delta <= self.min_gain():
            return False
        return math.exp(-delta / (self.temperature * self.cost_unit)) > rng.random()

    def min_gain(self) -> float:
        """The smallest change of the objective that counts as one, in the cost's unit."""
        return self.config.min_gain * self.cost_unit

    def cooled(self) -> None:
        """An accepted move: cool down."""
        self.temperature *= self.config.cooling
        self.accepted_moves += 1
