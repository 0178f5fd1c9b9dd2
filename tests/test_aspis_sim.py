"""Aspis roles over the simulated transport: detection end to end, bad workers never crash the coordinator."""

import asyncio

import pytest
import torch

from phalanx.core.errors import ConfigError
from phalanx.runs.aspis.config import AspisAttackConfig, AspisRunConfig
from phalanx.runs.aspis.run import (
    build_role,
    coalition,
    detection_delays,
    simulate_aspis,
)
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runtime.aspis.roles import AspisConfig, AspisWorker
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def _config(orchestration: str, **aspis) -> AspisRunConfig:
    return AspisRunConfig(
        peers=8,
        steps=3,
        aspis=AspisConfig(scheme="aspis", r=3, q=2, tolerance=0.0, **aspis),
        attack=AspisAttackConfig(orchestration=orchestration, distortion="reversed"),
        train=TrainConfig(task="digits-mlp", lr=0.1, eval_every=3),
    )


def test_att1_byzantines_are_detected_in_the_first_iteration_and_excluded():
    attacked = _config("att1")
    byzantine = sorted(coalition(attacked).byzantine)
    run = simulate_aspis(attacked, None, progress=False)["records"]
    assert all(r["detected"] and r["flagged"] == byzantine for r in run)
    assert all(r["files_used"] == 35 and r["distorted_fraction"] == 0 for r in run)  # no file is all-Byzantine at q = 2
    # Excluded means excluded: the model follows the honest run bit for bit (copies are exact on CPU).
    clean = simulate_aspis(_config("none"), None, progress=False)["records"]
    assert [r["loss"] for r in run] == [r["loss"] for r in clean]
    assert run[-1]["test_accuracy"] == clean[-1]["test_accuracy"]


class _Garbage(AspisWorker):
    """Answers every task with bytes that do not decode."""

    async def _serve(self, sender: str, payload: bytes) -> bytes:
        return b"not a phalanx message"


def test_silent_and_malformed_workers_count_as_disagreement():
    config = _config("none")
    ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
    records: list[dict] = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = [network.add_peer(peer_identity(config.seed, i)) for i in range(config.peers)]
        roles = [build_role(config, transports[i], i, ids) for i in range(config.peers)]
        garbage = _Garbage(transports[6], roles[6].task, config.aspis, config.seed, ids[0], 5, config.workers)
        roles[6] = garbage
        for i in range(1, config.peers):
            if i != 3:  # worker 2 (peer 3) never starts: silent
                network.spawn(ids[i], roles[i].run)
        await asyncio.sleep(0)
        await roles[0].run(config.steps, records.append)
        return transports[0].evidence

    evidence = run_simulation(main)
    assert len(records) == config.steps
    assert all(r["detected"] and r["flagged"] == [2, 5] and r["silent"] == [2, 5] for r in records)
    assert {e.peer for e in evidence} == {ids[6]} and all(e.kind == "malformed" for e in evidence)
    assert records[-1]["loss"] < records[0]["loss"]


def test_aspis_plus_att3_detects_within_a_few_iterations():
    config = AspisRunConfig(
        peers=8,
        steps=12,
        aspis=AspisConfig(scheme="aspis+", q=2, window=12, samples_per_file=4),
        attack=AspisAttackConfig(orchestration="att3", distortion="constant", redraw_every=50),
        train=TrainConfig(task="digits-mlp", lr=0.1, eval_every=12),
    )
    summary = simulate_aspis(config, None, progress=False)
    byzantine = sorted(coalition(config).byzantine_at(0))
    delays = detection_delays(config, summary["records"])
    assert delays[0] is not None and delays[0] <= 6
    assert summary["records"][-1]["flagged"] == byzantine
    assert torch.isfinite(torch.tensor(summary["records"][-1]["loss"]))


def test_baselines_in_the_same_harness():
    detox = AspisRunConfig(
        peers=7,
        steps=2,
        aspis=AspisConfig(scheme="detox", r=3, q=2, samples_per_file=4),
        attack=AspisAttackConfig(orchestration="majority", distortion="reversed"),
    )
    records = simulate_aspis(detox, None, progress=False)["records"]
    # The optimal choice against DETOX puts both Byzantines in group 0: its vote is won by the lie.
    assert coalition(detox).byzantine == frozenset({0, 1})
    assert [r["distorted_fraction"] for r in records] == [0.5, 0.5]
    plain = AspisRunConfig(
        peers=8,
        steps=2,
        aspis=AspisConfig(scheme="none", q=2, aggregator="multi_krum", samples_per_file=8),
        attack=AspisAttackConfig(orchestration="att1", distortion="constant"),
    )
    records = simulate_aspis(plain, None, progress=False)["records"]
    assert [r["distorted_fraction"] for r in records] == [2 / 7, 2 / 7]
    assert records[-1]["loss"] < records[0]["loss"]  # Multi-Krum drops the constant vectors
    with pytest.raises(ConfigError, match="bulyan needs K >= 4q \\+ 3 = 11"):
        AspisRunConfig(peers=8, aspis=AspisConfig(scheme="none", q=2, aggregator="bulyan"))
