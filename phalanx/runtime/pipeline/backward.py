"""Backward: the gradient of a node's output arrives, the node keeps its parameter gradient for that
microbatch until aggregation and sends its input gradient to the previous node of the path (BROKEN to
the data node when that fails).
"""

from __future__ import annotations

import torch

from ...algorithms.sentinel.attacks import GRADIENT
from ...algorithms.sentinel.statistics import BACKWARD as CHECK_BACKWARD
from ...core.errors import Evidence, RemoteError
from ...core.serialization import check_tensor, encode
from . import messages as m
from .stages import flat


class Backward:
    """The backward pass of a microbatch through this node (a part of `PipelineNode`, node.py)."""

    async def _on_backward(self, sender: str, payload: bytes) -> bytes:
        self.check_next_peers()
        c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
        if c.stage != self.stage or len(c.path) != self.last + 1 or c.path[self.stage] != self.me:
            raise RemoteError(Evidence(sender, "unknown_microbatch", "backward for a stage or path I do not serve", c.it))
        expected = c.path[self.stage + 1] if self.stage < self.last else c.path[0]
        if sender != expected and not self.relayed_by(sender, c):
            raise RemoteError(Evidence(sender, "false_stage", "backward sender is not the next node of the path", c.it))
        trusted_route = sender != expected and self.client_routed  # the data node chose the next peer, not me
        sender = expected  # through a verifier hop: the peer it verified for
        if c.it >= self.version and not trusted_route and sender not in self.forwarded_to.get(c.key, ()):
            # a peer writes its own path: one this node never sent the microbatch to would get its gradient
            # taken (the first backward wins) and the honest next peer's answered STALE
            raise RemoteError(Evidence(sender, "unknown_microbatch", f"never sent {m.key_name(c.key)} to it", c.it))
        h = self.held.get(c.key)
        if h is None or h.x is None and self.stage > 0 or c.path[: self.stage] != h.carry.path:
            if c.it < self.version or c.key in self.rerouted:
                return m.answer(m.STALE)
            if h is None and c.key in self.backed:
                # its backward already ran here: a forward delivered twice (a resend racing a repair's REFORWARD,
                # issue-15 Table II) comes back twice; the second changes nothing and is no lie
                return m.answer(m.STALE)
            raise RemoteError(Evidence(sender, "unknown_microbatch", f"never held {m.key_name(c.key)}", c.it))
        check_tensor(c.tensor, sender, shape=tuple(h.out.shape), dtype=torch.float32, step=c.it)
        if self.sealing and self.stage > 0:
            self.check_seal(CHECK_BACKWARD, c, sender)
        self.receipt(CHECK_BACKWARD, c, sender)
        grad_out = await self.inbound(CHECK_BACKWARD, c)
        if grad_out is None:
            return m.answer(m.STALE)  # a verifying data node refused it: the attempt is being rerouted
        del self.held[c.key]  # a second backward for it (a resend) finds nothing to do
        self.backed.add(c.key)  # also while this one computes (the key is in neither held nor grads then)
        t0 = self.now()
        async with self.compute_lock:
            if c.it != self.version:
                return m.answer(m.STALE)  # aggregation stepped the weights while this waited
            inputs = ([h.x] if h.x is not None else []) + self.params
            grads = torch.autograd.grad(h.out, inputs, grad_out, allow_unused=True)
            await self._compute(2 * self.staged.forward_flops[self.stage])
        gx = grads[0] if h.x is not None else None
        self.grads[c.key] = flat(list(grads[len(grads) - len(self.params):]), self.params)
        if self.sealing and self.stage > 0:
            self.received[c.key] = (h.carry, c)
        self._emit("bwd", c.key, c.it, t0)
        recomputed = tuple(sorted(set(c.recomputed) | set(h.recomputed)))
        if self.stage == 0:
            self.finished(c.key, m.Carry(c.key, c.it, 0, c.path, c.tensor, recomputed=recomputed))
        else:
            sent = self.tamper(GRADIENT, c.it, c.key, gx.detach())
            back = m.Carry(c.key, c.it, self.stage - 1, c.path, sent, recomputed=recomputed,
                           seal=self.seal(CHECK_BACKWARD, c.key, c.it, self.stage - 1, sent))
            back = self.signed(CHECK_BACKWARD, back, c, c.path[self.stage - 1])
            self.spawn(self.send_backward(back))
        return m.answer(m.OK)

    async def send_backward(self, carry: m.Carry) -> None:
        """Send an input gradient to the node serving carry.stage; on failure keep it and report BROKEN."""
        target = carry.path[carry.stage]
        word = await self.deliver(target, CHECK_BACKWARD, carry)
        if word == m.OK:
            self.delivered[carry.key] = carry  # a repair resumes from it if `target` leaves before passing its own on
        if word in (m.OK, m.STALE):
            return
        self.router.failed(target)
        self.pending[carry.key] = carry
        await self.report_broken(carry)

    async def report_broken(self, carry: m.Carry) -> None:
        body = {"src": carry.key[0], "seq": carry.key[1], "att": carry.key[2], "stage": carry.stage}
        await self.transport.send(carry.key[0], m.BROKEN, encode(body))

    def finished(self, key: m.Key, carry: m.Carry) -> None:
        """Data nodes only: a microbatch's backward reached stage 0."""

    async def inbound(self, direction: str, c: m.Carry) -> torch.Tensor | None:
        """The tensor a node works on for a carry that came to it directly (a verifying data node
        judges it here; None: refused); relays take it as it is."""
        return c.tensor
