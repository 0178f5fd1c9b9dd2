"""Who trains at a step: the roster every replica keeps of the peers that entered by `catchup.ready`.

A joiner that caught up announces the step it trains from; until then the others leave it out of their
groups. A peer on probation that sends nothing for `DEMOTE_AFTER` steps is dropped again.
"""

from __future__ import annotations

import logging
from collections import Counter

from ...transport.base import Transport

log = logging.getLogger(__name__)

READY = "catchup.ready"
DEMOTE_AFTER = 3  # steps an admitted joiner may miss in a row before it is dropped from the roster


class Roster:
    """Which members train at a step: the admission filter of a DataParallelPeer.

    With `initial` peer ids, only those (from step 0) and peers that announced
    `catchup.ready` (from the step they named) are admitted; with None, every
    member is. Either way a peer that asked for an offer as a joiner is left
    out until its `ready` step, so the swarm never waits for a peer that is
    still downloading. An admitted peer that leaves the membership view (dead,
    its record expired) loses its place: when it comes back (a restart with the
    same identity) it is left out until it announces `ready` again, so the
    swarm never waits for a restarted process that has not caught up yet.
    """

    def __init__(self, transport: Transport, initial: list[str] | None, margin: int) -> None:
        self.transport = transport
        self.open = initial is None
        self.active: dict[str, int] = {p: 0 for p in initial or []}
        self.joining: set[str] = set()
        self.margin = margin
        self.probation: dict[str, int] = {}  # entered by `ready`, not yet in a step: steps it missed
        self._ready: dict[str, int] = {}

    def admit(self, step: int, members: list[str]) -> list[str]:
        self._absorb(step)
        me = self.transport.peer_id
        present = set(members)
        for gone in [p for p in self.active if p != me and p not in present and self.active[p] <= step]:
            del self.active[gone]
        return [p for p in members if p == me or self._admitted(p, step)]

    def _admitted(self, peer: str, step: int) -> bool:
        if peer in self.joining:
            return False
        if peer in self.active:
            return self.active[peer] <= step
        return self.open

    def _absorb(self, step: int) -> None:
        for slot in range(max(0, step - 2), step + self.margin + 1):
            for sender in self.transport.board.get(READY, slot):
                if slot > self._ready.get(sender, -1):
                    self.enter(sender, slot)

    def enter(self, peer: str, step: int) -> None:
        self._ready[peer] = step
        self.active[peer] = step
        self.joining.discard(peer)
        if peer != self.transport.peer_id:
            self.probation[peer] = 0

    def observe(self, step: int, group: tuple[str, ...], dropped: tuple[str, ...]) -> None:
        """After `step`: a peer on probation (it entered by `ready`) that sent nothing `DEMOTE_AFTER` steps is demoted.

        It announced it would train from its entry step and then never showed up
        (died, or stalled): leave it out until it announces `ready` again instead of
        waiting out the all-reduce timeout at every step. One step it took part in
        ends its probation. (Not the first miss: joiners entering together may
        disagree on the group for a step, and each then misses the others' parts.)
        """
        for peer in group:
            if peer not in self.probation or self.active.get(peer, step + 1) > step:
                continue
            if peer not in dropped:
                del self.probation[peer]
                continue
            self.probation[peer] += 1
            if self.probation[peer] >= DEMOTE_AFTER:
                log.warning("peer %s announced it would train from step %d and sent nothing: dropped from the roster", peer[:8], self.active[peer])
                del self.probation[peer], self.active[peer]
                self.joining.add(peer)

    def mark_joining(self, peer: str, now: int) -> None:
        """`peer` asked to catch up: leave it out until it announces ready (a stale request is ignored)."""
        if self._ready.get(peer, -1) > now:
            return
        self.joining.add(peer)
        self.active.pop(peer, None)

    def to_dict(self) -> dict:
        return {"open": self.open, "active": dict(self.active)}

    def merge_majority(self, views: list[dict]) -> None:
        """Take, for each peer, the entry most of `views` (other peers' `to_dict`) hold."""
        if not views:
            return
        opens = Counter(bool(v.get("open")) for v in views)
        self.open = opens[True] > opens[False]
        entries = Counter((p, s) for v in views for p, s in v.get("active", {}).items())
        for (peer, step), votes in entries.items():
            if 2 * votes > len(views):
                self.active[peer] = step
