"""Admission over hivemind: `phalanx peer` joins a running BTARD `launch`, is untrusted, then trusted."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from phalanx.runs.config import override
from phalanx.runs.dp.launch import launch
from phalanx.runs.presets import get_preset
from phalanx.runs.processes import MARKER_ENV, marked_processes

pytestmark = pytest.mark.hivemind

# Generous timeouts: on a loaded machine a descheduled process must not be taken for a silent one.
# 200 steps: with background verification an idle machine trains ~5 steps/s, and the joiner (a fresh
# process that imports torch, then catches up) must enter well before the end.
STEPS = 200
SETS = ["seed=11", "byzantine.count=0", "btard.admission_after=2", f"train.eval_every={STEPS}", "btard.timeout=20", "allreduce.timeout=20"]


def test_peer_joining_a_running_launch_is_trusted_after_t_approvals(tmp_path):
    config = override(get_preset("btard-digits"), ["peers=4", f"steps={STEPS}", *SETS])
    swarm, joiner_out = tmp_path / "swarm", tmp_path / "joiner"
    marker = f"admission-test-{os.getpid()}"
    env = {**os.environ, MARKER_ENV: marker}
    joined: dict = {}

    def join() -> None:
        """Once the launched swarm trains, run `phalanx peer` against it (launch needs the main thread)."""
        deadline = time.monotonic() + 120
        first = swarm / "peers" / "0.jsonl"
        while not (first.exists() and len(first.read_text().splitlines()) >= 1):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        addrs = (swarm / "peers" / "0.addr").read_text().split()
        token = (swarm / "run_token").read_text().strip()  # each launch has its own DHT namespace
        cmd = [sys.executable, "-m", "phalanx.cli", "peer", "btard-digits", "--peers", "4", "--steps", str(STEPS)]
        cmd += [x for s in SETS for x in ("--set", s)] + ["--host", "/ip4/127.0.0.1/tcp/0", "--out", str(joiner_out), "--run-token", token, "--initial-peers", *addrs]
        joined["proc"] = proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        joined["stderr"] = proc.communicate(timeout=180)[1]

    thread = threading.Thread(target=join)
    thread.start()
    try:
        summary = launch(config, swarm, progress=False)
        thread.join(timeout=200)
    finally:
        if "proc" in joined and joined["proc"].poll() is None:  # interrupted or stuck: end the joiner too
            joined["proc"].terminate()
            joined["proc"].wait(timeout=30)
    assert "proc" in joined and joined["proc"].returncode == 0, joined.get("stderr", "")[-2000:]
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
    deadline = time.monotonic() + 30  # the joiner's watchdog and daemon end just after it
    while marked_processes(marker, prefix=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked_processes(marker, prefix=True) == []
