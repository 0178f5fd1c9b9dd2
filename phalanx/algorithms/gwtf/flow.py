"""GWTF's decentralized flow optimisation (Sec. IV, V-A, V-C, Eq. 1) as a sans-IO state machine.

Data nodes are both the source and the sink of their own microbatches; relays
serve one of `num_stages` stages. A *flow unit* is one microbatch slot routed
data node -> stage 0 -> ... -> stage S-1 -> the same data node. Each node only
knows its neighbours (previous, same and next stage) and its measured edge
costs d(i, j) (Eq. 1); it holds its units, each with an inbound link (from the
previous stage) and an outbound link (to the next stage), and the cost from
itself to the unit's sink.

Pipelines are built back to front (Request Flow): a sink grants up to its
demand, a node with an *unpaired outflow* (a path to a sink but no sender)
advertises it to the previous stage with its cost to the sink (`Offer`), and a
node with free capacity or an *unpaired inflow* (a sender but no path) asks
the neighbour that minimises d(i, j) + cost_j. Costs to each sink flow back
stage by stage (`CostUpdate`). Once a node cannot request flow it optimises
with its stage peers (`FlowQuery` / `FlowReport`): Request Change swaps the
next hops of two units towards the same sink, Request Redirect moves a
peer's unit i -> j -> k onto itself (i -> me -> k). Both use simulated
annealing: a move that raises the objective by delta is still proposed when
exp(-delta / T) > U(0, 1); T starts at `temperature` and is multiplied by
`cooling` after each accepted move.

Departures from the paper, where it is silent or loose:
- a unit may also *switch* its next hop to a cheaper advertised unpaired
  outflow (Request Flow with `replaces`), releasing the old link; this lets
  capacity held by flows that never reached a source be reused;
- every link change is told to both ends; an end that does not recognise a
  link answers with `Release` / `Deny`, and each node audits its links with
  its neighbours every `audit_every` ticks, so races between concurrent moves
  heal instead of leaking capacity.

Nothing here reads a clock or a global RNG: the runtime calls `tick()` at its
own pace and passes a seeded `random.Random`. Methods return the messages to
send; each has `.dst`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields

from ...core.errors import ConfigError, Evidence, LocalError, RemoteError

DATA = -1  # the stage number data nodes use in messages
_TOL = 1e-9


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


def edge_cost(
    compute_i: float,
    compute_j: float,
    latency_ij: float,
    latency_ji: float,
    bandwidth_ij: float,
    bandwidth_ji: float,
    size: float,
) -> float:
    """Eq. 1: d_ij = (c_i + c_j)/2 + (lat_ij + lat_ji)/2 + 2 size / (bw_ij + bw_ji)."""
    values = (compute_i, compute_j, latency_ij, latency_ji, bandwidth_ij, bandwidth_ji, size)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"edge_cost needs finite non-negative inputs, got {values}")
    if bandwidth_ij + bandwidth_ji <= 0:
        raise ConfigError("edge_cost needs a positive bandwidth in at least one direction")
    return (compute_i + compute_j) / 2 + (latency_ij + latency_ji) / 2 + 2 * size / (bandwidth_ij + bandwidth_ji)


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class FlowMessage:
    """Base of every flow message: sender and receiver peer ids."""

    src: str
    dst: str


@dataclass(frozen=True)
class Offer(FlowMessage):
    """Unpaired outflow of `src` per sink: entries of (sink, cost to sink, count)."""

    stage: int
    entries: tuple[tuple[str, float, int], ...]


@dataclass(frozen=True)
class RequestFlow(FlowMessage):
    """Ask `dst` for one unit of its unpaired outflow towards `sink` at `cost`."""

    req: int
    sink: str
    cost: float
    replaces: str = ""  # a link of src that the new one replaces (switch), "" for none


@dataclass(frozen=True)
class Approve(FlowMessage):
    """Request `req` granted on the new `link`; `cost` is src's cost to the sink through it."""

    req: int
    sink: str
    link: str
    cost: float


@dataclass(frozen=True)
class Reject(FlowMessage):
    """Request `req` refused; `cost` is src's current best cost to `sink` (-1: none)."""

    req: int
    sink: str
    cost: float


@dataclass(frozen=True)
class CostUpdate(FlowMessage):
    """Downstream -> upstream: src's cost to the sink of `link` is now `cost`."""

    link: str
    cost: float


