"""GWTF routing over the transport: the runtime carries the flow state machine's messages.

`FlowDriver` owns one `phalanx.algorithms.gwtf.flow.FlowNode` per pipeline node. It
learns its neighbours from the stage directory, measures the edge cost of
Eq. 1 (own compute seconds per microbatch, the COMPLETE round trip to a
next-stage peer, which holds transfer, latency and the peer's compute),
ticks the state machine every `flow_period` seconds, and sends the messages
it returns on topic `pp.flow`. `FlowRouter` turns the flows into routing
decisions: the unit paired with the upstream peer first, else the next hop
with the most flow units per microbatch already in flight, else (while flows
are still forming, or all of them broke) the cheapest measured live peer.
Backward failures are repaired (GWTF V-D), never restarted.
"""

from __future__ import annotations

import asyncio

from ...algorithms.gwtf.flow import (
    DATA,
    FlowConfig,
    FlowMessage,
    FlowNode,
    edge_cost,
    from_wire,
    to_wire,
)
from ...core.serialization import decode, encode
from ...transport.base import Transport
from .routing import RepairRouter, Router

FLOW = "pp.flow"


class FlowRouter(Router):
    """Routing by the flows of a FlowNode, with a cheapest-peer fallback."""

    name = "gwtf"
    restart_on_backward_failure = False

    def __init__(self, flow: FlowNode, fallback: RepairRouter, units_are_slots: bool = False) -> None:
        self.flow = flow
        self.fallback = fallback
        # capacity_mode=iteration: a flow unit is one microbatch per iteration, `load` counts this iteration's;
        # with every unit to this data node used, the microbatch has no flow: refused here (deferred at a data node)
        self.units_are_slots = units_are_slots

    def choose(self, stage: int, candidates: list[str], sink: str = "", upstream: str = "",
               load: dict[str, int] | None = None) -> str | None:
        if not candidates:
            return None
        load = load or {}
        if upstream:  # the units paired with the peer it came from; several (a stage-1 relay's units all come from
            # its data node): spread over them as the flow branch does, not always the first (which idled the others)
            paired = {p: n for p, n in self.flow.routes(sink, upstream).items() if p in candidates}
            if paired:
                self.last_branch = "paired"
                return min(sorted(paired), key=lambda p: (load.get(p, 0) + 1) / paired[p])
        hops = {p: n for p, n in self.flow.next_hops(sink).items() if p in candidates and n > 0}
        if hops and self.units_are_slots:
            hops = {p: n for p, n in hops.items() if load.get(p, 0) < n}
            if not hops:
                self.last_branch = "full"
                return None
        if hops:
            self.last_branch = "flow"
            return min(sorted(hops), key=lambda p: (load.get(p, 0) + 1) / hops[p])
        if self.units_are_slots and stage == 1:  # a data node sends only along its flow units: a microbatch
            self.last_branch = "full"  # without one would take slots that other data nodes' flows hold
            return None
        self.last_branch = "fallback"
        return self.fallback.choose(stage, candidates, sink, upstream, load)

    def observe(self, peer: str, seconds: float) -> None:
        self.fallback.observe(peer, seconds)

    def failed(self, peer: str) -> None:
        self.fallback.failed(peer)


