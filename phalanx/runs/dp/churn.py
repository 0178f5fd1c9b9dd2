"""Peers that come and go in a simulated run: crashes, restarts, new joiners, churn.

`FaultDriver` watches the run's progress (the highest step any peer has
finished) and, from the seed alone, crashes peers, restarts them with the same
identity, adds new peers, and with `faults.leave_rate` / `faults.join_rate`
makes peers leave and come back at random. A peer that (re)starts mid-run
joins through state catch-up (`phalanx.runtime.dp.catchup`), exactly as a real
`phalanx peer` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ...core.rng import py_stream
from ...runtime.dp.admission import admission_for
from ...runtime.dp.catchup import CatchupFailed, CatchupService
from ...runtime.dp.checkpoint import PeerCheckpoints
from ...transport.sim import SimNetwork, SimTransport
from .config import RunConfig
from .swarm import build_peer, crash_indices, run_peer

log = logging.getLogger(__name__)

MIN_ALIVE = 4  # churn never takes the swarm below this many live peers (a digest needs 3 to agree)


class FaultDriver:
    """Runs every peer's main and injects the config's faults as the run progresses."""

    def __init__(
        self,
        config: RunConfig,
        network: SimNetwork,
        transports: list[SimTransport],
        on_step: Callable[[dict], None],
        checkpoints: Callable[[int], PeerCheckpoints] | None = None,
    ) -> None:
        self.config = config
        self.network = network
        self.transports = transports
        self.ids = [t.peer_id for t in transports]  # config.peers originals, then the joiners
        self.on_step = on_step
        self.checkpoints = checkpoints  # each peer's checkpoint hook, by index
        self.catchup = config.faults.churn
        self.alive: set[str] = set()
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.left: list[str] = []  # peers down now, in the order they went down
        self.changed = asyncio.Event()
        self.victims = [self.ids[i] for i in crash_indices(config)]
        self.crashed_ever: set[str] = set()
        self._progress = -1
        self._restart_at: dict[str, int] = {}
        self._rng = py_stream(config.seed, "churn")
        self.joins = 0

    def start(self, index: int) -> None:
        peer_id = self.ids[index]
        self.alive.add(peer_id)
        self.network.spawn(peer_id, self._main(index))

    def _main(self, index: int):
        peer_id = self.ids[index]

        async def main() -> None:
            config = self.config
            peer = build_peer(config, self.transports[index], index)
            service = admission = None
            if self.catchup:
                service = CatchupService(peer, config.catchup, initial=self.ids[: config.peers])
                admission = admission_for(peer, service, config.btard, initial=self.ids[: config.peers])
            if peer_id in self.started:
                try:
                    await service.join(end=config.steps)
                except CatchupFailed as exc:
                    log.info("peer %d did not rejoin: %s", index, exc)
                    return self._done(peer_id)
                self.joins += 1
            self.started.add(peer_id)
            hook = self.checkpoints(index) if self.checkpoints is not None else None
            try:
                await run_peer(config, peer, index, True, self.record, service, hook, admission=admission)
            except CatchupFailed as exc:
                log.info("peer %d got no admission state: %s", index, exc)
            self._done(peer_id)

        return main

    def _done(self, peer_id: str) -> None:
        self.finished.add(peer_id)
        self.changed.set()

    async def wait(self) -> None:
        """Until every live peer has finished (or given up joining)."""
        while any(p in self.alive and p not in self.finished for p in self.ids):
            self.changed.clear()
            await self.changed.wait()

    def record(self, record: dict) -> None:
        self.on_step(record)
        step = record["step"]
        while self._progress < step:
            self._progress += 1
            self._at(self._progress)

    def _at(self, step: int) -> None:
        """The first peer finished `step`: inject what the faults say happens now."""
        faults = self.config.faults
        if step == faults.crash_after_step:
            for victim in self.victims:
                self._crash(victim, step)
        if faults.join and step == faults.join_after_step:
            for j in range(faults.join):
                index = self.config.peers + j
                self.started.add(self.ids[index])  # it has never trained: it joins through catch-up
                self.start(index)
        for peer_id, at in sorted(self._restart_at.items()):
            if at == step:
                del self._restart_at[peer_id]
                self._restart(peer_id)
        if (faults.leave_rate or faults.join_rate) and step < self.config.steps - 2 * self.config.catchup.margin:
            self._churn(step)

    def _churn(self, step: int) -> None:
        for peer_id in list(self.left):
            if self._rng.random() < self.config.faults.join_rate:
                self._restart(peer_id)
        evaluating = set(self.ids[: self.config.eval_peers])
        for peer_id in sorted(self.alive):
            if peer_id in evaluating or len(self.alive) <= MIN_ALIVE:
                continue
            if self._rng.random() < self.config.faults.leave_rate:
                self._crash(peer_id, step)

    def _crash(self, peer_id: str, step: int) -> None:
        if peer_id not in self.alive:
            return
        self.network.crash(peer_id)
        self.alive.discard(peer_id)
        self.left.append(peer_id)
        self.crashed_ever.add(peer_id)
        if self.config.faults.restart_after:
            self._restart_at[peer_id] = step + self.config.faults.restart_after
        self.changed.set()

    def _restart(self, peer_id: str) -> None:
        if peer_id in self.alive:
            return
        self.left.remove(peer_id)
        self.alive.add(peer_id)
        self.finished.discard(peer_id)
        self.network.restart(peer_id)
