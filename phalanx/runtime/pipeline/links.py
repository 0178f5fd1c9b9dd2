"""How a node's carries travel: verifier hops, seals, signed hop records, and requests that give up on a
peer that leaves (then suspected: left out of the iteration's aggregation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import torch

from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.errors import (
    Evidence,
    PeerTimeout,
    PeerUnreachable,
    PhalanxError,
    RemoteError,
)
from ...core.serialization import encode
from . import messages as m
from .verifier import COPY, RECEIPT, via_bytes
from .verifier import VIA as VIA_TOPIC

log = logging.getLogger(__name__)

class Links:
    """Sending carries and requests (a part of `PipelineNode`, node.py)."""

    def relayed_by(self, sender: str, c: m.Carry) -> bool:
        """Whether `sender` is a verifier hop trusted to deliver carries for other peers: a boundary
        verifier, or (client-routed) the microbatch's data node."""
        if sender in self.verifiers.values():
            return True
        return self.client_routed and sender == c.key[0] and self.directory.get(sender) == 0

    def hop(self, direction: str, c: m.Carry, to: str) -> str | None:
        """The verifier hop a carry goes through, or None to send it straight to `to`."""
        if self.verifiers:
            link = c.stage - 1 if direction == CHECK_FORWARD else c.stage
            return self.verifiers.get(link)
        if self.client_routed and self.stage > 0 and to != c.key[0]:
            return c.key[0]
        return None

    async def deliver(self, to: str, direction: str, c: m.Carry) -> str | None:
        """Send a forward or backward carry to `to`, through its verifier hop if there is one."""
        topic = m.FORWARD if direction == CHECK_FORWARD else m.BACKWARD
        via = self.hop(direction, c, to)
        if via is None or self.off_path:
            pad = self.config.activation_bytes - c.tensor.numel() * c.tensor.element_size()
            if via is not None:  # the copy leaves first: a verdict never waits for a copy the sender still holds
                c = self.addressed(c, to)
                await self.send_copy(via, direction, to, c, pad)
            return await self._ask(to, topic, c.to_bytes(pad))
        # The hop waits out its own COMPLETE timeout on a receiver that left: watch the receiver too.
        return await self._ask(via, VIA_TOPIC, via_bytes(direction, to, c), 3 * self.config.complete_timeout,
                               watch=(to,) if to else ())

    async def send_copy(self, verifier: str, direction: str, to: str, c: m.Carry, pad: int) -> None:
        """hop=off_path: the copy of a carry the link's verifier judges (the tensor and this node's signed record)."""
        await self.transport.send(verifier, COPY, encode({"dir": direction, "to": to, "carry": c.to_bytes(pad)}))

    def addressed(self, c: m.Carry, to: str) -> m.Carry:
        """The carry with my own record naming `to` (a repair resends a stored gradient to a new peer)."""
        own = c.hops[-1] if c.hops else None
        if own is None or own.signer != self.me or own.to == to:
            return c
        own = m.Hop.signed(self.transport.identity, own.key, own.it, own.direction, own.link, own.sender,
                           own.received, own.sent, to)
        return dataclasses.replace(c, hops=c.hops[:-1] + (own,))

    def receipt(self, direction: str, c: m.Carry, sender: str) -> None:
        """hop=off_path: forward the sender's signed record of what this node received to the link's verifier,
        which clears the tensor only if it names the digest of the copy it judged. A relay's carry without its
        own valid record for this tensor and receiver is evidence against it."""
        link = c.stage - 1 if direction == CHECK_FORWARD else c.stage
        verifier = self.verifiers.get(link)
        if not self.off_path or verifier is None or self.directory.get(sender) == 0:
            return
        own = c.hops[-1] if c.hops else None
        if (own is None or own.signer != sender or own.to != self.me or own.key != c.key or own.it != c.it
                or own.direction != direction or own.link != link or own.sent != m.tensor_digest(c.tensor)
                or not own.valid()):
            raise RemoteError(Evidence(sender, "unsigned", f"{direction} of {m.key_name(c.key)} without its signed record", c.it))
        self.spawn(self.transport.send(verifier, RECEIPT, encode({"hop": own.to_obj()})))

    def signed(self, direction: str, out: m.Carry, received: m.Carry, to: str) -> m.Carry:
        """`out` with this node's signed hop record appended to the records that came with `received`
        (through boundary verifiers only; SENTINEL blames upstream workers along these signatures)."""
        if not self.verifiers:
            return out
        link = out.stage - 1 if direction == CHECK_FORWARD else out.stage
        hop = m.Hop.signed(self.transport.identity, out.key, out.it, direction, link, "",
                           m.tensor_digest(received.tensor), m.tensor_digest(out.tensor), to)
        return dataclasses.replace(out, hops=received.hops + (hop,))

    def seal(self, direction: str, key: m.Key, it: int, stage: int, tensor: torch.Tensor) -> m.Seal | None:
        """This node's signature on a tensor it sends (only when stage gradients are validated)."""
        return m.Seal.make(self.transport.identity, key, it, direction, stage, tensor) if self.sealing else None

    def check_seal(self, direction: str, c: m.Carry, sender: str) -> None:
        """A carry must come sealed by its sender (or by the verifier hop or data node that delivered it
        in its place): the receiving replica commits to it, and an unsealed input would make an honest
        replica's stage gradient look forged. Evidence against the sender otherwise."""
        if c.seal is None or not c.seal.valid(c.key, c.it, direction, c.stage, c.tensor) or (
                c.seal.signer not in self.sealers(direction, c, sender)):
            raise RemoteError(Evidence(sender, "bad_seal", f"{direction} of {m.key_name(c.key)} without its sender's seal", c.it))

    def sealers(self, direction: str, c: m.Carry, sender: str) -> set[str]:
        """Who may seal a carry that `sender` sent over its link: the sender, the link's verifier, the
        microbatch's data node when it routes for relays."""
        link = c.stage - 1 if direction == CHECK_FORWARD else c.stage
        allowed = {sender}
        if link in self.verifiers:
            allowed.add(self.verifiers[link])
        if self.client_routed:
            allowed.add(c.key[0])
        return allowed

    def tamper(self, kind: str, it: int, key: m.Key, tensor: torch.Tensor) -> torch.Tensor:
        """What this node sends for an outgoing activation or input gradient; honest nodes send it as it is."""
        return tensor

    async def _request(self, peer: str, topic: str, payload: bytes, timeout: float, watch: tuple[str, ...] = ()) -> bytes:
        """A request that gives up as soon as `peer`, or a peer in `watch` (the receiver behind a verifier
        hop), leaves the membership view (PeerUnreachable naming it), instead of waiting out the whole
        timeout on a peer that is gone."""
        task = asyncio.ensure_future(self.transport.request(peer, topic, payload, timeout))
        poll = self.config.complete_timeout / 10
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll)
                if done:
                    return task.result()
                members = self.transport.members()
                gone = next((p for p in (peer, *watch) if p not in members), None)
                if gone is not None:
                    raise PeerUnreachable(gone, "left the membership view while we waited")
        finally:
            if not task.done():
                task.cancel()

    async def _ask(self, peer: str, topic: str, payload: bytes, timeout: float | None = None,
                   watch: tuple[str, ...] = ()) -> str | None:
        """Send a request and return the answer word; None when the peer (or a watched one) timed out, failed
        or was unreachable."""
        try:
            response = await self._request(peer, topic, payload, timeout or self.config.complete_timeout, watch)
            return m.parse_answer(response, peer, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
        except PeerTimeout:
            await self.suspect(peer)
        except PeerUnreachable as exc:
            await self.suspect(exc.peer if exc.peer in (peer, *watch) else peer)
        except PhalanxError as exc:
            log.debug("%s to %s failed: %s", topic, peer[:8], exc)
        return None

    async def suspect(self, peer: str) -> None:
        """`peer` did not answer: leave it out of this iteration's aggregation (data nodes decide groups)."""
        if peer in self.suspects:
            return
        self.suspects.add(peer)
        if self.flow is not None:
            await self.flow.send(self.flow.lost(peer))
        if self.stage > 0:
            for node in self.data_nodes():
                await self.transport.send(node, m.SUSPECT, encode({"peer": peer, "evidence": False}))
