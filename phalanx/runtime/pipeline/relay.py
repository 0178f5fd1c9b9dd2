"""A relay: serves one stage for as long as it lives; everything it does is a reaction to messages.

It also relays the leader's utilization query (GWTF V-B): the first copy of a
period opens a short window in which copies from other previous-stage peers
are merged; then the relay adds its own (stage, capacity, microbatches served
in that iteration) and forwards the merged query to the next stage (the last
stage returns it to the leader). A joining relay first asks the leader for a
stage (`ask_for_stage`: refused when its identity is banned), then downloads that
stage's weights (`enter`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ...algorithms.gwtf.placement import UtilQuery, flood_step, leader
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, encode
from ...transport.base import Transport
from . import messages as m
from .node import PipelineNode


class Relay(PipelineNode):
    """A relay node; `serve()` keeps it alive until `stop()`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._util: dict[int, dict[str, tuple[int, int, int]]] = {}
        self.transport.add_message_handler(m.UTIL, self._on_util)

    async def serve(self) -> None:
        self.start_background()
        await self._stopped.wait()

    def _on_util(self, sender: str, payload: bytes) -> None:
        query = parse_util(payload, sender, self.transport)
        if self.directory.get(sender) != self.stage - 1:
            return  # our views of its stage differ (a move not yet seen here): not evidence
        first = query.period not in self._util
        merged = self._util.setdefault(query.period, {})
        for peer, stage, capacity, flow in query.entries:
            merged[peer] = (stage, capacity, flow)
        for old in [p for p in self._util if p < query.period - 2]:
            del self._util[old]
        if first:
            self.spawn(self._forward_util(query.leader, query.period))

    async def _forward_util(self, lead: str, period: int) -> None:
        await asyncio.sleep(self.config.complete_timeout / 20)  # let copies from other upstream peers arrive
        entries = tuple(sorted((p, *v) for p, v in self._util.get(period, {}).items()))
        nxt = self.live(self.stage + 1) if self.stage < self.last else [lead]
        query = UtilQuery(self.me, "", lead, period, entries)
        served = self.served if self.version == period else self.last_served
        for out in flood_step(query, self.me, self.stage - 1, self.capacity, served, nxt):
            await self.transport.send(out.dst, m.UTIL, util_bytes(out))


def util_bytes(query: UtilQuery) -> bytes:
    return encode({"leader": query.leader, "period": query.period, "entries": [list(e) for e in query.entries]})


def parse_util(payload: bytes, sender: str, transport: Transport) -> UtilQuery:
    obj = m.parse_mapping(payload, sender, transport.limits, "utilization query")
    lead, period, entries = obj.get("leader"), obj.get("period"), obj.get("entries")
    ok = (
        isinstance(lead, str) and type(period) is int and isinstance(entries, list) and len(entries) <= 100_000
        and all(isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
                and all(type(v) is int and v >= 0 for v in e[1:]) for e in entries)
    )
    if not ok:
        raise RemoteError(Evidence(sender, "malformed", "bad utilization query"))
    return UtilQuery(sender, transport.peer_id, lead, period, tuple(tuple(e) for e in entries))


@dataclass(frozen=True)
class Placement:
    """Where a joiner serves: its stage, the iteration under way, and the leader's stage directory and
    bans, which the joiner starts from instead of its own stale (or empty) ones."""

    stage: int
    it: int
    directory: dict[str, int]
    banned: frozenset[str]


class JoinRefused(PhalanxError):
    """A data node refused this joiner: its identity is banned."""


async def ask_for_stage(transport: Transport, directory: dict[str, int], capacity: int,
                        timeout: float) -> Placement | None:
    """A joiner asks the leader (then the other data nodes) where to serve; None when none answers or no
    stage can take it (stage 0). Raises JoinRefused when a data node refuses its (banned) identity."""
    members = set(transport.members())
    data_nodes = sorted(p for p, s in directory.items() if s == 0 and p in members)
    if not data_nodes:
        return None
    first = leader(data_nodes)
    for node in [first, *[d for d in data_nodes if d != first]]:
        try:
            response = await transport.request(node, m.JOIN, encode({"capacity": capacity}), timeout)
            obj = decode(response, node, transport.limits)
        except RemoteError as exc:
            transport.report(exc.evidence)
            continue
        except PhalanxError:
            continue
        if isinstance(obj, dict) and obj.get("refused") is True:
            raise JoinRefused(f"data node {node[:8]} refused this joiner: its identity is banned")
        if isinstance(obj, dict) and type(obj.get("stage")) is int and type(obj.get("it")) is int and obj["stage"] >= 1:
            known, banned = obj.get("directory", {}), obj.get("banned", [])
            if not (isinstance(known, dict) and all(isinstance(p, str) and type(s) is int and s >= 0
                                                    for p, s in known.items())
                    and isinstance(banned, list) and all(isinstance(p, str) for p in banned)):
                transport.report(Evidence(node, "malformed", "join answer with a bad directory"))
                continue
            return Placement(obj["stage"], obj["it"], {**directory, **known}, frozenset(banned))
    return None
