"""Routing policies: which next-stage peer gets a microbatch, learned from what a node observes.

One interface, chosen by `pipeline.routing`. A policy sees only its own node's
measurements (latency from sending an activation to receiving COMPLETE) and
the candidates the runtime offers (live peers of the next stage that have not
denied or failed this microbatch).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod


class Router(ABC):
    """One node's routing decisions."""

    name: str
    restart_on_backward_failure: bool  # SWARM restarts a microbatch; GWTF repairs the broken stage
    remembers_refusals: bool = True  # a peer that refused a microbatch is not asked again for it
    last_branch: str = ""  # which rule made the latest choice (logged per hop, counted per run)

    @abstractmethod
    def choose(self, stage: int, candidates: list[str], sink: str = "", upstream: str = "",
               load: dict[str, int] | None = None) -> str | None:
        """The next peer of `stage` among `candidates` (sorted), or None to give up.

        `sink` is the microbatch's data node, `upstream` the peer it came from, `load` how many
        microbatches this node has in flight at each peer.
        """

    def observe(self, peer: str, seconds: float) -> None:
        """A COMPLETE from `peer` came `seconds` after the activation left."""

    def failed(self, peer: str) -> None:
        """`peer` timed out, was unreachable, or denied."""


class SwarmRouter(Router):
    """SWARM's stochastic wiring: draw the next peer with probability proportional to its throughput.

    Throughput is 1 / (moving average of observed COMPLETE latency). A peer not
    measured yet is given the best known estimate (optimism, so it is tried);
    a failure counts as a sample of `penalty` seconds. `paper=False` (routing
    `swarm`): a backward failure restarts the microbatch from its data node and
    a peer that refused a microbatch is skipped for it. `paper=True` (routing
    `swarm-paper`, as the SWARM paper): a backward failure gets a new peer for
    the broken stage, and refusals are not remembered (SWARM knows no peer's
    memory; a refusal only lowers the peer's throughput estimate).
    """

    name = "swarm"
    restart_on_backward_failure = True

    def __init__(self, rng: random.Random, ema: float, penalty: float, paper: bool = False) -> None:
        if paper:
            self.name = "swarm-paper"
            self.restart_on_backward_failure = False
            self.remembers_refusals = False
        self.rng = rng
        self.ema = ema
        self.penalty = penalty
        self.latency: dict[str, float] = {}

    def choose(self, stage: int, candidates: list[str], sink: str = "", upstream: str = "",
               load: dict[str, int] | None = None) -> str | None:
        if not candidates:
            return None
        known = [self.latency[p] for p in candidates if p in self.latency]
        default = min(known) if known else 1.0
        weights = [1.0 / max(self.latency.get(p, default), 1e-9) for p in candidates]
        self.last_branch = "swarm"
        return self.rng.choices(candidates, weights=weights)[0]

    def observe(self, peer: str, seconds: float) -> None:
        old = self.latency.get(peer)
        self.latency[peer] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def failed(self, peer: str) -> None:
        self.observe(peer, self.penalty)


class RepairRouter(Router):
    """Cheapest measured next peer first (unmeasured peers are tried first); broken backwards are repaired.

    The runtime's stand-in for GWTF routing before the flow algorithm has
    formed flows, and the fallback of `FlowRouter` when it has none.
    """

    name = "repair"
    restart_on_backward_failure = False

    def __init__(self, ema: float, penalty: float) -> None:
        self.ema = ema
        self.penalty = penalty
        self.latency: dict[str, float] = {}

    def choose(self, stage: int, candidates: list[str], sink: str = "", upstream: str = "",
               load: dict[str, int] | None = None) -> str | None:
        if not candidates:
            return None
        self.last_branch = "cheapest"
        return min(candidates, key=lambda p: (self.latency.get(p, 0.0), p))

    def observe(self, peer: str, seconds: float) -> None:
        old = self.latency.get(peer)
        self.latency[peer] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def failed(self, peer: str) -> None:
        self.observe(peer, self.penalty)
