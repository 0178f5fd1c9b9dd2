"""Churn for `phalanx launch` of a pipeline: `faults.leave_rate` / `faults.join_rate` on real relay processes.

As in the simulator (GWTF's join-leave chance, per relay and iteration): for
every iteration the data nodes finish, each relay that left comes back with
probability `join_rate`, and each live relay leaves with probability
`leave_rate` (SIGKILL: no goodbye). A relay that comes back is a new process
with a new identity that joins through the leader (GWTF V-B: placed at the
bottleneck stage, downloads that stage's weights, serves). Churn never takes
the last live relay of a stage (its weights would be gone; GWTF does not say
how a wiped-out stage recovers); a new relay counts as a replica of its stage,
and may leave, only from the iteration it serves (the one after its weights
download: `serves_from`), and one that ends before that counts as a relay that
left. Churn stops two iterations before the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.rng import py_stream
from .config import PipelineRunConfig


@dataclass(frozen=True)
class RelayChurn:
    """After iteration `it`, relay process `name` left (was killed), or a new relay `name` joined (was started)."""

    it: int
    name: str
    event: str  # "left" or "joined"


class PipelineChurn:
    """Which relays to stop and which new ones to start as iterations finish (decisions only; the launcher acts)."""

    def __init__(self, config: PipelineRunConfig, first_index: int) -> None:
        self.config = config
        self.last = config.steps - 2  # no churn from this iteration on
        self.down = 0  # relays that left and may come back (as new identities)
        self.next_index = first_index  # the index (identity) of the next joiner
        self.events: list[RelayChurn] = []
        self._rng = py_stream(config.seed, "pipeline-launch-churn")
        self._done = -1
        self.serves_from: dict[str, int] = {}  # a new relay's first serving iteration (launched relays: 0)

    @staticmethod
    def wanted(config: PipelineRunConfig) -> bool:
        return bool(config.faults.leave_rate or config.faults.join_rate)

    def failed_join(self) -> None:
        """A new relay ended before it served (no placement, or no stage peer sent it the weights): it may come again."""
        self.down += 1

    def due(self, finished: int) -> bool:
        """Whether `advance(finished, ...)` has an iteration to decide."""
        return self._done < min(finished - 1, self.last - 1)

    def advance(self, finished: int, live: dict[str, int], banned: frozenset[str] = frozenset()) -> list[RelayChurn]:
        """Decisions for every iteration finished since the last call (`finished` of them in all); `live` maps
        each live, placed relay to its stage; `banned`: relays banned so far (they do not keep a stage alive)."""
        stages = dict(live)
        new: list[RelayChurn] = []
        while self.due(finished):
            self._done += 1
            for _ in range(self.down):
                if self._rng.random() < self.config.faults.join_rate:
                    self.down -= 1
                    new.append(RelayChurn(self._done, str(self.next_index), "joined"))
                    self.next_index += 1
            # decided after iteration `_done`, for the iterations from `_done + 1` on: a new relay counts only if it
            # serves `_done + 1` (it serves from the iteration after the version it downloaded, which can run one
            # ahead of the data nodes); counted earlier, it let churn take a stage's last serving relay over
            # hivemind, and that iteration finished nothing
            serves = {n: s for n, s in stages.items() if self.serves_from.get(n, 0) <= self._done + 1}
            for name in sorted(serves, key=int):
                serving = sum(1 for peer, s in serves.items() if s == serves[name] and peer not in banned)
                if name not in banned and serving <= 1:
                    continue
                if self._rng.random() < self.config.faults.leave_rate:
                    del stages[name], serves[name]
                    self.down += 1
                    new.append(RelayChurn(self._done, name, "left"))
        self.events.extend(new)
        return new
