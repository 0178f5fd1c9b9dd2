"""Admission over hivemind: `phalanx peer` joins a running BTARD `launch`, is untrusted, then trusted."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from phalanx.config import override
from phalanx.experiments.launch import launch
from phalanx.experiments.processes import MARKER_ENV, marked_processes
from phalanx.presets import get_preset

pytestmark = pytest.mark.hivemind

SETS = ["seed=11", "byzantine.count=0", "btard.admission_after=2", "train.eval_every=40"]


def test_peer_joining_a_running_launch_is_trusted_after_t_approvals(tmp_path):
    config = override(get_preset("btard-digits"), ["peers=4", "steps=40", *SETS])
    swarm, joiner_out = tmp_path / "swarm", tmp_path / "joiner"
    marker = f"admission-test-{os.getpid()}"
    env = {**os.environ, MARKER_ENV: marker}
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(summary=launch(config, swarm, progress=False)))
    thread.start()
    try:
        deadline = time.monotonic() + 90
        first = swarm / "peers" / "0.jsonl"
        while not (first.exists() and len(first.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and thread.is_alive(), "the launched swarm did not start training"
            time.sleep(0.2)
        addrs = (swarm / "peers" / "0.addr").read_text().split()
        cmd = [sys.executable, "-m", "phalanx.cli", "peer", "btard-digits", "--peers", "4", "--steps", "40"]
        cmd += [x for s in SETS for x in ("--set", s)] + ["--host", "/ip4/127.0.0.1/tcp/0", "--out", str(joiner_out), "--initial-peers", *addrs]
        joined = subprocess.run(cmd, env=env, timeout=150, capture_output=True, text=True)
        assert joined.returncode == 0, joined.stderr[-2000:]
    finally:
        thread.join(timeout=150)
    summary = done["summary"]
    joiner = json.loads((joiner_out / "summary.json").read_text())["peer_ids"][0]
    events = [json.loads(line) for line in (swarm / "admissions.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["peer"] == joiner] == ["untrusted", "approved", "approved", "trusted"]
    rows = [json.loads(line) for line in (swarm / "metrics.jsonl").read_text().splitlines()]
    assert all(r["admission_agree"] for r in rows) and rows[-1]["trusted"] == 5
    trusted_at = next(e["step"] for e in events if e["event"] == "trusted")
    assert all(r["group"] == 5 for r in rows if r["step"] > trusted_at)
    digests = set(summary["final_digests"].values()) | set(json.loads((joiner_out / "summary.json").read_text())["final_digests"].values())
    assert len(digests) == 1  # the joiner ends with the swarm's exact state
    assert summary["banned"] == []
    assert marked_processes(marker, prefix=True) == []
