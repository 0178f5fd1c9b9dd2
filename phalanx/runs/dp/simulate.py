"""`phalanx simulate`: a whole swarm in one process on the deterministic simulator."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...core.rng import py_stream
from ...transport.sim import SimNetwork, run_simulation
from ..live import LiveLog
from .checkpoints import Checkpoint, SimCheckpoints
from .churn import FaultDriver
from .config import RunConfig
from .swarm import Recorder, peer_identity, sim_config


def peer_speeds(config: RunConfig) -> list[float]:
    """Per-peer FLOP/s: the median speed spread log-normally by network.flops_spread."""
    rng = py_stream(config.seed, "speeds")
    return [config.network.flops * math.exp(config.network.flops_spread * rng.gauss(0.0, 1.0)) for _ in range(config.peers)]


def simulate(config: RunConfig, out: Path, progress: bool = True, resume: Checkpoint | None = None) -> dict:
    """Run `config` in the simulator, write the run's files to `out`, return the summary.

    With `config.checkpoint.every`, checkpoints go to `out`/checkpoints; `resume` continues from one.
    """
    torch.set_num_threads(1)  # one thread: deterministic kernels and no oversubscription
    wall_start = time.perf_counter()
    identities = [peer_identity(config.seed, i) for i in range(config.peers + config.faults.join)]
    ids = [identity.peer_id for identity in identities]
    recorder = Recorder(config, ids)
    live = LiveLog(out, config.to_json())
    index_of = {peer: i for i, peer in enumerate(ids)}
    checkpoints = SimCheckpoints(config, out, recorder.records, resume) if config.checkpoint.every or resume else None
    bar = tqdm(total=config.steps, desc=f"simulate {config.preset}", disable=not progress, leave=False)
    driver: FaultDriver | None = None

    async def main() -> tuple[float, dict]:
        nonlocal driver
        network = SimNetwork(sim_config(config.network, config.seed))
        speeds = peer_speeds(config) + [config.network.flops] * config.faults.join  # joiners: the median speed
        transports = [network.add_peer(identity, flops=speed) for identity, speed in zip(identities, speeds)]
        if checkpoints is not None:
            await checkpoints.begin(network)
        progress_step = -1

        def on_step(record: dict) -> None:
            nonlocal progress_step
            recorder.add(record)
            live.write(index_of[record["peer"]], record)
            if record["step"] > progress_step:
                bar.update(record["step"] - progress_step)
                progress_step = record["step"]

        driver = FaultDriver(config, network, transports, on_step, checkpoints.for_peer if checkpoints else None)
        for index in range(config.peers):
            driver.start(index)
        await driver.wait()
        stats = network.stats()
        return asyncio.get_running_loop().time(), checkpoints.network_stats(stats) if checkpoints else stats

    try:
        simulated_seconds, stats = run_simulation(main)
    finally:
        bar.close()
        live.close()
    recorder.crashed = sorted(driver.crashed_ever, key=ids.index)
    return recorder.write(
        out,
        {
            "mode": "simulate",
            "joins": driver.joins,
            "wall_seconds": time.perf_counter() - wall_start,
            "simulated_seconds": simulated_seconds,
            "network": stats,
        },
    )
