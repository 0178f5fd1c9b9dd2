"""BTARD overhead: secure round time / plain butterfly time, same transport, d = 1M.

    PYTHONPATH=. python bench/btard_overhead.py [--dim 1000000] [--rounds 5] [--no-hivemind] [--no-simulator] [--inline]

Simulator: 16 peers in one process; prints simulated seconds per step (the
network model: latency, bandwidth, queueing; compute is not charged) and
CPU seconds per step (all 16 peers' real work on one core, so hashing,
CenteredClip, projections and the validators' recomputation all count; CPU
time, unlike wall time, does not depend on what else the machine runs).
Hivemind: 4 OS processes on loopback, wall seconds per step on peer 0.
Gradients are synthetic (a seeded normal vector per peer and step), so a
validator's "recomputation" regenerates it; the first round is a warm-up.
BTARD verifies each step in the background of the next (App. B); `--inline`
also measures `btard.background=false` (verification before the SGD step).
Prints figures only; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from phalanx.algorithms.btard.bans import BanLedger  # noqa: E402
from phalanx.core.identity import Identity  # noqa: E402
from phalanx.core.rng import torch_stream  # noqa: E402
from phalanx.runtime.rounds.btard import BTARDConfig, SecureRound  # noqa: E402
from phalanx.runtime.rounds.butterfly import AllReduceConfig, ButterflyAllReduce  # noqa: E402

SECURE = AllReduceConfig(reducer="centered_clip", tau=1.0, timeout=60.0)
PLAIN = AllReduceConfig(reducer="mean", timeout=60.0)


def gradient(peer: str, step: int, dim: int, peers: int = 16) -> torch.Tensor:
    """A shared direction plus per-peer noise whose parts differ by about tau = 1 (clipping active, as in BTARD)."""
    common = torch.randn(dim, generator=torch_stream(0, "overhead", step))
    noise = torch.randn(dim, generator=torch_stream(0, "overhead", peer, step))
    return common + noise * (peers / dim) ** 0.5


def make_round(transport, dim: int, secure: bool, index: int, background: bool = True):
    if not secure:
        return ButterflyAllReduce(transport, dim, PLAIN.build_reducer(), PLAIN)
    entropy = torch_stream(0, "entropy", index)
    return SecureRound(
        transport, dim, SECURE, BTARDConfig(enabled=True, validators=2, timeout=60.0, background=background), BanLedger(),
        lambda peer, step: gradient(peer, step, dim),
        entropy=lambda k: bytes(torch.randint(0, 256, (k,), generator=entropy, dtype=torch.uint8).tolist()),
    )


def simulated(dim: int, peers: int, rounds: int, secure: bool, background: bool = True) -> tuple[float, float]:
    """(simulated seconds, CPU seconds of the process) per step after the warm-up round."""
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    torch.set_num_threads(1)
    identities = [Identity.from_seed(f"overhead/{i}".encode()) for i in range(peers)]
    marks: list[tuple[float, float]] = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = [network.add_peer(identity) for identity in identities]
        group = sorted(t.peer_id for t in transports)
        rounds_ = [make_round(t, dim, secure, i, background) for i, t in enumerate(transports)]

        def factory(i):
            async def run():
                for step in range(1 + rounds):
                    await rounds_[i](step, gradient(transports[i].peer_id, step, dim), group)
                    if i == 0:
                        marks.append((asyncio.get_running_loop().time(), time.process_time()))
                if secure:
                    await rounds_[i].settle()  # the last steps' background verification

            return run

        tasks = [network.spawn(identities[i].peer_id, factory(i)) for i in range(peers)]
        for task in tasks:
            await task

    run_simulation(main)
    return (marks[-1][0] - marks[0][0]) / rounds, (marks[-1][1] - marks[0][1]) / rounds


def _hivemind_worker(index: int, dim: int, peers: int, rounds: int, secure: bool, run_id: str, initial: list[str], queue, barrier) -> None:
    asyncio.run(_hivemind_peer(index, dim, peers, rounds, secure, run_id, initial, queue, barrier))


async def _hivemind_peer(index, dim, peers, rounds, secure, run_id, initial, queue, barrier) -> None:
    from phalanx.transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    transport = HivemindTransport(Identity.from_seed(f"{run_id}/{index}".encode()), run_id=run_id, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await transport.start()
    try:
        if index == 0:
            queue.put(transport.visible_maddrs())
        group = await transport.wait_for_members(peers, 120.0)
        round_ = make_round(transport, dim, secure, index)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, barrier.wait)
        times = []
        for step in range(1 + rounds):
            started = time.perf_counter()
            await round_(step, gradient(transport.peer_id, step, dim), group)
            times.append(time.perf_counter() - started)
        if secure:
            await round_.settle()
        if index == 0:
            queue.put(statistics.mean(times[1:]))
        await loop.run_in_executor(None, barrier.wait)  # nobody leaves while another still pulls
    finally:
        await transport.stop()


def hivemind(dim: int, peers: int, rounds: int, secure: bool) -> float:
    """Wall seconds per step on peer 0 of `peers` OS processes."""
    ctx = multiprocessing.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(peers)
    run_id = f"overhead-{'secure' if secure else 'plain'}-{time.time_ns()}"
    procs = [ctx.Process(target=_hivemind_worker, args=(0, dim, peers, rounds, secure, run_id, [], queue, barrier))]
    procs[0].start()
    try:
        initial = queue.get(timeout=120)
        for i in range(1, peers):
            procs.append(ctx.Process(target=_hivemind_worker, args=(i, dim, peers, rounds, secure, run_id, initial, queue, barrier)))
            procs[-1].start()
        return queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sim-peers", type=int, default=16)
    parser.add_argument("--hivemind-peers", type=int, default=4)
    parser.add_argument("--no-hivemind", action="store_true")
    parser.add_argument("--no-simulator", action="store_true")
    parser.add_argument("--inline", action="store_true", help="also measure btard.background=false in the simulator")
    args = parser.parse_args()
    if not args.no_simulator:
        plain_v, plain_w = simulated(args.dim, args.sim_peers, args.rounds, secure=False)
        secure_v, secure_w = simulated(args.dim, args.sim_peers, args.rounds, secure=True)
        print(f"simulator, n={args.sim_peers}, d={args.dim}: plain {plain_v:.4f} s/step simulated ({plain_w:.2f} CPU s), "
              f"BTARD {secure_v:.4f} s/step simulated ({secure_w:.2f} CPU s)")
        print(f"  ratio simulated {secure_v / plain_v:.3f}, ratio CPU (all peers on one core) {secure_w / plain_w:.3f}")
        if args.inline:
            inline_v, inline_w = simulated(args.dim, args.sim_peers, args.rounds, secure=True, background=False)
            print(f"  BTARD with btard.background=false: {inline_v:.4f} s/step simulated ({inline_w:.2f} CPU s), "
                  f"ratio simulated {inline_v / plain_v:.3f}, ratio CPU {inline_w / plain_w:.3f}")
    if not args.no_hivemind:
        plain = hivemind(args.dim, args.hivemind_peers, args.rounds, secure=False)
        secure = hivemind(args.dim, args.hivemind_peers, args.rounds, secure=True)
        print(f"hivemind, n={args.hivemind_peers}, d={args.dim}: plain {plain:.3f} s/step, BTARD {secure:.3f} s/step, ratio {secure / plain:.3f}")


if __name__ == "__main__":
    main()