class FlowDriver:
    """Runs a FlowNode for one pipeline node: neighbours, costs, ticks and message transport."""

    def __init__(
        self,
        transport: Transport,
        stage: int,
        stages: int,
        capacity: int,
        demand: int,
        config: FlowConfig,
        rng,
        period: float,
        handover_in_iterations: bool = True,
        handovers_ended: bool = False,
    ) -> None:
        self.transport = transport
        self.stage = stage
        self.period = period
        self.handover_in_iterations = handover_in_iterations
        self.node = FlowNode(transport.peer_id, None if stage == 0 else stage - 1, capacity, stages, config, rng,
                             demand=demand if stage == 0 else 0)
        self.node.handovers_ended = handovers_ended  # a joiner under `warmup`: its peers ended theirs long ago
        self.compute = 0.0  # EMA of own compute seconds per microbatch
        self.rtt: dict[str, float] = {}
        self.known: dict[str, int] = {}
        self._sending: set[asyncio.Task] = set()
        transport.add_message_handler(FLOW, self._on_flow)

    def flow_stage(self, stage: int) -> int | None:
        return None if stage == 0 else stage - 1

    def neighbour(self, stage: int) -> bool:
        """Peers the flow algorithm talks to: previous, same and next stage (data nodes wrap around)."""
        last = self.node.num_stages
        ring = {(self.stage - 1) % (last + 1), self.stage, (self.stage + 1) % (last + 1)}
        return stage in ring

    def cost(self, peer: str) -> float:
        """Eq. 1 from measurements; a peer not measured yet is priced at the mean of the measured ones
        (not below them, which would pull flow onto peers nobody has seen work)."""
        rtt = self.rtt.get(peer)
        if rtt is None and self.rtt:
            rtt = sum(self.rtt.values()) / len(self.rtt)
        if rtt is None:
            return edge_cost(self.compute, self.compute, 0.0, 0.0, 1.0, 1.0, 0.0)
        return self.compute / 2 + rtt / 2

    def sync_directory(self, directory: dict[str, int], members: set[str]) -> list[FlowMessage]:
        out: list[FlowMessage] = []
        for peer in sorted(self.known):  # gone, moved out of reach, or banned: its links break at once
            stage = directory.get(peer)
            if peer not in members or stage is None or not self.neighbour(stage):
                out += self.lost(peer)
        for peer, stage in sorted(directory.items()):
            if peer == self.transport.peer_id or not self.neighbour(stage) or peer not in members:
                continue
            if self.known.get(peer) != stage:
                self.known[peer] = stage
                out += self.node.add_peer(peer, self.flow_stage(stage), self.cost(peer))
        return out

    def node_stage(self, peer: str) -> int:
        """The flow state machine's stage number of a known peer (data nodes: its DATA marker)."""
        stage = self.flow_stage(self.known[peer])
        return DATA if stage is None else stage

    def measured_compute(self, seconds: float, ema: float) -> None:
        self.compute = seconds if self.compute == 0 else (1 - ema) * self.compute + ema * seconds

    def measured_rtt(self, peer: str, seconds: float, ema: float) -> list[FlowMessage]:
        """A COMPLETE round trip (or a failure's penalty): the peer's cost, the unmeasured peers' (the
        mean moved) and the cost unit that annealing scales by."""
        old = self.rtt.get(peer)
        self.rtt[peer] = seconds if old is None else (1 - ema) * old + ema * seconds
        out: list[FlowMessage] = []
        for other in sorted(self.known):  # this peer, and the unmeasured ones (their price is the mean)
            if other == peer or other not in self.rtt:
                out += self.node.set_cost(other, self.cost(other))
        measured = [self.cost(p) for p in self.rtt]
        self.node.cost_unit = max(sum(measured) / len(measured), 1e-9)
        return out

    def failed(self, peer: str, penalty: float, ema: float) -> list[FlowMessage]:
        """`peer` timed out or was unreachable: a sample of `penalty` seconds raises its cost."""
        return self.measured_rtt(peer, penalty, ema)

    def pause(self, paused: bool) -> None:
        """Pause Request Change / Redirect while an iteration's microbatches run (GWTF Sec. V-C);
        Request Flow and repairs go on. Without `handover_in_iterations` the first call (this node's first
        iteration began) also ends handovers for good: no new probe, queries answered "no"; the answers of
        handovers in flight (done, ack) are still taken, so that a chain another node already relabelled is
        relabelled here too instead of broken (paused, this node relabels nothing on its own)."""
        self.node.optimising = not paused
        if not self.handover_in_iterations:
            self.node.handovers_ended = True

    def lost(self, peer: str) -> list[FlowMessage]:
        if peer in self.known:
            del self.known[peer]
            return self.node.peer_left(peer)
        return []

    async def send(self, messages: list[FlowMessage]) -> None:
        for msg in messages:
            await self.transport.send(msg.dst, FLOW, encode(to_wire(msg)))

    async def loop(self, directory_of, stop: asyncio.Event) -> None:
        """Tick every `period` seconds until `stop` is set."""
        while not stop.is_set():
            members = set(self.transport.members())
            out = self.sync_directory(directory_of(), members)
            out += self.node.tick()
            await self.send(out)
            try:
                await asyncio.wait_for(stop.wait(), self.period)
            except asyncio.TimeoutError:
                pass

    def _on_flow(self, sender: str, payload: bytes) -> None:
        msg = from_wire(decode(payload, sender, self.transport.limits), sender, self.transport.peer_id)
        claimed = getattr(msg, "stage", None)
        if sender in self.known and claimed is not None and claimed != self.node_stage(sender):
            return  # our views of who serves what differ (a move or rejoin not yet seen here): not evidence
        replies = self.node.handle(msg)
        if replies:
            task = asyncio.get_running_loop().create_task(self.send(replies))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
