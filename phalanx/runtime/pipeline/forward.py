"""Forward: an activation arrives, is checked, computed and routed on to a next-stage peer chosen by the
node's router (another on DENY or a timeout; DENY upstream when none is left).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...algorithms.sentinel.attacks import ACTIVATION
from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.errors import Evidence, RemoteError
from ...core.serialization import check_tensor, encode
from . import messages as m


@dataclass
class Held:
    """A microbatch between its forward and its backward on this node."""

    carry: m.Carry  # as it arrived (path up to the previous stage)
    x: torch.Tensor | None  # input with requires_grad (None where the input is data)
    out: torch.Tensor
    excluded: set[str] = field(default_factory=set)
    next_peer: str | None = None
    trying: str | None = None  # the next peer being asked to take it (counted as its load until it answers)
    recomputed: tuple[int, ...] = ()
    sent: torch.Tensor | None = None  # what goes forward (the output, unless the node's policy tampers)
    lost_reported: bool = False  # its next peer left the membership view and the data node was told
    refusals: int = 0  # next peers that refused it (routers that do not remember refusals)


class Forward:
    """The forward pass of a microbatch through this node (a part of `PipelineNode`, node.py)."""

    async def _on_forward(self, sender: str, payload: bytes) -> bytes:
        self.check_next_peers()
        c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
        if len(c.path) != c.stage or c.stage < 1 or c.path[-1] != sender and not self.relayed_by(sender, c):
            raise RemoteError(Evidence(sender, "false_stage", "forward sender is not the last node of its path", c.it))
        sender = c.path[-1]  # through a verifier hop: the peer it verified for
        claimed = self.directory.get(sender)
        if claimed is not None and claimed != c.stage - 1:
            if claimed == 0 or c.stage == 1:  # data nodes never move: a relay posing as one (or the reverse) lies
                raise RemoteError(Evidence(sender, "false_stage", f"claims stage {c.stage - 1}, serves {claimed}", c.it))
            return m.answer(m.DENIED)  # a relay that moved or rejoined, our views differ: not evidence
        if c.stage == self.last + 1 and self.stage == 0:
            return await self.take_output(sender, c)
        if c.stage != self.stage or not self.entered or c.it < self.serving_from:
            return m.answer(m.DENIED)  # misrouted (views differ), or a joiner before its first iteration
        check_tensor(c.tensor, sender, shape=self.staged.input_shape(self.stage), dtype=torch.float32, step=c.it)
        if self.sealing:
            self.check_seal(CHECK_FORWARD, c, sender)
        if c.it < self.version:
            return m.answer(m.STALE)
        if self.sealing:  # two sealed activations for one microbatch in one iteration: their signer equivocates
            # (a microbatch deferred to the next iteration comes again, computed with the new weights: not a lie)
            earlier = self.held[c.key].carry if c.key in self.held else self.received.get(c.key, (None, None))[0]
            if (earlier is not None and earlier.seal is not None and earlier.it == c.it
                    and m.tensor_digest(earlier.tensor) != m.tensor_digest(c.tensor)):
                raise RemoteError(Evidence(c.seal.signer, "equivocation", f"two sealed activations for {m.key_name(c.key)}", c.it))
        if c.key in self.held:  # a resend of what we already hold; from another path, a key planted here first
            # (by a relay that guessed it) or the honest one: which is unknown, so no evidence, but the sender
            # of the second is told to try elsewhere instead of waiting for a backward that will not come
            return m.answer(m.OK if self.held[c.key].carry.path == c.path else m.DENIED)
        if c.key[2] > 0 and (c.restart is None or not c.restart.valid(c.key, c.it)):
            # only its data node restarts a microbatch: an attempt it did not sign would drop the honest one held
            raise RemoteError(Evidence(sender, "forged_attempt", f"{m.key_name(c.key)} without its data node's signature", c.it))
        self.supersede(c.key)
        if self.full():
            return m.answer(m.DENIED)
        self.receipt(CHECK_FORWARD, c, sender)  # taken: tell the link's verifier what came
        self.held[c.key] = Held(c, None, c.tensor)  # reserve the slot before waiting
        self.slots.add(c.key)
        # Our aggregation may end just after the sender's; a replica further behind is catching up: deny
        # long before the sender's COMPLETE timeout, so that it tries another peer instead of suspecting us.
        if not await self.wait_version(c.it, min(self.config.aggregation_timeout, self.config.complete_timeout / 2)):
            if c.it == self.version + 1 and not self._catching_up:  # behind (a missed BEGIN): catch up
                self._catching_up = True
                self.spawn(self.catch_up(c.it, unstepped=False)).add_done_callback(self._caught_up)
            self.release(c.key)
            return m.answer(m.DENIED)
        await self.weights_agreed(c.it)
        t0 = self.now()
        async with self.compute_lock:
            if c.it != self.version:
                self.release(c.key)
                return m.answer(m.STALE)
            x = c.tensor.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                out = self.part(x)
            await self._compute(self.staged.forward_flops[self.stage])
        if c.key not in self.held:
            return m.answer(m.DENIED)  # the iteration ended while we computed
        recomputed = c.recomputed + ((self.stage,) if c.repair >= 0 else ())
        sent = self.tamper(ACTIVATION, c.it, c.key, out.detach())
        self.held[c.key] = Held(c, x, out, recomputed=recomputed, sent=sent)
        self._emit("fwd", c.key, c.it, t0, recompute=c.repair >= 0)
        self.served += 1
        if self.flow is not None:
            self.flow.pause(True)  # routes stay put while this iteration's microbatches run
        if c.repair == self.stage:  # the holder of the stored gradient sends it here
            self.forwarded_to.setdefault(c.key, set()).add(c.holder)
            self.spawn(self._resume(c.key))
        else:
            self.spawn(self.send_forward(c.key))
        return m.answer(m.OK)

    async def send_forward(self, key: m.Key) -> None:
        """Route a held output to the next stage: retry on failure, DENY upstream when nobody is left."""
        h = self.held.get(key)
        if h is None:
            return
        nxt = self.stage + 1
        path = h.carry.path + (self.me,)
        while key in self.held:
            if nxt == self.last + 1:
                candidates = [key[0]] if key[0] not in h.excluded else []
            else:
                candidates = [p for p in self.live(nxt) if p not in h.excluded and p not in self.refused]
            load: dict[str, int] = {}
            if self.config.capacity_mode == "iteration":  # slots used this iteration, for this data node's flow
                load = {p: n for (sink, p), n in self.sent_to.items() if sink == key[0]}
            else:
                for other in self.held.values():
                    at = other.next_peer or other.trying
                    if at is not None:
                        load[at] = load.get(at, 0) + 1
            upstream = h.carry.path[-1] if h.carry.path else ""
            client = self.client_routed and 0 < self.stage < self.last
            peer = key[0] if client else self.router.choose(nxt, candidates, key[0], upstream, load)
            if peer is None:
                await self.give_up(key)
                return
            tensor = h.sent if h.sent is not None else h.out.detach()
            carry = m.Carry(key, h.carry.it, nxt, path, tensor, h.carry.repair, h.carry.holder, h.recomputed,
                            seal=self.seal(CHECK_FORWARD, key, h.carry.it, nxt, tensor), restart=h.carry.restart)
            carry = self.signed(CHECK_FORWARD, carry, h.carry, peer)
            self.forwarded_to.setdefault(key, set()).add(peer)  # also when it times out here but computes there
            t0 = self.now()
            h.trying = peer
            word = await self.deliver("" if client else peer, CHECK_FORWARD, carry)
            if word == m.OK:
                h.next_peer = peer  # before anything awaits: a repair's holder may ask whom I handed it to (`handed_to`)
            h.trying = None
            if client and word == m.DENIED:  # the data node found no next peer: it restarts the microbatch
                self.held.pop(key, None)
                return
            self._emit("send", key, h.carry.it, t0, to=peer, answer=word,
                       branch="client" if client else self.router.last_branch)
            if word == m.OK:
                self.router.observe(peer, self.now() - t0)
                if self.flow is not None:
                    await self.flow.send(self.flow.measured_rtt(peer, self.now() - t0, self.config.ema))
                self.sent_to[(key[0], peer)] = self.sent_to.get((key[0], peer), 0) + 1
                return
            if word == m.STALE:
                return
            self.router.failed(peer)
            if word is None and self.flow is not None:  # timed out or unreachable: its cost goes up
                await self.flow.send(self.flow.failed(peer, 4 * self.config.complete_timeout, self.config.ema))
            if word == m.DENIED and self.router.remembers_refusals and self.config.capacity_mode == "iteration":
                self.refused.add(peer)  # full until the next iteration, for every microbatch
            if word is None or self.router.remembers_refusals:
                h.excluded.add(peer)
            else:  # a refusal not remembered (SWARM knows no memory): the peer may be drawn again, within a bound
                h.refusals += 1
                if h.refusals >= 2 * len(candidates):
                    h.excluded.update(candidates)

    def full(self) -> bool:
        """No room for another microbatch: `capacity` held at once, or (capacity_mode=iteration)
        `capacity` admitted in this iteration (a slot frees only at aggregation, or when given up)."""
        used = len(self.slots) if self.config.capacity_mode == "iteration" else len(self.held)
        return used >= self.capacity

    def supersede(self, key: m.Key) -> None:
        """A newer attempt of a microbatch arrives, signed by its data node (checked before): the data node
        restarted it, so the earlier attempts held here will never finish. Free their slots (they filled a
        stage whose next peer had died, and denied the restart itself), and answer a late backward of theirs
        STALE, not as evidence."""
        for old in [k for k in self.held if k[:2] == key[:2] and k[2] < key[2]]:
            self.release(old)
            self.rerouted.add(old)

    def release(self, key: m.Key) -> Held | None:
        """Drop a microbatch this node will not pass on, and its slot."""
        self.slots.discard(key)
        return self.held.pop(key, None)

    async def give_up(self, key: m.Key) -> None:
        """No next-stage peer takes this microbatch: tell upstream (DENY) and free the slot. A backward for it
        may still be on its way (a repair's REFORWARD found no other peer while the first one's backward ran):
        it gets STALE, not evidence."""
        h = self.release(key)
        self.rerouted.add(key)
        if h is not None:
            await self.transport.send(h.carry.path[-1], m.DENY, encode({"src": key[0], "seq": key[1], "att": key[2]}))

    def _on_deny(self, sender: str, payload: bytes) -> None:
        key = m.parse_key(m.parse_mapping(payload, sender, self.transport.limits, "deny"), sender)
        h = self.held.get(key)
        if h is None or h.next_peer != sender:
            return  # about a microbatch we no longer route through that peer
        h.next_peer = None
        h.excluded.add(sender)
        self.router.failed(sender)
        self.spawn(self.send_forward(key))

    async def take_output(self, sender: str, c: m.Carry) -> bytes:
        """Data nodes only: the last stage's output comes home for the loss."""
        raise RemoteError(Evidence(sender, "false_stage", "sent a last-stage output to a relay", c.it))
