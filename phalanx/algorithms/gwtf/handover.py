"""Handover: a chain changes data node, rebalancing sources that share a bottleneck (issue 15 item 4).

Which data node gets a shared bottleneck's capacity is decided while pipelines form, by the order in
which Offers arrive, and Request Change / Redirect never move a unit to another data node (a unit's
path must return home). Yet only a chain's first hop (data node -> stage 0) and last hop (last stage
-> data node) depend on its data node; the relays in between cost the same whoever's microbatch they
carry. So a chain can be handed from data node A to data node B, keeping every relay and its
capacity, and the total cost changes by

    d(B, x0) - d(A, x0) + d(xL, B) - d(xL, A)

where x0 is the chain's stage-0 relay and xL its last-stage relay. x0 knows the first two costs, xL
the last two, and xL also knows from B's Offers whether B has a free sink grant (B is short of
chains). The move, in three steps along the chain:

1. x0 sends `HandoverQuery(old=A, new=B, delta=d(B, x0) - d(A, x0))` down its unit's links; each relay
   locks its unit (no Change, Redirect or switch touches it) and passes it on.
2. xL adds its half. If the sum lowers the cost and B grants a sink unit, xL switches its last link
   from A to B (a Request Flow with `replaces`, which releases A's sink unit); otherwise it answers
   `Handover(done=False)` and the relays unlock; if B had no free grant the answer names B, and x0
   does not ask about B again for a while (with demands the graph meets, nobody is short for long).
3. On B's Approve, xL relabels its unit to B and sends `Handover(done=True)` back up; each relay
   relabels and unlocks; x0 relabels and DENYs A's source link, so that its unit is an unpaired
   outflow towards B, which B (short of chains) takes by Request Flow.

Only improving handovers are made (no annealing), so with fixed costs they end. A data node is
handed a chain only while it is short, so with demands that the graph can meet they do not move.

What a relay accepts: a `Handover` only from the peer it passed a query to, on that query's link, and
`done` only naming the data node it asked about (an answer after the lock expired or was abandoned is
still taken for a grace period); a query only while optimising (no chain is relabelled during an
iteration's microbatches). A relay that loses the next hop of a locked unit, or whose switch to the new
data node times out, unlocks the relays above. A relay that took a `done` acknowledges it
(`HandoverAck`); a relay that sent one and gets no ack breaks that link (DENY), so that a lost or refused
answer does not leave a chain that returns to two data nodes: both halves repair as after any broken link.
"""

from __future__ import annotations

from .messages import DATA, Approve, Deny, FlowMessage, Handover, HandoverAck, HandoverQuery, Reject, Release
from .request_flow import RequestFlowRules
from .state import Pending, UnitState


