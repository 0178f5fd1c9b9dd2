"""A peer's flow state: neighbours, measured costs, flow units, pending requests, offers.

A *flow unit* is one microbatch slot routed data node -> stage 0 -> ... -> stage S-1 -> the same data
node. Each node holds its units, each with an inbound link (from the previous stage) and an outbound
link (to the next stage), and the cost from itself to the unit's sink.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ...core.errors import LocalError
from .annealing import Annealing
from .config import FlowConfig
from .messages import DATA, CostUpdate, Deny, FlowMessage, FlowReport, Offer, Release

TOL = 1e-9


@dataclass(frozen=True)
class Unit:
    """A read-only view of one flow unit held by a node."""

    sink: str
    kind: str  # "relay", "source" or "sink"
    upstream: str | None
    in_link: str | None
    downstream: str | None
    out_link: str | None
    cost: float


@dataclass
class UnitState:
    uid: int
    sink: str
    kind: str
    upstream: str | None = None
    in_link: str | None = None
    downstream: str | None = None
    out_link: str | None = None
    cont: float = 0.0
    locked: int = 0  # the pending request touching this unit, 0 for none
    idle: int = 0  # ticks spent as an unpaired inflow
    age: int = 0  # ticks since its links last changed


@dataclass
class Pending:
    kind: str  # flow | attach | switch | change | redirect | handover | confirm
    peer: str
    sink: str
    uid: int
    born: int
    extra: dict = field(default_factory=dict)


class FlowState:
    """One peer's flow state: its neighbours and their costs, its units and pending requests, and the
    helpers every rule uses. `FlowNode` adds the rules (Request Flow, Change / Redirect)."""

    def __init__(
        self,
        peer: str,
        stage: int | None,
        capacity: int,
        num_stages: int,
        config: FlowConfig,
        rng: random.Random,
        demand: int = 0,
    ) -> None:
        if num_stages < 1:
            raise LocalError(f"num_stages must be >= 1, got {num_stages}")
        if stage is not None and not 0 <= stage < num_stages:
            raise LocalError(f"stage {stage} outside 0..{num_stages - 1}")
        if capacity < 0 or demand < 0:
            raise LocalError("capacity and demand must be >= 0")
        self.peer = peer
        self.stage = DATA if stage is None else stage
        self.is_data = stage is None
        self.capacity = capacity
        self.demand = demand
        self.num_stages = num_stages
        self.config = config
        self.rng = rng
        self.annealing = Annealing(config)
        self.handovers = 0  # chains this node handed to another data node (as the last stage)
        self._handover_turn = 0  # which (unit, data node) pair a stage-0 relay asks about next
        self._full_until: dict[str, int] = {}  # data nodes found without a free grant: not asked about until then
        self._late_handovers: dict[int, Pending] = {}  # handover locks that expired or were abandoned: late answers
        self.optimising = True  # False pauses Request Change / Redirect (routes stay put during training)
        self.handovers_ended = False  # no new handover probe, and "no" to queries; answers in flight still taken
        self._stages: dict[str, int] = {}
        self._costs: dict[str, float] = {}
        self._units: dict[int, UnitState] = {}
        self._pending: dict[int, Pending] = {}
        self._offers: dict[str, dict[str, tuple[float, int]]] = {}
        self._sent_offers: dict[str, tuple] = {}
        self._reports: dict[str, FlowReport] = {}
        self._now = 0
        self._counter = 0
        self._nonce = f"{rng.getrandbits(32):08x}"
        self._phase = rng.randrange(config.audit_every)

    @property
    def cost_unit(self) -> float:
        """The cost that the annealing's temperature and `min_gain` are expressed in (see `annealing`)."""
        return self.annealing.cost_unit

    @cost_unit.setter
    def cost_unit(self, value: float) -> None:
        self.annealing.cost_unit = value

    @property
    def accepted_moves(self) -> int:
        return self.annealing.accepted_moves

    # ------------------------------------------------------------ views

    @property
    def units(self) -> tuple[Unit, ...]:
        return tuple(
            Unit(u.sink, u.kind, u.upstream, u.in_link, u.downstream, u.out_link, self._cost(u))
            for u in sorted(self._units.values(), key=lambda u: u.uid)
        )

    @property
    def stable(self) -> bool:
        """No pending request (but handovers passing through) and no unit waiting for a next hop."""
        waiting = any(u.kind == "relay" and u.downstream is None for u in self._units.values())
        return all(p.kind == "handover" for p in self._pending.values()) and not waiting

    def next_hops(self, sink: str) -> dict[str, int]:
        """Next-stage peer -> number of this node's units towards `sink` (paired or not)."""
        hops: dict[str, int] = {}
        for u in self._units.values():
            if u.sink == sink and u.downstream is not None and u.kind != "sink":
                hops[u.downstream] = hops.get(u.downstream, 0) + 1
        return dict(sorted(hops.items()))

    def route(self, sink: str, upstream: str) -> str | None:
        """The next hop of a unit that receives from `upstream` towards `sink`, if any."""
        hops = sorted(u.downstream for u in self._units.values()
                      if u.sink == sink and u.upstream == upstream and u.downstream is not None)
        return hops[0] if hops else None

    def routes(self, sink: str, upstream: str) -> dict[str, int]:
        """Next hop -> number of units that receive from `upstream` towards `sink` (for load balancing)."""
        hops: dict[str, int] = {}
        for u in self._units.values():
            if u.sink == sink and u.upstream == upstream and u.downstream is not None:
                hops[u.downstream] = hops.get(u.downstream, 0) + 1
        return dict(sorted(hops.items()))

    def flows(self) -> int:
        """Source units of a data node (each is one microbatch slot with a next hop)."""
        return sum(1 for u in self._units.values() if u.kind == "source" and u.downstream is not None)

    def cost_to(self, peer: str) -> float | None:
        return self._costs.get(peer)

    # ------------------------------------------------------------ membership and measurements

    def add_peer(self, peer: str, stage: int | None, cost: float) -> list[FlowMessage]:
        """Learn a neighbour (stage None for a data node) and d(self, peer)."""
        if peer == self.peer:
            return []
        st = DATA if stage is None else stage
        if st != DATA and not 0 <= st < self.num_stages:
            raise LocalError(f"stage {st} outside 0..{self.num_stages - 1}")
        out = self.peer_left(peer) if self._stages.get(peer, st) != st else []  # it moved: old links are void
        self._stages[peer] = st
        return out + self.set_cost(peer, cost)

    def set_cost(self, peer: str, cost: float) -> list[FlowMessage]:
        """A new measurement of d(self, peer); cost changes flow back upstream."""
        if not (math.isfinite(cost) and cost >= 0):
            raise LocalError(f"cost to {peer} must be finite and >= 0, got {cost}")
        if peer not in self._stages:
            raise LocalError(f"set_cost for unknown peer {peer}; call add_peer first")
        self._costs[peer] = float(cost)
        out: list[FlowMessage] = []
        for u in self._units.values():
            if u.downstream == peer and u.upstream is not None and math.isfinite(self._cost(u)):
                out.append(CostUpdate(self.peer, u.upstream, u.in_link, self._cost(u)))
        return out

    def peer_left(self, peer: str) -> list[FlowMessage]:
        """A neighbour crashed or left: its links break, its offers and reports vanish."""
        self._stages.pop(peer, None)
        self._costs.pop(peer, None)
        self._offers.pop(peer, None)
        self._reports.pop(peer, None)
        self._sent_offers.pop(peer, None)
        out: list[FlowMessage] = []
        for req, p in list(self._pending.items()):
            if p.peer == peer:
                self._drop_pending(req)
        for u in list(self._units.values()):
            if u.downstream == peer:
                out += self._lose_downstream(u)
            if u.upstream == peer:
                self._lose_upstream(u)
        self._cleanup()
        return out + self._offer_messages(force=False)

    def set_demand(self, demand: int) -> list[FlowMessage]:
        """Data nodes: change how many microbatch slots to route (extra ones are released)."""
        if not self.is_data or demand < 0:
            raise LocalError("set_demand is for data nodes, with demand >= 0")
        self.demand = demand
        out: list[FlowMessage] = []
        for kind in ("source", "sink"):
            mine = sorted((u for u in self._units.values() if u.kind == kind and not u.locked),
                          key=lambda u: (u.upstream is not None, -self._cost(u) if kind == "source" else 0))
            extra = sum(1 for u in self._units.values() if u.kind == kind) - demand
            for u in mine[:max(0, extra)]:
                if kind == "source" and u.downstream is not None:
                    out.append(Release(self.peer, u.downstream, u.out_link))
                if kind == "sink" and u.upstream is not None:
                    out.append(Deny(self.peer, u.upstream, u.in_link))
                del self._units[u.uid]
        return out + self._offer_messages(force=False)

    # ------------------------------------------------------------ helpers

    def _cost(self, u: UnitState) -> float:
        if u.kind == "sink":
            return 0.0
        if u.downstream is None or u.downstream not in self._costs:
            return math.inf
        return self._costs[u.downstream] + u.cont

    def _grants(self) -> int:
        return math.ceil(self.demand * (1 + self.config.sink_slack))

    def _next_stage(self) -> int:
        return 0 if self.is_data else (self.stage + 1 if self.stage + 1 < self.num_stages else DATA)

    def _prev_stage(self) -> int:
        return self.num_stages - 1 if self.is_data else (self.stage - 1 if self.stage > 0 else DATA)

    def _peers_at(self, stage: int) -> list[str]:
        return sorted(p for p, s in self._stages.items() if s == stage and p in self._costs)

    def _new_id(self) -> int:
        self._counter += 1
        return self._counter

    def _new_link(self) -> str:
        return f"{self.peer}/{self._nonce}/{self._new_id()}"

    def _used(self) -> int:
        news = sum(1 for p in self._pending.values() if p.kind in ("flow", "redirect"))
        return sum(1 for u in self._units.values() if u.kind == "relay") + news

    def _free(self) -> int:
        return max(0, self.capacity - self._used()) if not self.is_data else 0

    def _unit_by(self, attr: str, link: str, peer: str) -> UnitState | None:
        for u in self._units.values():
            if getattr(u, attr) == link and getattr(u, "upstream" if attr == "in_link" else "downstream") == peer:
                return u
        return None

    def _drop_pending(self, req: int) -> Pending | None:
        p = self._pending.pop(req, None)
        if p is not None:
            for u in self._units.values():
                if u.locked == req:
                    u.locked = 0
        return p

    def _lose_downstream(self, u: UnitState) -> list[FlowMessage]:
        u.downstream, u.out_link, u.cont, u.idle, u.age = None, None, 0.0, 0, 0
        return []

    def _lose_upstream(self, u: UnitState) -> None:
        u.upstream, u.in_link, u.age = None, None, 0

    def _cleanup(self) -> None:
        for u in list(self._units.values()):
            if u.locked:
                continue
            dead = (u.kind == "relay" and u.upstream is None and u.downstream is None) or (
                u.kind == "source" and u.downstream is None) or (u.kind == "sink" and u.upstream is None)
            if dead:
                del self._units[u.uid]

    def _upstream_update(self, u: UnitState, before: float) -> list[FlowMessage]:
        after = self._cost(u)
        if u.upstream is None or (math.isfinite(before) and abs(after - before) <= TOL) or not math.isfinite(after):
            return []
        return [CostUpdate(self.peer, u.upstream, u.in_link, after)]

    # ------------------------------------------------------------ offers

    def _offer_entries(self) -> tuple[tuple[str, float, int], ...]:
        per: dict[str, list[float]] = {}
        for u in self._units.values():
            if u.kind == "relay" and u.upstream is None and u.downstream is not None and not u.locked:
                c = self._cost(u)
                if math.isfinite(c):
                    per.setdefault(u.sink, []).append(c)
        entries = [(s, min(cs), len(cs)) for s, cs in per.items()]
        if self.is_data:
            free = self._grants() - sum(1 for u in self._units.values() if u.kind == "sink")
            if free > 0:
                entries.append((self.peer, 0.0, free))
        return tuple(sorted(entries))

    def _offer_messages(self, force: bool) -> list[FlowMessage]:
        entries = self._offer_entries()
        out: list[FlowMessage] = []
        for p in self._peers_at(self._prev_stage()):
            if force or self._sent_offers.get(p) != entries:
                self._sent_offers[p] = entries
                out.append(Offer(self.peer, p, self.stage, entries))
        return out
