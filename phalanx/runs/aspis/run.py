"""Aspis runs: who is who, and the simulated run (the config and presets are in `config.py` and `presets.py`).

Peer 0 is the trusted coordinator and peers 1..K are the workers (K = peers - 1).
The Byzantine workers and their coalition plan come from the seed and the
attack config; only the worker policies and the run record see them, never the
coordinator. A run writes config.json, metrics.jsonl (one row per iteration,
from the coordinator) and summary.json, like `simulate` does for swarms.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...algorithms.aspis.attacks import Orchestration, detox_optimal_byzantine
from ...algorithms.robust.attacks import AttackSchedule, make_attack
from ...core.errors import ConfigError
from ...core.rng import py_stream
from ...runtime.aspis.roles import (
    AspisCoordinator,
    AspisWorker,
    LiePolicy,
    assignment_at,
)
from ...runtime.dp.peer import task_of
from ...training.task import Task
from ...transport.base import Transport
from ...transport.sim import SimNetwork, run_simulation
from ..dp.swarm import peer_identity, sim_config
from ..live import LiveLog
from .config import AspisRunConfig


def coalition(config: AspisRunConfig) -> Orchestration | None:
    """The Byzantines' plan (None for an honest run): drawn from the seed, unknown to the coordinator."""
    kind = config.attack.orchestration
    if kind == "none" or config.byzantine_count == 0:
        return None
    k, q = config.workers, config.byzantine_count
    stream = py_stream(config.seed, "aspis-byzantine")
    if kind == "majority" and config.aspis.scheme == "detox":
        byzantine = detox_optimal_byzantine(k, config.aspis.r, q)
    else:
        byzantine = frozenset(stream.sample(range(k), q))
    targets = frozenset(stream.sample(sorted(set(range(k)) - byzantine), q)) if kind == "att2" else frozenset()
    if kind == "att3":
        byzantine = frozenset()
    return Orchestration(kind, k, q, byzantine, targets, config.attack.redraw_every, config.seed)


def distortion_of(config: AspisRunConfig):
    return make_attack(config.attack.distortion, AttackSchedule())


def build_role(config: AspisRunConfig, transport: Transport, index: int, ids: list[str]) -> AspisCoordinator | AspisWorker:
    """Peer `index` of the run: the coordinator (0) or worker index - 1."""
    task = task_of(config.train, config.task)
    if type(task).examples is Task.examples:
        raise ConfigError(f"task {task.name!r} has no examples(indices) method: the Aspis kind draws its files by sample index")
    if index == 0:
        return AspisCoordinator(transport, task, config.aspis, config.train, config.seed, ids[1:])
    plan = coalition(config)
    policy = None
    if plan is not None and (plan.kind == "att3" or index - 1 in plan.byzantine):
        policy = LiePolicy(plan, distortion_of(config))
    return AspisWorker(transport, task, config.aspis, config.seed, ids[0], index - 1, config.workers, policy, config.train.device)


def count_distortion(config: AspisRunConfig, records: list[dict]) -> None:
    """Replace each record's per-file `chosen` workers by `distorted_fraction`: files dropped or won by a lie."""
    plan = coalition(config)
    for record in records:
        chosen = record.pop("chosen")
        assignment = assignment_at(config.aspis, config.workers, config.seed, record["step"])
        lies = plan.distorted_files(record["step"], assignment) if plan else frozenset()
        liars = plan.byzantine_at(record["step"]) if plan else frozenset()
        bad = sum(1 for i, w in enumerate(chosen) if w < 0 or (i in lies and w in liars))
        record["distorted_fraction"] = bad / len(chosen)


def detection_delays(config: AspisRunConfig, records: list[dict], from_window: bool = False) -> list[int | None]:
    """Per Byzantine window: iterations until every Byzantine of the window was flagged (None: never).

    Counted from the change of the Byzantine set, or with `from_window` from the
    first Aspis+ detection window that starts at or after it (Alg. 3 assumes the
    set is fixed inside a detection window).
    """
    plan = coalition(config)
    if plan is None:
        return []
    span = plan.redraw_every if plan.kind == "att3" else config.steps
    delays: list[int | None] = []
    for start in range(0, config.steps, span):
        origin = start
        if from_window and config.aspis.scheme == "aspis+":
            origin = -(-start // config.aspis.window) * config.aspis.window
        delay = None
        for record in records[origin : start + span]:
            if plan.byzantine_at(record["step"]) <= set(record["flagged"]):
                delay = record["step"] - origin + 1
                break
        delays.append(delay)
    return delays


def summarize(config: AspisRunConfig, records: list[dict], extra: dict) -> dict:
    """The run's summary: final accuracy, Byzantines, detection delays, mean distorted fraction."""
    evaluated = [r for r in records if "test_accuracy" in r]
    plan = coalition(config)
    return {
        "preset": config.preset,
        "peers": config.peers,
        "steps": config.steps,
        "seed": config.seed,
        "scheme": config.aspis.scheme,
        "final_loss": records[-1]["loss"] if records else None,
        "final_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
        "byzantine": sorted(plan.byzantine_at(0)) if plan else [],
        "detection_delays": detection_delays(config, records),
        "detection_delays_from_window": detection_delays(config, records, from_window=True),
        "detected_iterations": sum(1 for r in records if r["detected"]),
        "mean_distorted_fraction": sum(r["distorted_fraction"] for r in records) / len(records) if records else None,
        **extra,
    }


def write_run(config: AspisRunConfig, records: list[dict], out: Path, summary: dict) -> dict:
    """Write config.json, metrics.jsonl and summary.json; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.to_json() + "\n")
    with open(out / "metrics.jsonl", "w") as f:
        for row in records:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def simulate_aspis(config: AspisRunConfig, out: Path | None, progress: bool = True) -> dict:
    """Run `config` on the simulator; write the run's files to `out` (if given) and return the summary."""
    torch.set_num_threads(1)
    wall_start = time.perf_counter()
    identities = [peer_identity(config.seed, i) for i in range(config.peers)]
    ids = [identity.peer_id for identity in identities]
    records: list[dict] = []
    live = LiveLog(out, config.to_json())
    bar = tqdm(total=config.steps, desc=f"simulate {config.preset}", disable=not progress, leave=False)

    def on_iteration(record: dict) -> None:
        records.append(record)
        count_distortion(config, records[-1:])
        live.write(0, record)
        bar.update(1)

    async def main() -> tuple[float, dict]:
        network = SimNetwork(sim_config(config.network, config.seed))
        transports = [network.add_peer(identity) for identity in identities]
        roles = [build_role(config, transports[i], i, ids) for i in range(config.peers)]
        done = asyncio.Event()

        async def coordinator_main() -> None:
            await asyncio.sleep(0)  # let the workers register their handlers first
            await roles[0].run(config.steps, on_iteration)
            done.set()

        for i in range(1, config.peers):
            network.spawn(ids[i], roles[i].run)
        network.spawn(ids[0], coordinator_main)
        await done.wait()
        return asyncio.get_running_loop().time(), network.stats()

    try:
        simulated_seconds, stats = run_simulation(main)
    finally:
        bar.close()
        live.close()
    summary = summarize(
        config, records, {"mode": "simulate", "wall_seconds": time.perf_counter() - wall_start, "simulated_seconds": simulated_seconds}
    )
    if out is not None:
        write_run(config, records, out, summary)
    return {"records": records, **summary}
