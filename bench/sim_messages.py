"""Message rate of the simulator's hot path: all-to-all rounds of small one-way messages.

Every peer sends a 100-byte payload to every other peer, then waits for the
n - 1 messages of that round before starting the next, like the scatter and
gather phases of a butterfly all-reduce. Prints messages per second of wall
time and wall microseconds per message, end to end: send, link model, timer,
delivery and handler. CPU time is printed beside wall time: on a shared
machine it is the steadier of the two.

    .venv/bin/python bench/sim_messages.py
"""

from __future__ import annotations

import asyncio
import time

from phalanx.core import Identity
from phalanx.transport.sim import SimNetwork, SimTransport, run_simulation

PAYLOAD = bytes(100)
TOPIC = "bench"


async def peer_main(transport: SimTransport, ids: list[str], rounds: int) -> None:
    """Send to every other peer, wait for everyone's message, `rounds` times."""
    others = [peer for peer in ids if peer != transport.peer_id]
    received = 0
    arrived = asyncio.Event()

    def on_message(sender: str, payload: bytes) -> None:
        nonlocal received
        received += 1
        arrived.set()

    transport.add_message_handler(TOPIC, on_message)
    for r in range(rounds):
        for peer in others:
            await transport.send(peer, TOPIC, PAYLOAD)
        while received < (r + 1) * len(others):
            arrived.clear()
            await arrived.wait()


def all_to_all(n: int, rounds: int) -> tuple[int, float, float, float]:
    """Run `rounds` all-to-all rounds among n peers; return (messages, wall s, CPU s, virtual s)."""
    identities = [Identity.from_seed(f"bench-{i}".encode()) for i in range(n)]

    async def main() -> float:
        network = SimNetwork()
        transports = [network.add_peer(identity) for identity in identities]
        ids = network.peers
        await asyncio.gather(*[network.spawn(t.peer_id, lambda t=t: peer_main(t, ids, rounds)) for t in transports])
        return asyncio.get_running_loop().time()

    wall, cpu = time.perf_counter(), time.process_time()
    virtual = run_simulation(main)
    return rounds * n * (n - 1), time.perf_counter() - wall, time.process_time() - cpu, virtual


def main() -> None:
    for n, rounds in ((64, 20), (256, 2)):
        messages, wall, cpu, virtual = all_to_all(n, rounds)
        print(
            f"n={n:4d} rounds={rounds:2d} messages={messages:6d}  wall {wall:5.3f} s: {messages / wall:6.0f} msg/s, "
            f"{wall / messages * 1e6:5.2f} us/msg  cpu {cpu / messages * 1e6:5.2f} us/msg  (virtual {virtual:.4f} s)"
        )


if __name__ == "__main__":
    main()
