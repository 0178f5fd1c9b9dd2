"""Five real processes over hivemind (1 data node, 2 stages x 2 relays); one relay is killed mid-run."""

import dataclasses
import json
import os

import pytest

from phalanx.runs.pipeline.config import ChurnConfig
from phalanx.runs.pipeline.launch import launch_pipeline
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runs.presets import get_preset

pytestmark = pytest.mark.hivemind


def test_five_processes_survive_a_relay_killed_mid_iteration(tmp_path):
    config = dataclasses.replace(
        get_preset("chars-gpt-pipeline"), peers=5, steps=4,
        faults=ChurnConfig(crash_relay=1, crash_iteration=2, crash_at=0.0),
    )
    real = launch_pipeline(config, tmp_path / "launch", progress=False)
    victim = real["peer_ids"][config.data_nodes + 1]
    assert real["killed"] == victim
    rows = [json.loads(line) for line in (tmp_path / "launch" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["completed"] == 4 and r["deferred"] == 0 for r in rows)
    mbs = [json.loads(line) for line in (tmp_path / "launch" / "microbatches.jsonl").read_text().splitlines()]
    assert all(victim not in mb["path"] for mb in mbs if mb["it"] == 3)
    # Same seed, same public batches: no microbatch was lost, so the loss follows the simulated run.
    simulated = simulate_pipeline(dataclasses.replace(config, faults=ChurnConfig()), progress=False)
    assert real["final_loss"] == pytest.approx(simulated["metrics"][-1]["loss"], rel=0.05)
    for pgid in real["process_groups"]:  # every worker, its DHT child and its p2pd are gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
