"""`phalanx simulate`: a whole swarm in one process on the deterministic simulator."""

from __future__ import annotations

import asyncio
import gc
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig
from ..core.rng import py_stream
from ..transport.sim import LinkProfile, SimConfig, SimNetwork, run_simulation
from .swarm import Recorder, build_peer, crash_indices, peer_identity, run_peer


def peer_speeds(config: RunConfig) -> list[float]:
    """Per-peer FLOP/s: the median speed spread log-normally by network.flops_spread."""
    rng = py_stream(config.seed, "speeds")
    return [config.network.flops * math.exp(config.network.flops_spread * rng.gauss(0.0, 1.0)) for _ in range(config.peers)]


def simulate(config: RunConfig, out: Path, progress: bool = True) -> dict:
    """Run `config` in the simulator, write the run's files to `out`, return the summary."""
    if not isinstance(config, RunConfig):
        from .aspis import simulate_aspis

        return simulate_aspis(config, out, progress)
    torch.set_num_threads(1)  # one thread: deterministic kernels and no oversubscription
    wall_start = time.perf_counter()
    identities = [peer_identity(config.seed, i) for i in range(config.peers)]
    ids = [identity.peer_id for identity in identities]
    recorder = Recorder(config, ids)
    victims = [ids[i] for i in crash_indices(config)]
    bar = tqdm(total=config.steps, desc=f"simulate {config.preset}", disable=not progress, leave=False)

    async def main() -> tuple[float, dict]:
        network = SimNetwork(
            SimConfig(
                seed=config.seed,
                link=LinkProfile(latency=config.network.latency, bandwidth=config.network.bandwidth),
                loss=config.network.loss,
                detection_delay=config.network.detection_delay,
                default_flops=config.network.flops,
            )
        )
        speeds = peer_speeds(config)
        transports = [network.add_peer(identity, flops=speed) for identity, speed in zip(identities, speeds)]
        finished: dict[str, asyncio.Event] = {p: asyncio.Event() for p in ids}
        crashed = False
        progress_step = -1

        def on_step(record: dict) -> None:
            nonlocal crashed, progress_step
            recorder.add(record)
            if record["step"] > progress_step:
                bar.update(record["step"] - progress_step)
                progress_step = record["step"]
            if victims and not crashed and record["step"] >= config.faults.crash_after_step:
                crashed = True
                for victim in victims:
                    network.crash(victim)

        def factory(index: int):
            async def peer_main() -> None:
                peer = build_peer(config, transports[index], index)
                await run_peer(config, peer, index, True, on_step)
                finished[ids[index]].set()

            return peer_main

        for index, peer_id in enumerate(ids):
            network.spawn(peer_id, factory(index))
        for peer_id in ids:
            if peer_id not in victims:
                await finished[peer_id].wait()
        return asyncio.get_running_loop().time(), network.stats()

    # Hundreds of peers make millions of short-lived objects; the default
    # collector thresholds spend a quarter of the wall time scanning them.
    thresholds = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        simulated_seconds, stats = run_simulation(main)
    finally:
        gc.set_threshold(*thresholds)
        bar.close()
    return recorder.write(
        out,
        {
            "mode": "simulate",
            "wall_seconds": time.perf_counter() - wall_start,
            "simulated_seconds": simulated_seconds,
            "network": stats,
        },
    )