class HandoverRules(RequestFlowRules):
    """Both ends and the middle of a handover (the head probes; see the module docstring)."""

    def _handover_probe(self) -> list[FlowMessage]:
        """A stage-0 relay asks, for one (unit, other data node) pair at a time in turn, whether the chain
        would cost less as the other data node's; a unit is asked about once its links held for a while."""
        asking = any(p.kind == "handover" for p in self._pending.values())
        if not self.config.handover or self.handovers_ended or self.stage != 0 or not self.optimising or asking:
            return []
        data = self._peers_at(DATA)
        candidates = sorted(
            (self._costs[new] - self._costs[u.sink], u.uid, new)
            for u in self._units.values()
            if u.kind == "relay" and u.upstream == u.sink and u.sink in self._costs and u.downstream is not None
            and not u.locked and u.age >= self.config.pending_timeout
            for new in data if new != u.sink and self._full_until.get(new, 0) <= self._now
        )
        if not candidates:
            return []
        self._handover_turn += 1
        delta, uid, new = candidates[self._handover_turn % len(candidates)]
        u = self._units[uid]
        return self._pass_query(u, HandoverQuery(u.upstream, self.peer, u.in_link, u.sink, new, delta))

    def _on_HandoverQuery(self, msg: HandoverQuery) -> list[FlowMessage]:
        if not self.config.handover:
            return []
        u = self._unit_by("in_link", msg.link, msg.src)
        if (not self.optimising or self.handovers_ended or self.is_data or u is None or u.kind != "relay"
                or u.sink != msg.old or msg.new == msg.old or not self._may_be_data(msg.new) or u.locked
                or u.downstream is None or u.downstream not in self._costs):
            return [Handover(self.peer, msg.src, msg.link, "", 0.0, False)]
        return self._pass_query(u, msg)

    def _pass_query(self, u: UnitState, msg: HandoverQuery) -> list[FlowMessage]:
        """Lock `u` and pass the query on; at the last stage, decide and ask the new data node."""
        if u.downstream != msg.old:
            req = self._new_id()
            self._pending[req] = Pending("handover", u.downstream, msg.old, u.uid, self._now,
                                        {"timeout": self._handover_timeout(), "new": msg.new})
            u.locked = req
            return [HandoverQuery(self.peer, u.downstream, u.out_link, msg.old, msg.new, msg.delta)]
        if self._stages.get(msg.new) != DATA or msg.new not in self._costs:
            return self._unlock_upstream(msg)
        if self._avail(msg.new, msg.new) <= 0:
            return self._unlock_upstream(msg, full=msg.new)
        delta = msg.delta + self._costs[msg.new] - self._costs[msg.old]
        if delta >= -max(self.annealing.min_gain(), 1e-9):
            return self._unlock_upstream(msg)
        request = self._request("switch", msg.new, msg.new, 0.0, uid=u.uid, replaces=u.out_link)
        self._pending[request.req].extra["handover"] = msg
        return [request]

    def _handover_timeout(self) -> int:
        """Ticks a lock is held: the query's round trip along the chain, plus a request's patience."""
        return 2 * (self.num_stages + 1) + self.config.pending_timeout

    def _note_full(self, data: str) -> None:
        """The head learnt that `data` had no free grant: it asks about it again only after a while."""
        if data:
            self._full_until[data] = self._now + 4 * self._handover_timeout()

    def _may_be_data(self, name: str) -> bool:
        """Whether `name` can be a data node: stage 0 and the last stage know them all (their neighbours);
        a relay between knows none, so there it is any name not known to serve a stage."""
        if self.stage in (0, self.num_stages - 1):
            return self._stages.get(name) == DATA
        return self._stages.get(name, DATA) == DATA

    def peer_left(self, peer: str) -> list[FlowMessage]:
        """Handovers through `peer` end before its pending requests go: the relays above are unlocked."""
        out: list[FlowMessage] = []
        for req, p in list(self._pending.items()):
            if p.peer != peer:
                continue
            if p.kind == "handover" and p.uid in self._units:
                out += self._abandon(self._units[p.uid])
            elif "handover" in p.extra:  # the last relay's switch to the new data node
                self._drop_pending(req)
                out += self._unlock_upstream(p.extra["handover"])
        return [m for m in out if m.dst != peer] + super().peer_left(peer)

    def _expire(self, req: int) -> list[FlowMessage]:
        """A pending request timed out. A handover lock is kept a while for a late answer; a last relay
        whose switch got no answer unlocks the relays above (a late Approve is released)."""
        p = self._pending.get(req)
        if p is not None and p.kind == "handover":
            self._retire(req)
            return []
        self._drop_pending(req)
        if p is not None and p.kind == "confirm":  # the relay above did not take the done: break the link
            u = self._units.get(p.uid)
            if u is None or u.upstream != p.peer or u.in_link != p.extra["link"]:
                return []
            out: list[FlowMessage] = [Deny(self.peer, u.upstream, u.in_link)]
            self._lose_upstream(u)
            return out
        return self._unlock_upstream(p.extra["handover"]) if p is not None and "handover" in p.extra else []

    def _retire(self, req: int) -> None:
        """Unlock a handover lock that got no answer; its answer is still taken for one more lock timeout."""
        p = self._drop_pending(req)
        grace = 2 * self._handover_timeout()
        self._late_handovers = {r: q for r, q in self._late_handovers.items() if self._now - q.born <= grace}
        if p is not None:
            self._late_handovers[req] = p

    def _lose_downstream(self, u: UnitState) -> list[FlowMessage]:
        return self._abandon(u) + super()._lose_downstream(u)

    def _lose_upstream(self, u: UnitState) -> None:
        self._abandon(u)
        super()._lose_upstream(u)

    def _abandon(self, u: UnitState) -> list[FlowMessage]:
        """A locked unit lost a link: the handover through it cannot happen; unlock it and the relays above."""
        lock = self._pending.get(u.locked)
        if lock is None or lock.kind != "handover":
            return []
        self._retire(u.locked)
        return [Handover(self.peer, u.upstream, u.in_link, "", 0.0, False)] if self._probed_by(u) else []

    def _on_Approve(self, msg: Approve) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        if p is None or "handover" not in p.extra or p.peer != msg.src:
            return super()._on_Approve(msg)
        self._drop_pending(msg.req)
        query: HandoverQuery = p.extra["handover"]
        u = self._units.get(p.uid)
        if (u is None or u.sink != query.old or u.downstream != query.old or msg.src not in self._costs
                or not self.optimising):  # paused since the query came: no relabelling mid iteration
            return [Release(self.peer, msg.src, msg.link)] + self._unlock_upstream(query)
        out: list[FlowMessage] = [Release(self.peer, u.downstream, u.out_link)]
        u.sink, u.downstream, u.out_link, u.cont, u.age, u.idle = msg.src, msg.src, msg.link, msg.cost, 0, 0
        self.handovers += 1
        return out + self._relabelled(u, query)

    def _on_Reject(self, msg: Reject) -> list[FlowMessage]:
        p = self._pending.get(msg.req)
        out = super()._on_Reject(msg)
        if p is not None and "handover" in p.extra and p.peer == msg.src:
            out += self._unlock_upstream(p.extra["handover"], full=msg.src)
        return out

    def _unlock_upstream(self, query: HandoverQuery, full: str = "") -> list[FlowMessage]:
        """No handover: unlock the relay that sent `query`; `full` names a data node that had no free grant."""
        if query.src != query.old:
            return [Handover(self.peer, query.src, query.link, full, 0.0, False)]
        self._note_full(full)  # the query came from the data node: this relay is the head (and the last stage)
        return []

    def _relabelled(self, u: UnitState, query: HandoverQuery) -> list[FlowMessage]:
        """`u` now returns to its new data node: tell the sender, or (stage 0) let the old data node go."""
        if u.upstream is None:
            return []
        if u.upstream == query.old:  # the head: A's source link goes, the unit is offered to B
            out: list[FlowMessage] = [Deny(self.peer, u.upstream, u.in_link)]
            self._lose_upstream(u)
            return out
        req = self._new_id()  # wait for the relay above to acknowledge
        self._pending[req] = Pending("confirm", u.upstream, u.sink, u.uid, self._now, {"link": u.in_link})
        u.locked = req
        return [Handover(self.peer, u.upstream, u.in_link, u.sink, self._cost(u), True)]

    def _on_Handover(self, msg: Handover) -> list[FlowMessage]:
        u = self._unit_by("out_link", msg.link, msg.src)
        if not self.config.handover or self.is_data or u is None or u.kind != "relay":
            return []
        found = self._asked(u, msg.src)
        if found is None:  # nobody asked src: a forged or stale answer
            return []
        req, lock = found
        late = req in self._late_handovers
        self._drop_pending(req)
        self._late_handovers.pop(req, None)
        new = lock.extra["new"]
        if msg.done and msg.sink == new and u.sink == lock.sink and self._may_be_data(new):
            u.sink, u.cont, u.age = new, msg.cost, 0
            query = HandoverQuery(u.upstream or "", self.peer, u.in_link or "", lock.sink, new, 0.0)
            return [HandoverAck(self.peer, msg.src, msg.link)] + self._relabelled(u, query)
        if late:  # a no (or a done that is not what was asked, read as a no) after the relays above gave up
            return []
        full = new if not msg.done and msg.sink == new else ""
        if self._probed_by(u):
            return [Handover(self.peer, u.upstream, u.in_link, full, 0.0, False)]
        self._note_full(full)  # the head
        return []

    def _on_HandoverAck(self, msg: HandoverAck) -> list[FlowMessage]:
        u = self._unit_by("in_link", msg.link, msg.src)
        p = self._pending.get(u.locked) if u is not None else None
        if p is not None and p.kind == "confirm" and p.peer == msg.src:
            self._drop_pending(u.locked)
        return []

    def _asked(self, u: UnitState, src: str) -> tuple[int, Pending] | None:
        """The query that `u` passed to `src` and that an answer from `src` closes: its lock, or one that
        expired or was abandoned a short while ago (if `u` is not locked by anything since)."""
        lock = self._pending.get(u.locked)
        if lock is not None and lock.kind == "handover" and lock.peer == src and lock.uid == u.uid:
            return u.locked, lock
        if u.locked:
            return None
        for req, p in self._late_handovers.items():
            if p.uid == u.uid and p.peer == src:
                return req, p
        return None

    def _probed_by(self, u: UnitState) -> bool:
        """Whether the query reached `u` from an upstream relay (which holds a lock), not from a data node."""
        return u.upstream is not None and self._stages.get(u.upstream) != DATA