@dataclass(frozen=True)
class Release(FlowMessage):
    """Upstream -> downstream: src no longer sends on `link`."""

    link: str


@dataclass(frozen=True)
class Deny(FlowMessage):
    """Downstream -> upstream (GWTF's DENY): src cannot carry `link` any more."""

    link: str


@dataclass(frozen=True)
class Rewire(FlowMessage):
    """The other end of dst's `link` moves from `old` to `new`.

    side "up": dst is downstream and its sender becomes `new`; side "down": dst
    is upstream, its receiver becomes `new`, whose cost to the sink is `cost`.
    """

    link: str
    side: str
    old: str
    new: str
    cost: float = 0.0


@dataclass(frozen=True)
class Audit(FlowMessage):
    """src's view of its links with dst: those it sends on and those it receives on."""

    sending: tuple[str, ...]
    receiving: tuple[str, ...]


@dataclass(frozen=True)
class FlowQuery(FlowMessage):
    """Ask a same-stage peer for its units (Request Change / Redirect discovery)."""


@dataclass(frozen=True)
class ReportedUnit:
    """One unit in a FlowReport; `cont` is the downstream's cost to the sink."""

    sink: str
    upstream: str
    in_link: str
    downstream: str
    out_link: str
    cont: float
    d_up: float
    d_down: float


@dataclass(frozen=True)
class FlowReport(FlowMessage):
    """src's units and its edge costs to the next stage."""

    stage: int
    free: int
    units: tuple[ReportedUnit, ...]
    next_costs: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class ChangeRequest(FlowMessage):
    """Request Change: swap src's unit on `link_a` (to `next_a`) with dst's on `link_b` (to `next_b`)."""

    req: int
    sink: str
    link_a: str
    next_a: str
    cont_a: float
    link_b: str
    next_b: str
    delta: float
    d_a_old: float
    d_a_new: float


@dataclass(frozen=True)
class ChangeReply(FlowMessage):
    req: int
    accepted: bool
    cont_b: float = 0.0


@dataclass(frozen=True)
class RedirectRequest(FlowMessage):
    """Request Redirect: move dst's unit upstream -> dst -> downstream onto src."""

    req: int
    in_link: str
    upstream: str
    out_link: str
    downstream: str
    d_up: float
    d_down: float
    delta: float


@dataclass(frozen=True)
class RedirectReply(FlowMessage):
    req: int
    accepted: bool
    sink: str = ""
    cont: float = 0.0


MESSAGE_TYPES: dict[str, type[FlowMessage]] = {
    cls.__name__: cls
    for cls in (
        Offer, RequestFlow, Approve, Reject, CostUpdate, Release, Deny, Rewire, Audit,
        FlowQuery, FlowReport, ChangeRequest, ChangeReply, RedirectRequest, RedirectReply,
    )
}


def to_wire(msg: FlowMessage) -> dict:
    """A tree of str/int/float/bool/lists that `core.serialization.encode` accepts."""
    body = asdict(msg)
    body.pop("src")
    body.pop("dst")
    return {"type": type(msg).__name__, "body": body}


