"""Churn for `phalanx launch`: `faults.leave_rate` / `faults.join_rate` applied to real worker processes.

The launcher watches the run's progress (the highest step any worker has
recorded). For every step finished, drawn from the run seed like the
simulator's `FaultDriver`: each worker that left comes back with probability
`join_rate` (a fresh process with the same identity, which joins through state
catch-up), then each training non-evaluating worker leaves with probability
`leave_rate` (SIGKILL: no goodbye, as a volunteer that pulls the plug). A
worker started again counts as training once it has recorded a step; until
then it cannot leave, and a start that fails puts it back among those that
left. Churn never takes the swarm below `1 + catchup.confirmations` training
workers, so a returning worker always finds enough peers to agree on the state
it fetches, and stops `2 * catchup.margin` steps before the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.rng import py_stream
from .config import RunConfig


@dataclass(frozen=True)
class ChurnEvent:
    """Worker `index` left (was killed) or joined (was started again) after `step`."""

    step: int
    index: int
    event: str  # "left" or "joined"


class LaunchChurn:
    """Which workers to stop and start as the run progresses (decisions only; the launcher acts)."""

    def __init__(self, config: RunConfig, start: int = 0) -> None:
        """Decide from step `start` on (a resumed run does not replay the decisions before its checkpoint)."""
        self.config = config
        self.min_alive = 1 + config.catchup.confirmations
        self.last = config.steps - 2 * config.catchup.margin  # no churn from this step on
        self.down: list[int] = []  # left (or failed to come back): may be started again
        self.starting: set[int] = set()  # started again, not training yet
        self.events: list[ChurnEvent] = []
        self._rng = py_stream(config.seed, "launch-churn")
        self._done = start - 1

    def trained(self, index: int) -> None:
        """Worker `index`, started again, has recorded a step: it trains (and may leave again)."""
        self.starting.discard(index)

    def failed_start(self, index: int) -> None:
        """Worker `index`, started again, ended before training: it may be started again later."""
        self.starting.discard(index)
        self.down.append(index)

    @staticmethod
    def wanted(config: RunConfig) -> bool:
        return bool(config.faults.leave_rate or config.faults.join_rate)

    def advance(self, progress: int, training: list[int]) -> list[ChurnEvent]:
        """Decisions for every step finished since the last call, up to `progress`; `training` are the live
        workers that have trained since they (re)started."""
        alive = set(training)
        new: list[ChurnEvent] = []
        while self._done < min(progress, self.last - 1):
            self._done += 1
            for index in list(self.down):
                if self._rng.random() < self.config.faults.join_rate:
                    self.down.remove(index)
                    self.starting.add(index)
                    new.append(ChurnEvent(self._done, index, "joined"))
            for index in sorted(alive):
                if index < self.config.eval_peers or len(alive) <= self.min_alive:
                    continue
                if self._rng.random() < self.config.faults.leave_rate:
                    alive.discard(index)
                    self.down.append(index)
                    new.append(ChurnEvent(self._done, index, "left"))
        self.events.extend(new)
        return new
