"""Request Change and Request Redirect (GWTF Sec. V-A): a node improves its stage's flows with its peers.

Once a node cannot request flow it queries its stage peers for their units (`FlowQuery` /
`FlowReport`): Request Change swaps the next hops of two units towards the same sink, Request
Redirect moves a peer's unit i -> j -> k onto itself (i -> me -> k). A move that worsens the objective
is still proposed as simulated annealing allows (`annealing`).
"""

from __future__ import annotations

import math
from dataclasses import fields

from .costs import objective_delta
from .messages import (
    ChangeReply,
    ChangeRequest,
    FlowMessage,
    FlowQuery,
    FlowReport,
    RedirectReply,
    RedirectRequest,
    Release,
    ReportedUnit,
    Rewire,
)
from .state import FlowState, Pending, UnitState


class MoveRules(FlowState):
    """Request Change / Redirect: discovery, choice, and both ends of each move."""

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
                    delta = objective_delta(self.config.objective, (ru.d_up, ru.d_down), (d_up, d_down))
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
                    delta = objective_delta(self.config.objective, (a_old, b_old), (a_new, b_new))
                    k += 1
                    moves.append((delta, k, ChangeRequest(self.peer, peer, 0, u.sink, u.out_link, u.downstream, u.cont,
                                                          ru.out_link, ru.downstream, delta, a_old, a_new)))
        if not moves:
            return None
        best = min(moves, key=lambda m: (m[0], m[1]))
        if best[0] >= -self.annealing.min_gain():
            ups = [m for m in moves if m[0] > self.annealing.min_gain()]
            if not ups:
                return None
            best = ups[self.rng.randrange(len(ups))]
        if not self.annealing.accept(best[0], self.rng):
            return None
        return self._send_move(best[2])

    def _send_move(self, msg: FlowMessage) -> FlowMessage:
        req = self._new_id()
        if isinstance(msg, ChangeRequest):
            u = next(u for u in self._units.values() if u.out_link == msg.link_a)
            u.locked = req
            self._pending[req] = Pending("change", msg.dst, msg.sink, u.uid, self._now, {"msg": msg})
            return ChangeRequest(**{**fields_of(msg), "req": req})
        assert isinstance(msg, RedirectRequest)
        self._pending[req] = Pending("redirect", msg.dst, "", 0, self._now, {"msg": msg})
        return RedirectRequest(**{**fields_of(msg), "req": req})

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
        delta = objective_delta(self.config.objective, (msg.d_a_old, b_old), (msg.d_a_new, b_new))
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
        self.annealing.cooled()
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
        delta = objective_delta(self.config.objective, mine, (msg.d_up, msg.d_down))
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
        self.annealing.cooled()
        uid = self._new_id()
        self._units[uid] = UnitState(uid, msg.sink, "relay", upstream=req.upstream, in_link=req.in_link,
                                 downstream=req.downstream, out_link=req.out_link, cont=msg.cont)
        return []



def fields_of(msg: FlowMessage) -> dict:
    return {f.name: getattr(msg, f.name) for f in fields(msg)}