def from_wire(data: object, src: str, dst: str) -> FlowMessage:
    """Rebuild a message a peer sent; anything malformed raises RemoteError against `src`."""

    def bad(detail: str) -> RemoteError:
        return RemoteError(Evidence(src, "malformed", f"flow message: {detail}"))

    if not isinstance(data, dict) or not isinstance(data.get("body"), dict):
        raise bad("not a dict with a body")
    cls = MESSAGE_TYPES.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise bad(f"unknown type {data.get('type')!r}")
    body = dict(data["body"])
    names = [f.name for f in fields(cls) if f.name not in ("src", "dst")]
    if set(body) - set(names):
        raise bad(f"unexpected fields {sorted(set(body) - set(names))}")
    if cls is FlowReport and isinstance(body.get("units"), (list, tuple)):
        try:
            body["units"] = tuple(ReportedUnit(**u) for u in body["units"])
        except TypeError as exc:
            raise bad(f"bad unit: {exc}") from None
    for key, value in list(body.items()):
        if isinstance(value, (list, tuple)):
            body[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    try:
        msg = cls(src=src, dst=dst, **body)
    except TypeError as exc:
        raise bad(str(exc)) from None
    _validate(msg)
    return msg


def _validate(msg: FlowMessage) -> None:
    """Type and range checks of a received message; RemoteError against the sender."""

    def bad(detail: str) -> RemoteError:
        return RemoteError(Evidence(msg.src, "malformed", f"{type(msg).__name__}: {detail}"))

    for f in fields(msg):
        value = getattr(msg, f.name)
        want = f.type if isinstance(f.type, str) else f.type.__name__
        if want == "str" and not isinstance(value, str):
            raise bad(f"{f.name} is not a string")
        if want == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad(f"{f.name} is not an int")
        if want == "bool" and not isinstance(value, bool):
            raise bad(f"{f.name} is not a bool")
        if want.startswith("tuple") and not isinstance(value, tuple):
            raise bad(f"{f.name} is not a list")
        if want == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{f.name} is not a finite number")
            if value < 0 and not (f.name in ("delta",) or (isinstance(msg, Reject) and value == -1)):
                raise bad(f"{f.name} is negative")
    if isinstance(msg, Offer):
        for entry in msg.entries:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], (int, float)) and math.isfinite(entry[1]) and entry[1] >= 0
                    and isinstance(entry[2], int) and entry[2] >= 0):
                raise bad(f"bad entry {entry!r}")
    if isinstance(msg, FlowReport):
        for unit in msg.units:
            if not isinstance(unit, ReportedUnit):
                raise bad("units must be ReportedUnit")
            if not all(isinstance(getattr(unit, n), str) for n in ("sink", "upstream", "in_link", "downstream", "out_link")):
                raise bad("unit ids must be strings")
            for name in ("cont", "d_up", "d_down"):
                v = getattr(unit, name)
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise bad(f"unit {name} is not a finite non-negative number")
        for entry in msg.next_costs:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], (int, float)) and math.isfinite(entry[1]) and entry[1] >= 0):
                raise bad(f"bad next cost {entry!r}")
    if isinstance(msg, Audit):
        if not all(isinstance(x, str) for x in msg.sending + msg.receiving):
            raise bad("links must be strings")
    if isinstance(msg, Rewire) and msg.side not in ("up", "down"):
        raise bad(f"side {msg.side!r}")


# ---------------------------------------------------------------- node state


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
class _Unit:
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
class _Pending:
    kind: str  # flow | attach | switch | change | redirect
    peer: str
    sink: str
    uid: int
    born: int
    extra: dict = field(default_factory=dict)


