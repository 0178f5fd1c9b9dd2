"""Seconds for a joiner to download and verify a state over hivemind, against model size.

Three holder peers serve the same snapshot (N float32 parameters, encoded as
catch-up encodes states) through the catch-up topics; a joiner fetches it with
`fetch_snapshot` (manifest from one holder, chunks spread over all three,
every chunk checked against the agreed manifest). The raw figure moves the
same bytes with plain requests of one chunk each from one holder, one after
another: the transport's own throughput. All peers run in this process, each
with its own DHT process and libp2p daemon.

With --netns (root), each peer is a host of a netns test bed: the holders on
unshaped links, the joiner behind a link of --rate Mbit/s (tbf, each
direction; --delay adds latency). Its DHT child and p2pd are started inside its namespace. The
table then also gives a plain TCP transfer of the same bytes from holder 0
to the joiner across the same link, and catch-up as a multiple of it.

    PYTHONPATH=. .venv/bin/python bench/catchup.py [--params 1,10,50] (millions)
    PYTHONPATH=. .venv/bin/python bench/catchup.py --netns --rate 10 [--delay 40] --params 1,10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import threading
import time
import uuid

import torch

from phalanx.algorithms.catchup import Agreed, manifest_digest, manifest_of
from phalanx.core import Identity
from phalanx.core.serialization import decode, encode
from phalanx.runs.netns import LinkShape, NetnsConfig, Testbed, entered
from phalanx.runtime.dp.catchup import CatchupConfig, fetch_snapshot
from phalanx.transport.p2p import HivemindTransport

HOLDERS = 3


def holder_handlers(transport: HivemindTransport, snapshots: dict[int, tuple[bytes, dict]], chunk: int) -> None:
    async def manifest(sender: str, payload: bytes) -> bytes:
        held = snapshots.get(decode(payload, sender)["step"])
        return encode({"manifest": held[1] if held else None})

    async def chunk_of(sender: str, payload: bytes) -> bytes:
        request = decode(payload, sender)
        data = snapshots[request["step"]][0]
        return encode({"data": data[request["index"] * chunk : (request["index"] + 1) * chunk]})

    async def raw(sender: str, payload: bytes) -> bytes:
        return bytes(int.from_bytes(payload, "little"))

    transport.add_request_handler("catchup.manifest", manifest)
    transport.add_request_handler("catchup.chunk", chunk_of)
    transport.add_request_handler("raw", raw)


def tcp_seconds(bed: Testbed, sender: int, receiver: int, size: int) -> float:
    """Seconds to move `size` bytes over one plain TCP connection from host `sender` to host `receiver`."""
    with entered(bed.namespace(sender)):
        server = socket.create_server((bed.address(sender), 0))
    block = bytes(2**20)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            for offset in range(0, size, len(block)):
                conn.sendall(block[: min(len(block), size - offset)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with entered(bed.namespace(receiver)):
        client = socket.create_connection((bed.address(sender), server.getsockname()[1]))
    started, got = time.perf_counter(), 0
    with client, server:
        while got < size:
            data = client.recv(2**20)
            if not data:
                break
            got += len(data)
    seconds = time.perf_counter() - started
    thread.join()
    if got != size:
        raise RuntimeError(f"the TCP transfer stopped after {got} of {size} bytes")
    return seconds


async def main(sizes: list[int], bed: Testbed | None = None) -> None:
    config = CatchupConfig()
    run_id = f"bench-catchup-{uuid.uuid4().hex[:8]}"
    snapshots: dict[int, tuple[bytes, dict]] = {}
    peers = []
    try:
        for i in range(HOLDERS + 1):
            initial = peers[0].visible_maddrs() if peers else []
            host = [bed.listen_maddr(i)] if bed else ["/ip4/127.0.0.1/tcp/0"]
            t = HivemindTransport(
                Identity.from_seed(f"bench-catchup/{i}".encode()), run_id=run_id, initial_peers=initial, host_maddrs=host
            )
            with entered(bed.namespace(i)) if bed else contextlib.nullcontext():
                await t.start()
            peers.append(t)
        holders, joiner = peers[:HOLDERS], peers[HOLDERS]
        for t in holders:
            holder_handlers(t, snapshots, config.chunk_bytes)
        await joiner.wait_for_members(HOLDERS + 1, 60)
        ids = tuple(t.peer_id for t in holders)
        tcp_head = f" {'tcp s':>8} {'x tcp':>6} {'tcp MB/s':>9}" if bed else ""
        print(f"{'params':>8} {'MB':>8} {'catch-up s':>11} {'raw s':>8} {'ratio':>6} {'catch-up MB/s':>14} {'raw MB/s':>9}{tcp_head}")
        for step, millions in enumerate(sizes):
            state = encode({"model": {"w": torch.randn(millions * 10**6, generator=torch.Generator().manual_seed(step))}})
            manifest = manifest_of(state, config.chunk_bytes)
            snapshots[step] = (state, manifest)
            choice = Agreed(step, manifest_digest(manifest), ids)
            started = time.perf_counter()
            data = await fetch_snapshot(joiner, choice, config)
            catchup = time.perf_counter() - started
            assert data == state
            started = time.perf_counter()
            for offset in range(0, len(state), config.chunk_bytes):
                size = min(config.chunk_bytes, len(state) - offset)
                await joiner.request(ids[0], "raw", size.to_bytes(8, "little"), 120)
            raw = time.perf_counter() - started
            mb = len(state) / 1e6
            tcp = ""
            if bed:
                seconds = await asyncio.get_running_loop().run_in_executor(None, tcp_seconds, bed, 0, HOLDERS, len(state))
                tcp = f" {seconds:8.2f} {catchup / seconds:6.2f} {mb / seconds:9.2f}"
            print(f"{millions:>7}M {mb:8.1f} {catchup:11.2f} {raw:8.2f} {catchup / raw:6.2f} {mb / catchup:14.1f} {mb / raw:9.1f}{tcp}", flush=True)
            del snapshots[step]
    finally:
        for t in peers:
            await t.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1,10,50", help="model sizes in millions of parameters")
    parser.add_argument("--netns", action="store_true", help="peers in network namespaces; the joiner's link shaped")
    parser.add_argument("--rate", type=float, default=10.0, help="the joiner's link rate in Mbit/s (with --netns)")
    parser.add_argument("--delay", type=float, default=0.0, help="the joiner's link delay in ms, each direction (with --netns)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.params.split(",")]
    if args.netns:
        with Testbed(NetnsConfig(HOLDERS + 1, ((HOLDERS, LinkShape(rate_mbit=args.rate, delay_ms=args.delay)),))) as testbed:
            asyncio.run(main(sizes, testbed))
    else:
        asyncio.run(main(sizes))
