"""Request Flow (GWTF Sec. IV): building pipelines back to front, and keeping their links consistent.

A sink grants up to its demand, a node with an *unpaired outflow* (a path to a sink but no sender)
advertises it to the previous stage with its cost to the sink (`Offer`), and a node with free capacity
or an *unpaired inflow* (a sender but no path) asks the neighbour that minimises d(i, j) + cost_j.
Costs to each sink flow back stage by stage (`CostUpdate`).

Departures from the paper, where it is silent or loose:
- a unit may also *switch* its next hop to a cheaper advertised unpaired outflow (Request Flow with
  `replaces`), releasing the old link; this lets capacity held by flows that never reached a source be
  reused;
- every link change is told to both ends; an end that does not recognise a link answers with
  `Release` / `Deny`, and each node audits its links with its neighbours every `audit_every` ticks, so
  races between concurrent moves heal instead of leaking capacity.
"""

from __future__ import annotations

import math

from .messages import (
    Approve,
    Audit,
    CostUpdate,
    Deny,
    FlowMessage,
    Offer,
    Reject,
    Release,
    RequestFlow,
    Rewire,
)
from .state import TOL, FlowState, Pending, UnitState


class RequestFlowRules(FlowState):
    """Request Flow, switches, repairs of unpaired inflows, and link audits."""

    def _avail(self, peer: str, sink: str) -> int:
        entry = self._offers.get(peer, {}).get(sink)
        if entry is None:
            return 0
        asked = sum(1 for p in self._pending.values() if p.peer == peer and p.sink == sink
                    and p.kind in ("flow", "attach", "switch"))
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
        self._pending[req] = Pending(kind, peer, sink, uid, self._now)
        if uid:
            self._units[uid].locked = req
        return RequestFlow(self.peer, peer, req, sink, offered, replaces)

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
            if best is not None and best[0] < self._cost(u) - max(self.annealing.min_gain(), TOL):
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
            self._units[uid] = UnitState(uid, self.peer, "sink", upstream=msg.src, in_link=link)
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
            self._units[uid] = UnitState(uid, p.sink, kind, downstream=msg.src, out_link=msg.link, cont=msg.cost)
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
