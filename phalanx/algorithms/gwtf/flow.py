"""GWTF's decentralized flow optimisation (Sec. IV, V-A, V-C, Eq. 1) as a sans-IO state machine.

Data nodes are both the source and the sink of their own microbatches; relays serve one of
`num_stages` stages. Each node only knows its neighbours (previous, same and next stage) and its
measured edge costs d(i, j) (Eq. 1). The concepts live in their own modules:

- state: a node's units, links, pending requests and offers;
- request_flow: Request Flow, building pipelines back to front, with switches, repairs and audits;
- moves: Request Change / Redirect with the stage's peers;
- handover: a chain changes data node, rebalancing sources that share a bottleneck;
- annealing: the temperature schedule that lets a move worsen the objective;
- costs: Eq. 1 and the objective; config: the knobs; messages: the wire format and its checks;
- sync: a synchronous driver for tests and benches.

Nothing here reads a clock or a global RNG: the runtime calls `tick()` at its own pace and passes a
seeded `random.Random`. Methods return the messages to send; each has `.dst`.
"""

from __future__ import annotations

from ...core.errors import Evidence, LocalError, RemoteError
from .config import FlowConfig
from .costs import edge_cost
from .handover import HandoverRules
from .messages import DATA, FlowMessage, from_wire, to_wire, validate
from .moves import MoveRules

# The runtime (runtime/pipeline/gwtf.py, runs/pipeline/run.py) imports these from here.
__all__ = ["DATA", "FlowConfig", "FlowMessage", "FlowNode", "edge_cost", "from_wire", "to_wire"]


class FlowNode(HandoverRules, MoveRules):
    """One peer's share of the GWTF flow algorithm (a data node if `stage` is None)."""

    def tick(self) -> list[FlowMessage]:
        """One round: expire, repair, request, optimise, audit."""
        self._now += 1
        out: list[FlowMessage] = []
        for req, p in list(self._pending.items()):
            if self._now - p.born > p.extra.get("timeout", self.config.pending_timeout):
                out += self._expire(req)
        for u in self._units.values():
            u.age += 1
        requested = False
        if self.is_data:
            out += self._tick_source()
        else:
            out += self._repair_inflows()
            out_req = self._switches() + self._new_flows()
            requested = bool(out_req)
            out += out_req
            if not requested:
                out += self._optimise() + self._handover_probe()
        self._cleanup()
        out += self._offer_messages(force=self._now % self.config.offer_every == self._phase % self.config.offer_every)
        if self._now % self.config.audit_every == self._phase:
            out += self._audits()
        return out

    def handle(self, msg: FlowMessage) -> list[FlowMessage]:
        """Apply one received message; returns replies. Malformed input raises RemoteError."""
        if msg.dst != self.peer:
            raise LocalError(f"message for {msg.dst} delivered to {self.peer}")
        validate(msg)
        claimed = getattr(msg, "stage", None)
        if claimed is not None and msg.src in self._stages and self._stages[msg.src] != claimed:
            raise RemoteError(Evidence(msg.src, "wrong_stage",
                                       f"claims stage {claimed}, serves {self._stages[msg.src]}"))
        handler = getattr(self, f"_on_{type(msg).__name__}")
        out = handler(msg)
        self._cleanup()
        return out + self._offer_messages(force=False)
