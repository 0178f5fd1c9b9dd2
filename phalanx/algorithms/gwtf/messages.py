"""The flow algorithm's messages, their wire form, and the checks a received one must pass.

Every message names its sender and receiver; `from_wire` / `validate` turn a peer's malformed
message into evidence against that peer (RemoteError), never a crash.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ...core.errors import Evidence, RemoteError

DATA = -1  # the stage number data nodes use in messages


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


@dataclass(frozen=True)
class HandoverQuery(FlowMessage):
    """Down a chain: would the chain on `link` cost less returning to data node `new` instead of `old`?
    `delta` is the change of its first hop's cost (see `handover`)."""

    link: str
    old: str
    new: str
    delta: float


@dataclass(frozen=True)
class Handover(FlowMessage):
    """Up a chain, the answer to a HandoverQuery: if `done`, the chain on `link` now returns to `sink`,
    and src's cost to it is `cost`; else nothing changed (unlock), and `sink` names the data node that
    had no free grant ("" if the chain would not cost less)."""

    link: str
    sink: str
    cost: float
    done: bool


@dataclass(frozen=True)
class HandoverAck(FlowMessage):
    """Down a chain: src took the `Handover(done)` for the unit on `link` (until then dst's link to src
    may join units that return to different data nodes, and dst breaks it if no ack comes)."""

    link: str


MESSAGE_TYPES: dict[str, type[FlowMessage]] = {
    cls.__name__: cls
    for cls in (
        Offer, RequestFlow, Approve, Reject, CostUpdate, Release, Deny, Rewire, Audit,
        FlowQuery, FlowReport, ChangeRequest, ChangeReply, RedirectRequest, RedirectReply, HandoverQuery, Handover,
        HandoverAck,
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
    validate(msg)
    return msg


def validate(msg: FlowMessage) -> None:
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
