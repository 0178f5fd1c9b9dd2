"""Real processes over hivemind with SENTINEL's boundary verifiers and GWTF routing: 5 pipeline workers and 3
verifier processes (one per stage boundary, started by `phalanx launch`); a zero-sending relay is banned.
(Client-routed verification, the data node placement, is covered in the simulator by test_sentinel_pipeline.)"""

import json
import os

import pytest

from phalanx.runs.config import override
from phalanx.runs.pipeline.launch import launch_pipeline
from phalanx.runs.presets import get_preset

pytestmark = pytest.mark.hivemind


def test_boundary_verifiers_ban_a_lying_relay_under_gwtf_over_real_processes(tmp_path):
    # 1 data node + 2 stages x 2 relays, GWTF routing; relay 1 (stage 2, the head) sends zeros from iteration 7;
    # warm-up: 20 tensors per link and direction (5 iterations of 4 microbatches).
    config = override(get_preset("chars-gpt-pipeline"), [
        "peers=5", "steps=12", "train.lr=0.001", "pipeline.routing=gwtf", "sentinel.enabled=true",
        "sentinel.placement=boundary", "sentinel.warmup=20", "attack.name=zeros", "attack.relays=1", "attack.start=7",
    ])
    summary = launch_pipeline(config, tmp_path / "launch", progress=False)
    liar = summary["peer_ids"][config.data_nodes + 1]
    bans = [json.loads(line) for line in (tmp_path / "launch" / "bans.jsonl").read_text().splitlines()]
    assert {b["peer"] for b in bans} == {liar} and all(b["reason"] == "sentinel" and b["step"] >= 7 for b in bans)
    assert {b["by"] for b in bans} <= set(summary["verifier_ids"].values())  # banned by a verifier process
    attacks = [json.loads(line) for line in (tmp_path / "launch" / "attacks.jsonl").read_text().splitlines()]
    assert any(a["tampered"] for a in attacks) and {a["peer"] for a in attacks} == {liar}
    rows = [json.loads(line) for line in (tmp_path / "launch" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["completed"] == 4 for r in rows)
    mbs = [json.loads(line) for line in (tmp_path / "launch" / "microbatches.jsonl").read_text().splitlines()]
    after = [mb for mb in mbs if mb["it"] > max(b["step"] for b in bans)]
    assert after and all(liar not in mb["path"] for mb in after)
    assert len(summary["process_groups"]) == 5 + 3
    for pgid in summary["process_groups"]:  # every worker and verifier, its DHT child and its p2pd are gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
