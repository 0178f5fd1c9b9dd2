"""Repair (GWTF V-D): a microbatch whose next peer left is reported lost; a broken backward is repaired
by resending a stored activation to a new peer, which recomputes only the missing stage.
"""

from __future__ import annotations

import dataclasses
import logging

from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.errors import Evidence, RemoteError
from ...core.serialization import encode
from . import messages as m

log = logging.getLogger(__name__)

class Repair:
    """Lost and broken microbatches (a part of `PipelineNode`, node.py)."""

    def check_next_peers(self) -> None:
        """A microbatch I passed on is lost when the peer I passed it to leaves before its output came
        home: tell its data node (it restarts the microbatch, or watches its backward) instead of
        letting it wait out the microbatch timeout. Checked whenever pipeline traffic wakes the node
        (no timer of its own, so that a run without churn is scheduled exactly as before)."""
        members = set(self.transport.members())
        for key, h in list(self.held.items()):
            if h.next_peer is not None and h.next_peer not in members and not h.lost_reported:
                h.lost_reported = True
                self.spawn(self.report_lost(key, self.stage + 1, h.next_peer))

    async def report_lost(self, key: m.Key, stage: int, dead: str) -> None:
        body = {"src": key[0], "seq": key[1], "att": key[2], "stage": stage, "lost": True, "to": dead}
        await self.transport.send(key[0], m.BROKEN, encode(body))

    async def _on_ping(self, sender: str, payload: bytes) -> bytes:
        """Whether I hold the microbatch's forward (a repair resends my output); with `delivered_to`, whether I
        delivered its backward to that peer (a repair of its stage resumes from the gradient I keep); with
        `handed_to` (and `upto`), from a holder, whether I handed that peer the repair that resumes at it."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, "ping")
        key = m.parse_key(obj, sender)
        to, handed, upto = obj.get("delivered_to"), obj.get("handed_to"), obj.get("upto")
        if handed is not None:
            if not isinstance(handed, str) or type(upto) is not int:
                raise RemoteError(Evidence(sender, "malformed", "bad ping"))
            return m.answer(m.OK if self.handed_to(key, sender, handed, upto) else m.UNKNOWN)
        if to is None:
            return m.answer(m.OK if key in self.held else m.UNKNOWN)
        if not isinstance(to, str):
            raise RemoteError(Evidence(sender, "malformed", "bad ping"))
        c = self.delivered.get(key)
        return m.answer(m.OK if c is not None and c.path[c.stage] == to and sender == key[0] else m.UNKNOWN)

    async def _on_resends(self, sender: str, payload: bytes) -> bytes:
        """My data node repairs the stage before me from the gradient I keep: the repair resends from `from`. A
        RESUME may take the gradient (whatever my view of the peer I delivered it to), once it proves the chain from
        that node to its asker (`_handed_along`)."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, "resends")
        key = m.parse_key(obj, sender)
        start = obj.get("from")
        if sender != key[0] or not isinstance(start, str):
            raise RemoteError(Evidence(sender, "malformed", "bad resends request"))
        return m.answer(m.OK if self.expect_resume(key, start) else m.UNKNOWN)

    def expect_resume(self, key: m.Key, start: str) -> bool:
        if key not in self.pending and key not in self.delivered:
            return False
        self.resends[key] = start
        return True

    def handed_to(self, key: m.Key, holder: str, taker: str, upto: int) -> bool:
        """Whether I am sending (or sent) my output, under a repair that rebuilds up to `upto` and resumes at
        `holder`, to `taker`: the repair's carry names the holder and the stage it rebuilds up to."""
        h = self.held.get(key)
        return (h is not None and h.carry.holder == holder and h.carry.repair == upto
                and taker in (h.next_peer, h.trying))

    async def _on_reforward(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "reforward")
        key = m.parse_key(obj, sender)
        upto, holder = obj.get("upto"), obj.get("holder")
        if sender != key[0] or type(upto) is not int or not self.stage < upto <= self.last or not isinstance(holder, str):
            raise RemoteError(Evidence(sender, "malformed", "bad reforward request"))
        return m.answer(m.OK if self.reforward(key, upto, holder) else m.UNKNOWN)

    def reforward(self, key: m.Key, upto: int, holder: str) -> bool:
        """Resend my stored output to a new peer of the next stage, which recomputes up to `upto`."""
        h = self.held.get(key)
        if h is None:
            return False
        dead = h.next_peer
        c = h.carry
        h.carry = dataclasses.replace(c, repair=upto, holder=holder)
        if dead is not None:
            h.excluded.add(dead)
        h.next_peer = None
        h.lost_reported = False  # the new next peer may leave too
        self.spawn(self.send_forward(key))
        return True

    async def _resume(self, key: m.Key) -> None:
        """I rebuilt the last broken stage: ask the holder to send its stored gradient to me."""
        h = self.held[key]
        body = {"src": key[0], "seq": key[1], "att": key[2], "path": [*h.carry.path, self.me], "rec": list(h.recomputed)}
        if h.carry.holder == self.me:
            return
        if self.sealing:  # my seal on the output I recomputed: the holder computed with the same tensor, from a dead sender
            tensor = h.sent if h.sent is not None else h.out.detach()
            body["seal"] = self.seal(CHECK_FORWARD, key, h.carry.it, self.stage + 1, tensor).to_obj()
        word = await self._ask(h.carry.holder, m.RESUME, encode(body))
        if word != m.OK:
            log.debug("resume of %s at %s failed", m.key_name(key), h.carry.holder[:8])

    async def _on_resume(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "resume")
        key = m.parse_key(obj, sender)
        prefix, rec = obj.get("path"), obj.get("rec")
        # one I failed to deliver, or one I delivered to a peer that left, once our data node repairs from it (`resends`)
        carry = self.pending.get(key, self.delivered.get(key) if key in self.resends else None)
        if carry is None:
            return m.answer(m.UNKNOWN)
        ok = (
            isinstance(prefix, list) and len(prefix) == carry.stage + 1 and all(isinstance(p, str) for p in prefix)
            and prefix[-1] == sender and prefix[0] == key[0]
            and isinstance(rec, list) and all(type(s) is int for s in rec)
        )
        if not ok:
            raise RemoteError(Evidence(sender, "malformed", "bad resume request"))
        if self.directory.get(sender, carry.stage) != carry.stage:
            return m.answer(m.UNKNOWN)  # our views of its stage differ (a move not yet seen here): not evidence
        if not await self._handed_along(key, tuple(prefix), carry.path):
            # not the node the repair went to: a relay of that stage that asks first would take the gradient and
            # drop it (RP 2b). Refused, not evidence (a node of the chain may have left)
            return m.answer(m.UNKNOWN)
        if self.pending.get(key, self.delivered.get(key) if key in self.resends else None) is not carry:
            return m.answer(m.UNKNOWN)  # taken by another RESUME while I asked
        if self.sealing and key in self.received and not (
                "seal" in obj and self.reseal(key, tuple(prefix), m.parse_seal(obj["seal"], sender), sender)):
            # my committed input must become the asker's sealed output: else my stage gradient looks computed from a
            # tensor nobody on the final path sent, and validators convict me (RP 8). Refused, not evidence: the
            # repair dead-ends and the microbatch restarts
            return m.answer(m.UNKNOWN)
        self.pending.pop(key, None)
        self.delivered.pop(key, None)
        self.resends.pop(key, None)
        path = tuple(prefix) + carry.path[carry.stage + 1:]
        recomputed = tuple(sorted(set(carry.recomputed) | set(rec)))
        self.spawn(self.tell_repaired(key, carry.stage, tuple(prefix)))
        self.spawn(self.send_backward(dataclasses.replace(carry, path=path, recomputed=recomputed)))
        return m.answer(m.OK)

    async def tell_repaired(self, key: m.Key, stage: int, prefix: tuple[str, ...]) -> None:
        """Tell the microbatch's data node the path a repair of `stage` resumed with: it names the nodes the repair
        put on the path and who fed each (`DataNode.repaired`)."""
        body = {"src": key[0], "seq": key[1], "att": key[2], "stage": stage, "path": list(prefix)}
        await self.transport.send(key[0], m.REPAIRED, encode(body))

    async def _handed_along(self, key: m.Key, prefix: tuple[str, ...], path: tuple[str, ...]) -> bool:
        """Whether the repair went from the node my data node named (`resends`) along `prefix` to its last node, the
        asker: `prefix` runs as my gradient's `path` up to that node, and each node from that one on confirms it
        handed the repair to the next (`handed_to`). The asker writes `prefix`, so the chain is anchored at the data
        node's choice; only the node that rebuilt the stage (or one a node of the repair chose, itself on the repair
        path) may take the gradient I keep."""
        start = self.resends.get(key)
        if start is None or start not in prefix[:-1]:
            return False
        at, upto = prefix.index(start), len(prefix) - 1
        if prefix[: at + 1] != path[: at + 1]:
            return False
        chain = prefix[at:]
        for feeder, taker in zip(chain, chain[1:]):
            if feeder == self.me:
                confirmed = self.handed_to(key, self.me, taker, upto)
            else:
                body = {"src": key[0], "seq": key[1], "att": key[2], "handed_to": taker, "upto": upto}
                confirmed = await self._ask(feeder, m.PING, encode(body)) == m.OK
            if not confirmed:
                return False
        return True

    def reseal(self, key: m.Key, prefix: tuple[str, ...], seal: m.Seal, sender: str) -> bool:
        """The peer that rebuilt my upstream stage sealed the output it recomputed. When that is exactly the
        activation I computed with (the same weights and input give the same tensor), it becomes the forward
        input I commit to, under the repaired path: the dead sender's seal would not match the path that
        BEGIN names, and my stage gradient would look computed from inputs nobody on the path sent."""
        forward, backward = self.received.get(key, (None, None))
        if forward is not None and seal.signer == sender and seal.valid(key, forward.it, CHECK_FORWARD, self.stage, forward.tensor):
            self.received[key] = (dataclasses.replace(forward, path=prefix, seal=seal), backward)
            return True
        return False
