"""Throughput of HivemindTransport between OS processes on loopback.

Peer 0 runs here; peers 1 and 2 each run in their own spawned process with
their own DHT process and libp2p daemon, as real peers would. Point-to-point
figures use peers 0 and 1 only:

- send: one-way messages (each `send` returns when the receiver acked it)
- request up: the request carries the payload, the answer is empty
- request down: a 4-byte request, the answer carries the payload
- echo: the payload goes both ways; both directions count as bytes moved

Then the time of a signed broadcast from peer 0 to peers 1 and 2 (1 kB and the
same sizes) until both acked it: the base class's broadcast, concurrent sends
that wait for the acks (this transport's own returns once the sends started).
MB = 10**6 bytes; each throughput cell moves about `--volume` MB after one
warm-up call.

    .venv/bin/python bench/transport_throughput.py [--sizes 1,10,40] [--volume 400]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from multiprocessing.connection import Connection

from phalanx.core import Identity
from phalanx.transport.base import Transport
from phalanx.transport.p2p import HivemindTransport

MB = 10**6
JOIN_TIMEOUT = 30.0
CALL_TIMEOUT = 120.0


def serve(index: int, run_id: str, initial_peers: list[str], conn: Connection) -> None:
    """A server peer's process: answer the benchmark's topics until the parent says stop."""
    asyncio.run(_serve(index, run_id, initial_peers, conn))


async def _serve(index: int, run_id: str, initial_peers: list[str], conn: Connection) -> None:
    identity = Identity.from_seed(f"bench/{index}".encode())
    transport = HivemindTransport(identity, run_id=run_id, initial_peers=initial_peers)

    async def up(sender: str, payload: bytes) -> bytes:
        return b""

    async def down(sender: str, payload: bytes) -> bytes:
        return bytes(int.from_bytes(payload, "little"))

    async def echo(sender: str, payload: bytes) -> bytes:
        return payload

    transport.add_request_handler("up", up)
    transport.add_request_handler("down", down)
    transport.add_request_handler("echo", echo)
    transport.add_message_handler("sink", lambda sender, payload: None)
    await transport.start()
    try:
        conn.send(transport.peer_id)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    finally:
        await transport.stop()


async def seconds_per_call(call: Callable[[], Awaitable[object]], reps: int) -> float:
    """Mean wall seconds of `call` over `reps` calls, after one warm-up call."""
    await call()
    start = time.perf_counter()
    for _ in range(reps):
        await call()
    return (time.perf_counter() - start) / reps


async def rate(call: Callable[[], Awaitable[object]], bytes_per_call: int, volume: int) -> float:
    """MB/s of `call` repeated to move about `volume` bytes (at least 3 calls)."""
    return bytes_per_call / await seconds_per_call(call, max(3, volume // bytes_per_call)) / MB


async def bench(sizes: list[int], volume: int) -> None:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    client = HivemindTransport(Identity.from_seed(b"bench/0"), run_id=run_id)
    started = time.perf_counter()
    await client.start()
    print(f"peer 0 started in {time.perf_counter() - started:.2f} s")
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for index in (1, 2):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(index, run_id, client.visible_maddrs(), theirs))
            proc.start()
            theirs.close()
            pipes.append(ours)
            procs.append(proc)
        servers = [pipe.recv() for pipe in pipes]
        await client.wait_for_members(3, JOIN_TIMEOUT)
        server = servers[0]

        small = await seconds_per_call(lambda: client.request(server, "up", b"x", CALL_TIMEOUT), 200)
        print(f"1-byte request round trip: {small * 1e3:.2f} ms\n")
        print(f"{'payload':>8} | {'send':>8} | {'req up':>8} | {'req down':>8} | {'echo':>8}   (MB/s)")
        for size in sizes:
            payload, wanted = os.urandom(size), size.to_bytes(4, "little")
            cells = [
                await rate(lambda: client.send(server, "sink", payload), size, volume),
                await rate(lambda: client.request(server, "up", payload, CALL_TIMEOUT), size, volume),
                await rate(lambda: client.request(server, "down", wanted, CALL_TIMEOUT), size, volume),
                await rate(lambda: client.request(server, "echo", payload, CALL_TIMEOUT), 2 * size, volume),
            ]
            print(f"{size // MB:>5} MB | " + " | ".join(f"{c:8.1f}" for c in cells))

        print("\nbroadcast from peer 0 to peers 1 and 2, until both acked (ms per broadcast)")
        print(f"{'payload':>8} | {'acked':>10}")
        step = 0
        for size in [1000, *sizes]:
            payload = os.urandom(size)

            async def broadcast() -> None:
                nonlocal step
                step += 1
                await Transport.broadcast(client, "bench", step, payload)

            reps = max(3, min(50, volume // (8 * size)))  # receivers keep every envelope on their boards
            acked = await seconds_per_call(broadcast, reps)
            label = f"{size // MB} MB" if size >= MB else f"{size // 1000} kB"
            print(f"{label:>8} | {acked * 1e3:10.1f}")
    finally:
        for pipe in pipes:
            with suppress(OSError):  # a server that died has nothing to stop
                pipe.send("stop")
        for proc in procs:
            proc.join(30)
        await client.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,10,40", help="payload sizes in MB, comma-separated")
    parser.add_argument("--volume", type=int, default=400, help="MB to move per measurement")
    args = parser.parse_args()
    sizes = [int(s) * MB for s in args.sizes.split(",")]
    asyncio.run(bench(sizes, args.volume * MB))


if __name__ == "__main__":
    main()
