"""A launch's waits on broadcasts, on the simulator: announcements that were lost are fetched."""

import asyncio

import pytest

from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.launcher import BARRIER_STEP, BARRIER_TIMEOUT, barrier
from phalanx.runs.pipeline.launch import FINISHED, FINISHED_PATIENCE, RUN_TIMEOUT
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


async def _start_barrier(transport, peers: list[str]) -> None:
    await barrier(transport, "start", peers)


async def _pipeline_finish(transport, peers: list[str]) -> None:
    await transport.broadcast(FINISHED, 0, b"")
    await transport.collect_broadcasts(FINISHED, 0, peers, RUN_TIMEOUT, patience=FINISHED_PATIENCE)


@pytest.mark.parametrize("wait, topic, step, bound", [
    (_start_barrier, "barrier.start", BARRIER_STEP, BARRIER_TIMEOUT / 2),
    (_pipeline_finish, FINISHED, 0, 2 * FINISHED_PATIENCE),
])
def test_peers_whose_announcements_were_lost_still_meet(wait, topic, step, bound):
    # Under --netns two daemons that dialled each other at once lost both announcements; each side
    # then passed the start barrier alone on its timeout, and the halves trained 120 s apart for good.
    passed: dict[str, tuple[float, set[str]]] = {}

    async def main() -> None:
        network = SimNetwork(SimConfig(seed=3))
        transports = [network.add_peer(peer_identity(5, i)) for i in range(4)]
        peers = sorted(t.peer_id for t in transports)
        network.partition([peers[:2], peers[2:]])  # every announcement across the cut is lost
        network.schedule(1.0, network.heal)

        def run(transport):
            async def body() -> None:
                await wait(transport, peers)
                passed[transport.peer_id] = (asyncio.get_running_loop().time(), set(transport.board.get(topic, step)))

            return body

        for task in [network.spawn(t.peer_id, run(t)) for t in transports]:
            await task

    run_simulation(main)
    assert sorted(passed) == sorted(peer_identity(5, i).peer_id for i in range(4))
    for when, seen in passed.values():
        assert seen == set(passed) and when < bound
