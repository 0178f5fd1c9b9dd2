"""Stage membership: a joiner enters a stage (GWTF V-B) and announces it (HELLO); peers are banned on
evidence or a verifier's ban (SENTINEL) and routed around.
"""

from __future__ import annotations

import asyncio

from ...core.errors import Evidence, RemoteError
from ...core.serialization import encode
from . import messages as m
from .verifier import parse_ban


class Membership:
    """Joining a stage, HELLO, and bans (a part of `PipelineNode`, node.py)."""

    async def enter(self, version: int, attempts: int = 5) -> bool:
        """A joiner: download this stage's weights at `version` or later (digest confirmed by a second
        peer), then tell every member that it serves the stage from the next iteration on. Until then it
        takes no microbatch and no part in aggregation. False if no stage peer delivered in `attempts` tries."""
        self.entered = False
        got = None
        for _ in range(attempts):
            # from any replica, also one that serves only from a later iteration: it has the weights (live()
            # compares its first iteration with ours, 0 before the download, and left a joiner over hivemind
            # trying only the stage's dead replicas while its one live replica was a joiner too)
            got = await self.fetch_weights(version, self.replicas(self.stage))
            if got is not None:
                break
            await asyncio.sleep(self.config.complete_timeout / 5)
        if got is None:
            return False
        self.version = got
        self.serving_from = got + 1  # the iteration under way started without us: serve from the next
        self.entered = True
        self.ready_event(got).set()
        self.announce()
        return True

    def announce(self) -> None:
        """HELLO to every member: my stage, from which iteration, under a fresh membership sequence number."""
        seq = int(self.now() * 1000)
        hello = encode({"stage": self.stage, "version": self.version, "since": self.serving_from,
                        "capacity": self.capacity, "seq": seq})
        for peer in self.transport.members():
            if peer != self.me:
                self.spawn(self.transport.send(peer, m.HELLO, hello))

    def _on_hello(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "hello")
        stage = obj.get("stage")
        if type(stage) is not int or not 1 <= stage <= self.last:
            raise RemoteError(Evidence(sender, "false_stage", f"claims relay stage {stage!r}"))
        if self.directory.get(sender) == 0:
            raise RemoteError(Evidence(sender, "false_stage", "a data node claims a relay stage"))
        seq = obj.get("seq", 0)
        if type(seq) is not int:
            raise RemoteError(Evidence(sender, "malformed", "hello with a bad sequence number"))
        if seq < self.membership.get(sender, -1) or sender in self.banned:
            return  # an older announcement than one already applied, or a banned peer's: it serves no stage
        since = obj.get("since", 0)
        if type(since) is not int:
            raise RemoteError(Evidence(sender, "malformed", "hello with a bad first iteration"))
        self.membership[sender] = seq
        self.directory[sender] = stage
        self.since[sender] = since

    def _on_evidence(self, evidence: Evidence) -> None:
        """A peer sent us something it must not have: route around it from now on and tell the data nodes."""
        if evidence.peer in self.banned or self.directory.get(evidence.peer) == 0:
            return
        self.banned.add(evidence.peer)
        if self.flow is not None:  # a banned peer leaves the flow at once
            self.spawn(self.flow.send(self.flow.lost(evidence.peer)))
        body = encode({"peer": evidence.peer, "evidence": True})
        for node in self.data_nodes():
            if node != self.me:
                self.spawn(self.transport.send(node, m.SUSPECT, body))

    def _on_ban(self, sender: str, payload: bytes) -> None:
        """A verifier banned a relay: route around it and leave it out of aggregation groups."""
        peer, it, keys = parse_ban(payload, sender, self.transport)
        trusted = sender in self.verifiers.values() or self.client_routed and self.directory.get(sender) == 0
        if not trusted and self.directory.get(sender, 0) > 0:
            raise RemoteError(Evidence(sender, "false_stage", "a relay sent a verifier's ban", it))
        if not trusted or peer == self.me or self.directory.get(peer) == 0:
            return
        self.sentinel_ban(peer, it, keys)

    def sentinel_ban(self, peer: str, it: int, keys: list[m.Key]) -> None:
        """Apply a verifier's ban of `peer` (again: a no-op) and drop the listed microbatches, which
        their data nodes restart around it; data nodes also reroute them."""
        for key in keys:  # free the slots
            self.held.pop(key, None)
            self.pending.pop(key, None)
            self.delivered.pop(key, None)
            self.rerouted.add(key)
        if peer in self.banned:
            return
        self.banned.add(peer)
        if self.flow is not None:
            self.spawn(self.flow.send(self.flow.lost(peer)))
