"""Aspis+ over hivemind: a coordinator and 7 worker processes on the Fano plane; one Byzantine is detected.

Where a netns test bed can be built (root, `ip netns`: on CI) each process runs in its own network namespace,
worker 1 behind a 10 Mbit link: the run must say so (summary.json `netns`) and listen on the bed's addresses."""

import os

import pytest

from phalanx.api import launch
from phalanx.runs.aspis.config import AspisAttackConfig, AspisRunConfig
from phalanx.runs.aspis.run import coalition
from phalanx.runs.netns import unavailable_reason
from phalanx.runtime.aspis.roles import AspisConfig
from phalanx.runtime.dp.peer import TrainConfig

pytestmark = pytest.mark.hivemind


def test_fano_plane_coordinator_and_seven_workers_detect_the_byzantine(tmp_path):
    config = AspisRunConfig(
        preset="aspis-fano-test",
        peers=8,
        steps=3,
        seed=1010,  # identities differ from other swarms' on the same host (most use seed 0)
        aspis=AspisConfig(scheme="aspis+", q=1, window=10, samples_per_file=4, timeout=60.0),
        attack=AspisAttackConfig(orchestration="att1", distortion="constant"),
        train=TrainConfig(task="digits-mlp", lr=0.1, eval_every=3),
    )
    netns = unavailable_reason() is None
    summary = launch(config, tmp_path / "run", progress=False, netns="1:rate=10mbit" if netns else None)
    byzantine = sorted(coalition(config).byzantine)
    assert summary["mode"] == "launch" and summary["steps"] == 3
    assert summary["detection_delays"] == [1]  # flagged in the first iteration
    assert summary["byzantine"] == byzantine
    for pgid in summary["process_groups"]:  # every worker, its DHT child and its p2pd are gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    rows = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert summary["final_accuracy"] is not None and summary["final_loss"] < 2.3
    first = (tmp_path / "run" / "peers" / "0.addr").read_text()
    if netns:  # the coordinator listened on host 0's address, every process had its host, worker 1's link was shaped
        assert first.startswith("/ip4/10.77.0.1/tcp/")
        hosts = summary["netns"]
        assert {name: (h["host"], h["address"]) for name, h in hosts.items()} == {str(i): (i, f"10.77.0.{i + 1}") for i in range(8)}
        assert hosts["1"]["link"].startswith("rate 10mbit (") and hosts["2"]["link"] == "unshaped"
    else:
        assert first.startswith("/ip4/127.0.0.1/tcp/") and "netns" not in summary
