"""The board of signed broadcasts one peer has received, shared by every transport.

It verifies each envelope, keeps the first payload per (topic, step, sender)
slot, turns a second different payload into an `EquivocationProof`, and lets a
protocol wait, with a timeout, for the messages of a set of senders.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from ..core.envelope import EquivocationProof, SignedEnvelope
from ..core.errors import Evidence, RemoteError
from ..core.serialization import DEFAULT_LIMITS, Limits


class BroadcastBoard:
    def __init__(self, on_evidence: Callable[[Evidence], None], limits: Limits = DEFAULT_LIMITS) -> None:
        self._on_evidence = on_evidence
        self._limits = limits
        self._slots: dict[tuple[str, int], dict[str, SignedEnvelope]] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}
        self._arrived: dict[tuple[str, int], dict[str, float]] = {}  # when each envelope was first taken (loop time)
        self.proofs: list[EquivocationProof] = []

    def receive(self, relayed_by: str, data: bytes) -> SignedEnvelope | None:
        """Take raw envelope bytes from a direct neighbour; bad bytes are evidence against it."""
        try:
            envelope = SignedEnvelope.from_bytes(data, relayed_by, self._limits).verify()
        except RemoteError as exc:
            # A forged or broken envelope proves nothing about its claimed
            # sender; the authenticated neighbour who handed it over is to blame.
            ev = exc.evidence
            self._on_evidence(Evidence(relayed_by, ev.kind, ev.detail, ev.step, (data,)))
            return None
        return envelope if self.add(envelope) else None

    def add(self, envelope: SignedEnvelope) -> bool:
        """Record a verified envelope; True if it is new."""
        key = (envelope.topic, envelope.step)
        slot = self._slots.setdefault(key, {})
        known = slot.get(envelope.sender)
        if known is not None:
            if known.payload != envelope.payload and not any(
                p.first.slot == envelope.slot for p in self.proofs
            ):
                proof = EquivocationProof(known, envelope)
                self.proofs.append(proof)
                self._on_evidence(proof.evidence())
            return False
        slot[envelope.sender] = envelope
        try:
            self._arrived.setdefault(key, {})[envelope.sender] = asyncio.get_running_loop().time()
        except RuntimeError:  # taken outside a running loop (a checkpoint being loaded): no arrival time
            pass
        event = self._events.get(key)
        if event is not None:
            event.set()
        return True

    def get(self, topic: str, step: int) -> dict[str, SignedEnvelope]:
        """Envelopes received so far for (topic, step), by sender."""
        return dict(self._slots.get((topic, step), {}))

    def arrivals(self, topic: str, step: int) -> dict[str, float]:
        """When each sender's envelope for (topic, step) was taken here (the event loop's time), by sender."""
        return dict(self._arrived.get((topic, step), {}))

    async def wait(
        self, topic: str, step: int, senders: Iterable[str], timeout: float,
        enough: Callable[[dict[str, SignedEnvelope]], bool] | None = None,
    ) -> dict[str, SignedEnvelope]:
        """Wait until every sender's envelope for (topic, step) is here, `enough` holds for what is
        here (it is asked again at each arrival), or `timeout` passes.

        Returns what arrived from `senders` (possibly not all of them).
        """
        wanted = list(senders)
        key = (topic, step)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        event = self._events.setdefault(key, asyncio.Event())
        while True:
            slot = self._slots.get(key, {})
            if all(s in slot for s in wanted) or (enough is not None and enough({s: slot[s] for s in wanted if s in slot})):
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                break
        slot = self._slots.get(key, {})
        return {s: slot[s] for s in wanted if s in slot}

    def prune(self, before_step: int) -> None:
        """Forget slots of steps older than `before_step` (proofs are kept)."""
        for key in [k for k in self._slots if k[1] < before_step]:
            del self._slots[key]
            self._events.pop(key, None)
            self._arrived.pop(key, None)
