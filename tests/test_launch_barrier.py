"""The start barrier of a launch's workers, on the simulator: announcements that were lost are fetched."""

import asyncio

from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.launcher import BARRIER_STEP, BARRIER_TIMEOUT, barrier
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def test_peers_whose_announcements_were_lost_still_start_together():
    # Under --netns two daemons that dialled each other at once lost both announcements; each side
    # then passed the barrier alone on its timeout, and the halves trained 120 s apart for good.
    passed: dict[str, tuple[float, set[str]]] = {}

    async def main() -> None:
        network = SimNetwork(SimConfig(seed=3))
        transports = [network.add_peer(peer_identity(5, i)) for i in range(4)]
        peers = sorted(t.peer_id for t in transports)
        network.partition([peers[:2], peers[2:]])  # every announcement across the cut is lost
        network.schedule(1.0, network.heal)

        def wait(transport):
            async def run() -> None:
                await barrier(transport, "start", peers)
                passed[transport.peer_id] = (asyncio.get_running_loop().time(), set(transport.board.get("barrier.start", BARRIER_STEP)))

            return run

        for task in [network.spawn(t.peer_id, wait(t)) for t in transports]:
            await task

    run_simulation(main)
    assert sorted(passed) == sorted(peer_identity(5, i).peer_id for i in range(4))
    for when, seen in passed.values():
        assert seen == set(passed) and when < BARRIER_TIMEOUT / 2