class FlowNode:
    """One peer's share of the GWTF flow algorithm (a data node if `stage` is None)."""

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
        self.temperature = config.temperature
        # The cost that `temperature` and `min_gain` are expressed in: 1 for unit-free costs (the benches'
        # graphs); the runtime sets it to its mean measured edge cost, so that T=1.7 means the same
        # relative worsening whether costs are in seconds or milliseconds.
        self.cost_unit = 1.0
        self.accepted_moves = 0
        self.optimising = True  # False pauses Request Change / Redirect (routes stay put during training)
        self._stages: dict[str, int] = {}
        self._costs: dict[str, float] = {}
        self._units: dict[int, _Unit] = {}
        self._pending: dict[int, _Pending] = {}
        self._offers: dict[str, dict[str, tuple[float, int]]] = {}
        self._sent_offers: dict[str, tuple] = {}
        self._reports: dict[str, FlowReport] = {}
        self._now = 0
        self._counter = 0
        self._nonce = f"{rng.getrandbits(32):08x}"
        self._phase = rng.randrange(config.audit_every)

    # ------------------------------------------------------------ views

    @property
    def units(self) -> tuple[Unit, ...]:
        return tuple(
            Unit(u.sink, u.kind, u.upstream, u.in_link, u.downstream, u.out_link, self._cost(u))
            for u in sorted(self._units.values(), key=lambda u: u.uid)
        )

    @property
    def stable(self) -> bool:
        """No pending request and no unit waiting for a next hop."""
        return not self._pending and not any(u.kind == "relay" and u.downstream is None for u in self._units.values())

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

    def _cost(self, u: _Unit) -> float:
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

    def _unit_by(self, attr: str, link: str, peer: str) -> _Unit | None:
        for u in self._units.values():
            if getattr(u, attr) == link and getattr(u, "upstream" if attr == "in_link" else "downstream") == peer:
                return u
        return None

    def _drop_pending(self, req: int) -> _Pending | None:
        p = self._pending.pop(req, None)
        if p is not None:
            for u in self._units.values():
                if u.locked == req:
                    u.locked = 0
        return p

    def _lose_downstream(self, u: _Unit) -> list[FlowMessage]:
        u.downstream, u.out_link, u.cont, u.idle, u.age = None, None, 0.0, 0, 0
        return []

    def _lose_upstream(self, u: _Unit) -> None:
        u.upstream, u.in_link, u.age = None, None, 0

    def _cleanup(self) -> None:
        for u in list(self._units.values()):
            if u.locked:
                continue
            dead = (u.kind == "relay" and u.upstream is None and u.downstream is None) or (
                u.kind == "source" and u.downstream is None) or (u.kind == "sink" and u.upstream is None)
            if dead:
                del self._units[u.uid]

    def _upstream_update(self, u: _Unit, before: float) -> list[FlowMessage]:
        after = self._cost(u)
        if u.upstream is None or (math.isfinite(before) and abs(after - before) <= _TOL) or not math.isfinite(after):
            return []
        return [CostUpdate(self.peer, u.upstream, u.in_link, after)]

    def _accept(self, delta: float) -> bool:
        """Simulated annealing: improvements always, worsening with prob exp(-delta/T)."""
        if delta < -self._min_gain():
            return True
        if self.temperature <= 0 or delta <= self._min_gain():
            return False
        return math.exp(-delta / (self.temperature * self.cost_unit)) > self.rng.random()

    def _min_gain(self) -> float:
        return self.config.min_gain * self.cost_unit

    def _cooled(self) -> None:
        self.temperature *= self.config.cooling
        self.accepted_moves += 1

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

    def _avail(self, peer: str, sink: str) -> int:
        entry = self._offers.get(peer, {}).get(sink)
        if entry is None:
            return 0
        asked = sum(1 for p in self._pending.values() if p.peer == peer and p.sink == sink and p.kind != "change"
                    and p.kind != "redirect")
        return entry[1] - asked

    def _best_offer(self, sink: str, avoid: str | None = None) -> tuple[float, str, float] | None:
        best = None
        for p in self._peers_at(self._next_stage()):
            entry = self._offers.get(p, {}).get(sink)
            if entry is None or self._avail(p, sink) <= 0 or p == avoid:
                continue
            cand = (self._costs[p] + entry[0], p, entry[0])
            if best is None or cand < best:
                best = cand
        return best

    def _request(self, kind: str, peer: str, sink: str, offered: float, uid: int = 0, replaces: str = "") -> RequestFlow:
        req = self._new_id()
        self._pending[req] = _Pending(kind, peer, sink, uid, self._now)
        if uid:
            self._units[uid].locked = req
        return RequestFlow(self.peer, peer, req, sink, offered, replaces)

    # ------------------------------------------------------------ tick

    def tick(self) -> list[FlowMessage]:
        """One round: expire, repair, request, optimise, audit."""
        self._now += 1
        out: list[FlowMessage] = []
        for req, p in list(self._pending.items()):
            if self._now - p.born > self.config.pending_timeout:
                self._drop_pending(req)
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
                out += self._optimise()
        self._cleanup()
        out += self._offer_messages(force=self._now % self.config.offer_every == self._phase % self.config.offer_every)
        if self._now % self.config.audit_every == self._phase:
            out += self._audits()
        return out

    def _tick_source(self) -> list[FlowMessage]:
        out: list[FlowMessage] = []
        have = sum(1 for u in self._units.values() if u.kind == "source")
        asking = sum(1 for p in self._pending.values() if p.kind == "flow")
        for _ in range(self.demand - have - asking):
            best = self._best_offer(self.peer)
            if best is None:
                break
            out.append(self._request("flow", best[1], self.peer, best[2]))
        return out + self._switches()

    def _repair_inflows(self, count: bool = True) -> list[FlowMessage]:
        """Units with a sender but no next hop ask for one; after `deny_after` ticks they DENY upstream."""
        out: list[FlowMessage] = []
        for u in sorted(self._units.values(), key=lambda u: u.uid):
            if u.kind != "relay" or u.downstream is not None or u.upstream is None or u.locked:
                continue
            u.idle += count
            best = self._best_offer(u.sink)
            if best is not None and u.idle <= self.config.deny_after:
                out.append(self._request("attach", best[1], u.sink, best[2], uid=u.uid))
            elif u.idle > (self.config.deny_after if best is not None else 2):
                out.append(Deny(self.peer, u.upstream, u.in_link))
                del self._units[u.uid]
        return out

    def _switches(self) -> list[FlowMessage]:
        """Move a unit to a cheaper advertised unpaired outflow (paired units first)."""
        out: list[FlowMessage] = []
        order = sorted(self._units.values(), key=lambda u: (u.upstream is None, -self._cost(u), u.uid))
        for u in order:
            if u.kind == "sink" or u.downstream is None or u.locked or (u.kind == "relay" and u.upstream is None):
                continue
            best = self._best_offer(u.sink)
            if best is not None and best[0] < self._cost(u) - max(self._min_gain(), _TOL):
                out.append(self._request("switch", best[1], u.sink, best[2], uid=u.uid, replaces=u.out_link))
        return out

    def _new_flows(self) -> list[FlowMessage]:
        out: list[FlowMessage] = []
        for _ in range(self._free()):
            counts: dict[str, int] = {}
            for u in self._units.values():
                counts[u.sink] = counts.get(u.sink, 0) + 1
            for p in self._pending.values():
                if p.kind == "flow":
                    counts[p.sink] = counts.get(p.sink, 0) + 1
            choices = []
            for sink in sorted({s for o in self._offers.values() for s in o}):
                best = self._best_offer(sink)
                if best is not None:
                    choices.append((counts.get(sink, 0), best[0], sink, best))
            if not choices:
                break
            _, _, sink, best = min(choices)
            out.append(self._request("flow", best[1], sink, best[2]))
        return out

    def _audits(self) -> list[FlowMessage]:
        sending: dict[str, list[str]] = {}
        receiving: dict[str, list[str]] = {}
        for u in self._units.values():
            if u.age < self.config.pending_timeout:
                continue
            if u.downstream is not None and u.out_link is not None:
                sending.setdefault(u.downstream, []).append(u.out_link)
            if u.upstream is not None and u.in_link is not None:
                receiving.setdefault(u.upstream, []).append(u.in_link)
        return [Audit(self.peer, p, tuple(sorted(sending.get(p, []))), tuple(sorted(receiving.get(p, []))))
                for p in sorted(set(sending) | set(receiving))]

    # ------------------------------------------------------------ optimisation (Change / Redirect)

    def _optimise(self) -> list[FlowMessage]:
        if not self.stable or not self.optimising:
            return []
        out: list[FlowMessage] = []
        if self._reports:
            move = self._choose_move()
            self._reports = {}
            if move is not None:
                out.append(move)
        if (self._now + self._phase) % self.config.query_every == 0:
            out += [FlowQuery(self.peer, p) for p in self._peers_at(self.stage)]
        return out

    def _objective_delta(self, old: tuple[float, ...], new: tuple[float, ...]) -> float:
        if self.config.objective == "max":
            return max(new) - max(old)
        return sum(new) - sum(old)

    def _choose_move(self) -> FlowMessage | None:
        moves: list[tuple[float, int, FlowMessage]] = []
        k = 0
        nexts = set(self._peers_at(self._next_stage()))
        prevs = set(self._peers_at(self._prev_stage()))
        free = self._free()
        for peer in sorted(self._reports):
            rep = self._reports[peer]
            if peer not in self._costs:
                continue
            their_next = dict(rep.next_costs)
            for ru in rep.units:
                if not ru.upstream:
                    continue
                if free > 0 and ru.upstream in prevs and ru.downstream in nexts:
                    d_up, d_down = self._costs[ru.upstream], self._costs[ru.downstream]
                    delta = self._objective_delta((ru.d_up, ru.d_down), (d_up, d_down))
                    k += 1
                    moves.append((delta, k, RedirectRequest(self.peer, peer, 0, ru.in_link, ru.upstream, ru.out_link,
                                                             ru.downstream, d_up, d_down, delta)))
                for u in self._units.values():
                    if (u.kind != "relay" or u.upstream is None or u.downstream is None or u.locked
                            or u.sink != ru.sink or u.downstream == ru.downstream or ru.downstream not in nexts
                            or u.downstream not in their_next):
                        continue
                    a_old, a_new = self._costs[u.downstream], self._costs[ru.downstream]
                    b_old, b_new = ru.d_down, their_next[u.downstream]
                    delta = self._objective_delta((a_old, b_old), (a_new, b_new))
                    k += 1
                    moves.append((delta, k, ChangeRequest(self.peer, peer, 0, u.sink, u.out_link, u.downstream, u.cont,
                                                          ru.out_link, ru.downstream, delta, a_old, a_new)))
        if not moves:
            return None
        best = min(moves, key=lambda m: (m[0], m[1]))
        if best[0] >= -self._min_gain():
            ups = [m for m in moves if m[0] > self._min_gain()]
            if not ups:
                return None
            best = ups[self.rng.randrange(len(ups))]
        if not self._accept(best[0]):
            return None
        return self._send_move(best[2])

    def _send_move(self, msg: FlowMessage) -> FlowMessage:
        req = self._new_id()
        if isinstance(msg, ChangeRequest):
            u = next(u for u in self._units.values() if u.out_link == msg.link_a)
            u.locked = req
            self._pending[req] = _Pending("change", msg.dst, msg.sink, u.uid, self._now, {"msg": msg})
            return ChangeRequest(**{**_fields(msg), "req": req})
        assert isinstance(msg, RedirectRequest)
        self._pending[req] = _Pending("redirect", msg.dst, "", 0, self._now, {"msg": msg})
        return RedirectRequest(**{**_fields(msg), "req": req})

    # ------------------------------------------------------------ handle

    def handle(self, msg: FlowMessage) -> list[FlowMessage]:
        """Apply one received message; returns replies. Malformed input raises RemoteError."""
        if msg.dst != self.peer:
            raise LocalError(f"message for {msg.dst} delivered to {self.peer}")
        _validate(msg)
        claimed = getattr(msg, "stage", None)
        if claimed is not None and msg.src in self._stages and self._stages[msg.src] != claimed:
            raise RemoteError(Evidence(msg.src, "wrong_stage",
                                       f"claims stage {claimed}, serves {self._stages[msg.src]}"))
        handler = getattr(self, f"_on_{type(msg).__name__}")
        out = handler(msg)
        self._cleanup()
        return out + self._offer_messages(force=False)

    def _on_Offer(self, msg: Offer) -> list[FlowMessage]:
        if self._stages.get(msg.src) != self._next_stage():
            return []
        self._offers[msg.src] = {sink: (cost, count) for sink, cost, count in msg.entries}
        if self.is_data:
            return self._tick_source()
        return self._repair_inflows(count=False) + self._new_flows()

    def _on_RequestFlow(self, msg: RequestFlow) -> list[FlowMessage]:
        if self._stages.get(msg.src) != self._prev_stage():
            return [Reject(self.peer, msg.src, msg.req, msg.sink, -1.0)]
        if self.is_data:
            if msg.sink != self.peer or sum(1 for u in self._units.values() if u.kind == "sink") >= self._grants():
                return [Reject(self.peer, msg.src, msg.req, msg.sink, -1.0)]
            link = self._new_link()
            uid = self._new_id()
            self._units[uid] = _Unit(uid, self.peer, "sink", upstream=msg.src, in_link=link)
            return [Approve(self.peer, msg.src, msg.req, msg.sink, link, 0.0)]
        free = [u for u in self._units.values() if u.kind == "relay" and u.sink == msg.sink and u.upstream is None
                and u.downstream is not None and not u.locked and math.isfinite(self._cost(u))]
        if not free:
            return [Reject(self.peer, msg.src, msg.req, msg.sink, -1.0)]
        u = min(free, key=lambda u: (self._cost(u), u.uid))
        if self._cost(u) > msg.cost + 1e-6:
            return [Reject(self.peer, msg.src, msg.req, msg.sink, self._cost(u))]
        u.upstream, u.in_link, u.age = msg.src, self._new_link(), 0
        return [Approve(self.peer, msg.src, msg.req, msg.sink, u.in_link, self._cost(u))]

    def _on_Approve(self, msg: Approve) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        if p is None or p.peer != msg.src or p.kind not in ("flow", "attach", "switch") or msg.src not in self._costs:
            return [Release(self.peer, msg.src, msg.link)]
        self._drop_pending(msg.req)
        out: list[FlowMessage] = []
        if p.kind == "flow":
            uid = self._new_id()
            kind = "source" if self.is_data else "relay"
            self._units[uid] = _Unit(uid, p.sink, kind, downstream=msg.src, out_link=msg.link, cont=msg.cost)
            return out
        u = self._units.get(p.uid)
        if u is None:
            return [Release(self.peer, msg.src, msg.link)]
        before = self._cost(u)
        if u.downstream is not None and u.out_link is not None:
            out.append(Release(self.peer, u.downstream, u.out_link))
        u.downstream, u.out_link, u.cont, u.age, u.idle = msg.src, msg.link, msg.cost, 0, 0
        return out + self._upstream_update(u, math.inf if p.kind == "attach" else before)

    def _on_Reject(self, msg: Reject) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        if p is None or p.peer != msg.src:
            return []
        self._drop_pending(msg.req)
        offers = self._offers.setdefault(msg.src, {})
        if msg.cost < 0:
            offers.pop(msg.sink, None)
        elif msg.sink in offers:
            offers[msg.sink] = (msg.cost, offers[msg.sink][1])
        if self.is_data:
            return self._tick_source()
        return self._repair_inflows(count=False) + self._new_flows()

    def _on_CostUpdate(self, msg: CostUpdate) -> list[FlowMessage]:
        u = self._unit_by("out_link", msg.link, msg.src)
        if u is None:
            return []
        before = self._cost(u)
        u.cont = msg.cost
        return self._upstream_update(u, before)

    def _on_Release(self, msg: Release) -> list[FlowMessage]:
        u = self._unit_by("in_link", msg.link, msg.src)
        if u is not None:
            self._lose_upstream(u)
        return []

    def _on_Deny(self, msg: Deny) -> list[FlowMessage]:
        u = self._unit_by("out_link", msg.link, msg.src)
        if u is not None:
            return self._lose_downstream(u)
        return []

    def _on_Rewire(self, msg: Rewire) -> list[FlowMessage]:
        if msg.side == "up":
            u = self._unit_by("in_link", msg.link, msg.old)
            if u is None or self._stages.get(msg.new) != self._prev_stage():
                return [Deny(self.peer, msg.new, msg.link)]
            u.upstream, u.age = msg.new, 0
            cost = self._cost(u)
            return [CostUpdate(self.peer, msg.new, msg.link, cost)] if math.isfinite(cost) else []
        u = self._unit_by("out_link", msg.link, msg.old)
        if u is None or msg.new not in self._costs or self._stages.get(msg.new) != self._next_stage():
            return [Release(self.peer, msg.new, msg.link)]
        before = self._cost(u)
        u.downstream, u.cont, u.age = msg.new, msg.cost, 0
        return self._upstream_update(u, before)

    def _on_Audit(self, msg: Audit) -> list[FlowMessage]:
        out: list[FlowMessage] = []
        for link in msg.sending:  # src thinks it sends to us on link
            if self._unit_by("in_link", link, msg.src) is None and not self._recent(link):
                out.append(Deny(self.peer, msg.src, link))
        for link in msg.receiving:  # src thinks we send to it on link
            if self._unit_by("out_link", link, msg.src) is None and not self._recent(link):
                out.append(Release(self.peer, msg.src, link))
        return out

    def _recent(self, link: str) -> bool:
        """A link touched by a request still in flight (do not judge it yet)."""
        for p in self._pending.values():
            m = p.extra.get("msg")
            if m is not None and link in (getattr(m, "link_a", None), getattr(m, "link_b", None),
                                          getattr(m, "in_link", None), getattr(m, "out_link", None)):
                return True
        return False

    def _on_FlowQuery(self, msg: FlowQuery) -> list[FlowMessage]:
        if self.is_data or self._stages.get(msg.src) != self.stage:
            return []
        units = tuple(
            ReportedUnit(u.sink, u.upstream or "", u.in_link or "", u.downstream, u.out_link, u.cont,
                         self._costs.get(u.upstream, 0.0) if u.upstream else 0.0, self._costs[u.downstream])
            for u in sorted(self._units.values(), key=lambda u: u.uid)
            if u.kind == "relay" and u.downstream is not None and u.downstream in self._costs and not u.locked
        )
        nexts = tuple((p, self._costs[p]) for p in self._peers_at(self._next_stage()))
        return [FlowReport(self.peer, msg.src, self.stage, self._free(), units, nexts)]

    def _on_FlowReport(self, msg: FlowReport) -> list[FlowMessage]:
        if not self.is_data and self._stages.get(msg.src) == self.stage:
            self._reports[msg.src] = msg
        return []

    def _on_ChangeRequest(self, msg: ChangeRequest) -> list[FlowMessage]:
        no = [ChangeReply(self.peer, msg.src, msg.req, False)]
        if self.is_data or self._stages.get(msg.src) != self.stage or msg.next_a not in self._costs:
            return no
        u = self._unit_by("out_link", msg.link_b, msg.next_b)
        if u is not None and u.locked and self._yields_to(u.locked, msg.src):
            self._drop_pending(u.locked)  # we asked each other at once: the smaller peer id's request goes first
        if u is None or u.locked or u.sink != msg.sink or u.upstream is None or msg.next_b not in self._costs:
            return no
        b_old, b_new = self._costs[msg.next_b], self._costs[msg.next_a]
        delta = self._objective_delta((msg.d_a_old, b_old), (msg.d_a_new, b_new))
        if delta > msg.delta + 1e-6:
            return no
        before = self._cost(u)
        cont_b = u.cont
        u.downstream, u.out_link, u.cont, u.age = msg.next_a, msg.link_a, msg.cont_a, 0
        out: list[FlowMessage] = [
            ChangeReply(self.peer, msg.src, msg.req, True, cont_b),
            Rewire(self.peer, msg.next_a, msg.link_a, "up", msg.src, self.peer),
        ]
        return out + self._upstream_update(u, before)

    def _yields_to(self, req: int, peer: str) -> bool:
        """Whether my pending request `req` is a Change sent to `peer` while `peer` sent me one (each
        locked its own unit and would refuse the other's, every round, forever): the larger id yields."""
        p = self._pending.get(req)
        return p is not None and p.kind == "change" and p.peer == peer and peer < self.peer

    def _on_ChangeReply(self, msg: ChangeReply) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        if p is None or p.peer != msg.src or p.kind != "change":
            return []
        self._drop_pending(msg.req)
        if not msg.accepted:
            return []
        req: ChangeRequest = p.extra["msg"]
        self._cooled()
        u = self._units.get(p.uid)
        if u is None or req.next_b not in self._costs:
            return [Release(self.peer, req.next_b, req.link_b)]
        before = self._cost(u)
        u.downstream, u.out_link, u.cont, u.age = req.next_b, req.link_b, msg.cont_b, 0
        out: list[FlowMessage] = [Rewire(self.peer, req.next_b, req.link_b, "up", msg.src, self.peer)]
        return out + self._upstream_update(u, before)

    def _on_RedirectRequest(self, msg: RedirectRequest) -> list[FlowMessage]:
        no = [RedirectReply(self.peer, msg.src, msg.req, False)]
        if self.is_data or self._stages.get(msg.src) != self.stage:
            return no
        u = self._unit_by("in_link", msg.in_link, msg.upstream)
        if u is None or u.locked or u.out_link != msg.out_link or u.downstream != msg.downstream:
            return no
        mine = (self._costs.get(msg.upstream, math.inf), self._costs.get(msg.downstream, math.inf))
        delta = self._objective_delta(mine, (msg.d_up, msg.d_down))
        if not math.isfinite(delta) or delta > msg.delta + 1e-6:
            return no
        del self._units[u.uid]
        return [
            RedirectReply(self.peer, msg.src, msg.req, True, u.sink, u.cont),
            Rewire(self.peer, msg.upstream, msg.in_link, "down", self.peer, msg.src, msg.d_down + u.cont),
            Rewire(self.peer, msg.downstream, msg.out_link, "up", self.peer, msg.src),
        ]

    def _on_RedirectReply(self, msg: RedirectReply) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        if p is None or p.peer != msg.src or p.kind != "redirect":
            return []
        self._drop_pending(msg.req)
        if not msg.accepted:
            return []
        req: RedirectRequest = p.extra["msg"]
        self._cooled()
        uid = self._new_id()
        self._units[uid] = _Unit(uid, msg.sink, "relay", upstream=req.upstream, in_link=req.in_link,
                                 downstream=req.downstream, out_link=req.out_link, cont=msg.cont)
        return []


def _fields(msg: FlowMessage) -> dict:
    return {f.name: getattr(msg, f.name) for f in fields(msg)}


# ---------------------------------------------------------------- synchronous driver


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

    def _follow(self, data: str, start: _Unit) -> tuple[list[str] | None, float]:
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
