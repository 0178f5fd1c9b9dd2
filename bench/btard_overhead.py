"""BTARD overhead: secure round time / plain butterfly time, same transport, d = 1M.

    PYTHONPATH=. python bench/btard_overhead.py [--dim 1000000] [--rounds 5] [--no-hivemind] [--no-simulator] [--inline]
        [--pairs 1] [--trace DIR] [--cprofile DIR]

Simulator: 16 peers in one process; prints simulated seconds per step (the
network model: latency, bandwidth, queueing; compute is not charged) and
CPU seconds per step (all 16 peers' real work on one core, so hashing,
CenteredClip, projections and the validators' recomputation all count; CPU
time, unlike wall time, does not depend on what else the machine runs).
Hivemind: 4 OS processes on loopback, wall seconds per step on peer 0, and CPU seconds per step of
all 4 peers' process trees (each worker, its DHT process and its libp2p daemon: read from /proc, so
it does not depend on what else the machine runs, as wall time on a shared machine does); `--pairs N`
runs plain and secure alternately N times (the machine's load moves between runs: compare within a pair).
`--trace DIR` writes a timestamp trace of each secure worker (`bench/btard_trace.py`, which prints
its phase table), `--cprofile DIR` a cProfile of each secure worker (both slow the run down a little).
Gradients are synthetic (a seeded normal vector per peer and step), so a
validator's "recomputation" regenerates it; the first round is a warm-up.
BTARD verifies each step in the background of the next (App. B); `--inline`
also measures `btard.background=false` (verification before the SGD step).
Prints figures only; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import os
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


def make_round(transport, dim: int, secure: bool, index: int, background: bool = True, wrap=lambda recompute: recompute):
    if not secure:
        return ButterflyAllReduce(transport, dim, PLAIN.build_reducer(), PLAIN)
    entropy = torch_stream(0, "entropy", index)
    return SecureRound(
        transport, dim, SECURE, BTARDConfig(enabled=True, validators=2, timeout=60.0, background=background), BanLedger(),
        wrap(lambda peer, step: gradient(peer, step, dim)),
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


def _hivemind_worker(index: int, dim: int, peers: int, rounds: int, secure: bool, run_id: str, initial: list[str], queue, barrier,
                     trace: str | None = None, profile: str | None = None) -> None:
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(_hivemind_peer(index, dim, peers, rounds, secure, run_id, initial, queue, barrier, trace))
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(Path(profile) / f"peer{index}.prof"))


async def _hivemind_peer(index, dim, peers, rounds, secure, run_id, initial, queue, barrier, trace=None) -> None:
    from phalanx.transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    identity = Identity.from_seed(f"{run_id}/{index}".encode())
    tracer = None
    if trace:
        import btard_trace as tracer

        tracer.install(Path(trace) / f"peer{index}.jsonl", identity.peer_id)
    transport = HivemindTransport(identity, run_id=run_id, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await transport.start()
    watch = None
    try:
        if index == 0:
            queue.put(transport.visible_maddrs())
        group = await transport.wait_for_members(peers, 120.0)
        round_ = make_round(transport, dim, secure, index, wrap=tracer.traced_recompute if tracer else lambda f: f)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, barrier.wait)
        watch = asyncio.ensure_future(tracer.watch_loop()) if tracer else None
        times = []
        cpu = 0.0
        for step in range(1 + rounds):
            if step == 1:
                cpu = -tree_cpu_seconds()
            started = time.perf_counter()
            mark = time.monotonic()
            await round_(step, gradient(transport.peer_id, step, dim), group)
            times.append(time.perf_counter() - started)
            if tracer:
                tracer.mark_step(step, mark, time.monotonic())
        cpu += tree_cpu_seconds()  # step 0's verification ran in step 1; the last step's is not all in
        if secure:
            await round_.settle()
        queue.put((index, statistics.mean(times[1:]), cpu / rounds))
        await loop.run_in_executor(None, barrier.wait)  # nobody leaves while another still pulls
    finally:
        if watch is not None:
            watch.cancel()
        if tracer:
            tracer.close()
        await transport.stop()


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and every live descendant (the DHT process, the daemon)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, frontier = 0.0, {os.getpid()}
    while frontier:
        total += sum(stats[pid][1] for pid in frontier if pid in stats)
        frontier = {pid for pid, (ppid, _) in stats.items() if ppid in frontier}
    return total


def hivemind(dim: int, peers: int, rounds: int, secure: bool, trace: str | None = None, profile: str | None = None) -> tuple[float, float]:
    """(wall seconds per step on peer 0, CPU seconds per step of all peers' process trees) of `peers` OS processes."""
    ctx = multiprocessing.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(peers)
    run_id = f"overhead-{'secure' if secure else 'plain'}-{time.time_ns()}"
    for directory in (trace, profile):
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
    probes = (trace, profile)
    procs = [ctx.Process(target=_hivemind_worker, args=(0, dim, peers, rounds, secure, run_id, [], queue, barrier, *probes))]
    procs[0].start()
    try:
        initial = queue.get(timeout=120)
        for i in range(1, peers):
            procs.append(ctx.Process(target=_hivemind_worker, args=(i, dim, peers, rounds, secure, run_id, initial, queue, barrier, *probes)))
            procs[-1].start()
        results = dict((index, (wall, cpu)) for index, wall, cpu in (queue.get(timeout=600) for _ in range(peers)))
        return results[0][0], sum(cpu for _, cpu in results.values())
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
    parser.add_argument("--pairs", type=int, default=1, help="hivemind: plain and secure runs, alternately, this many times each")
    parser.add_argument("--trace", help="hivemind: write a timestamp trace of each secure worker to this directory")
    parser.add_argument("--cprofile", help="hivemind: write a cProfile of each secure worker to this directory")
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
        ratios, cpu_ratios = [], []
        for pair in range(args.pairs):
            plain, plain_cpu = hivemind(args.dim, args.hivemind_peers, args.rounds, secure=False)
            secure, secure_cpu = hivemind(args.dim, args.hivemind_peers, args.rounds, secure=True, trace=args.trace, profile=args.cprofile)
            ratios.append(secure / plain)
            cpu_ratios.append(secure_cpu / plain_cpu)
            print(f"hivemind, n={args.hivemind_peers}, d={args.dim}: plain {plain:.3f} s/step, BTARD {secure:.3f} s/step, ratio {secure / plain:.3f}; "
                  f"CPU s/step (4 peers) plain {plain_cpu:.2f}, BTARD {secure_cpu:.2f}, ratio {secure_cpu / plain_cpu:.3f}", flush=True)
        if args.pairs > 1:
            print(f"  ratios {' '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}; "
                  f"CPU ratios {' '.join(f'{r:.3f}' for r in cpu_ratios)}; median {statistics.median(cpu_ratios):.3f}")
        if args.trace:
            import btard_trace

            print(btard_trace.table(Path(args.trace)))


if __name__ == "__main__":
    main()
