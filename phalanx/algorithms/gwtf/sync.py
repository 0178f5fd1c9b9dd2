"""A synchronous driver of FlowNodes: rounds of deliver-all, for tests and benches (no I/O)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from ...core.errors import Evidence, RemoteError
from .flow import FlowNode
from .messages import Audit, FlowMessage, Offer
from .state import UnitState


class SyncDriver:
    """Rounds of deliver-all over a set of FlowNodes (tests and benches; no I/O).

    A round: every live node ticks; then every queued message is delivered once;
    messages produced while delivering wait for the next round. `drop` may lose
    messages (a predicate on each message).
    """

    def __init__(self, nodes: Iterable[FlowNode], drop: Callable[[FlowMessage], bool] | None = None) -> None:
        self.nodes: dict[str, FlowNode] = {n.peer: n for n in nodes}
        self.drop = drop
        self.queue: list[FlowMessage] = []
        self.rounds = 0
        self.messages = 0
        self.evidence: list[Evidence] = []

    def round(self) -> None:
        for peer in sorted(self.nodes):
            self.queue += self.nodes[peer].tick()
        batch, self.queue = self.queue, []
        for msg in batch:
            node = self.nodes.get(msg.dst)
            if node is None or (self.drop is not None and self.drop(msg)):
                continue
            self.messages += 1
            try:
                self.queue += node.handle(msg)
            except RemoteError as exc:
                self.evidence.append(exc.evidence)
        self.rounds += 1

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self.round()

    def settle(self, max_rounds: int) -> int:
        """Pause Change / Redirect and run until every node is stable and only Offers and Audits move.

        Returns the rounds used. Moves in flight finish; repairs and Request Flow go on.
        """
        for node in self.nodes.values():
            node.optimising = False
        used = quiet = 0
        try:
            while used < max_rounds and quiet < 2:
                self.round()
                used += 1
                calm = all(isinstance(m, (Offer, Audit)) for m in self.queue) and all(
                    n.stable for n in self.nodes.values())
                quiet = quiet + 1 if calm else 0
        finally:
            for node in self.nodes.values():
                node.optimising = True
        return used

    def add(self, node: FlowNode) -> None:
        """Add a live node; the caller introduces it with `add_peer` on both sides."""
        self.nodes[node.peer] = node

    def remove(self, peer: str) -> None:
        """Crash `peer`: it vanishes, its neighbours learn `peer_left`."""
        self.nodes.pop(peer, None)
        for node in self.nodes.values():
            self.queue += node.peer_left(peer)

    def paths(self) -> list[tuple[str, list[str], float]]:
        """Complete flows: (data node, relays in order, path cost), followed link by link."""
        found = []
        for data in sorted(p for p, n in self.nodes.items() if n.is_data):
            node = self.nodes[data]
            for u in node._units.values():
                if u.kind != "source" or u.downstream is None:
                    continue
                path, cost = self._follow(data, u)
                if path is not None:
                    found.append((data, path, cost))
        return found

    def _follow(self, data: str, start: UnitState) -> tuple[list[str] | None, float]:
        cost = 0.0
        hops: list[str] = []
        prev, u = data, start
        for _ in range(self.nodes[data].num_stages + 1):
            here = self.nodes.get(u.downstream) if u.downstream else None
            if here is None or u.downstream not in self.nodes[prev]._costs:
                return None, math.inf
            cost += self.nodes[prev]._costs[u.downstream]
            nxt = next((x for x in here._units.values() if x.in_link == u.out_link), None)
            if nxt is None or nxt.sink != data:
                return None, math.inf
            if nxt.kind == "sink":
                return (hops, cost) if here.peer == data else (None, math.inf)
            hops.append(here.peer)
            prev, u = here.peer, nxt
        return None, math.inf

    def total_cost(self) -> float:
        return sum(c for _, _, c in self.paths())

    def flow_value(self) -> int:
        return len(self.paths())
