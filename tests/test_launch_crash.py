"""Four real worker processes over hivemind; one is killed with SIGKILL mid-run.

The run finishes, summary.json lists the killed worker under `crashed` with the
last step it recorded, the launcher exits 0 and names only that worker, and no
process of the run (workers, DHT children, p2pd, watchdogs) is left.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phalanx.experiments.processes import MARKER_ENV, kill_marked, marked_processes
from phalanx.experiments.swarm import peer_identity

pytestmark = pytest.mark.hivemind

STEPS = 60
KILL_AFTER = 15


def _worker_pid(marker: str) -> int | None:
    """The worker process itself: the marked process whose command line is the worker module."""
    for pid in marked_processes(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"phalanx.experiments.launch" in cmdline and b"--die-with-parent" in cmdline:
            return pid
    return None


def test_killed_worker_is_dropped_and_nothing_is_left(tmp_path):
    token = f"test-{uuid.uuid4().hex}"
    out = tmp_path / "run"
    env = {**os.environ, MARKER_ENV: token, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", "digits-dp", "--peers", "4", "--steps", str(STEPS),
           "--out", str(out), "--no-progress", "--set", "train.eval_every=20"]
    launcher = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        records = out / "peers" / "3.jsonl"
        deadline = time.monotonic() + 240
        while not (records.exists() and len(records.read_text().splitlines()) >= KILL_AFTER):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach the kill step"
            time.sleep(0.1)
        pid = _worker_pid(f"{token}/3")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=400)
        assert launcher.returncode == 0, stderr
        summary = json.loads((out / "summary.json").read_text())
        victim = peer_identity(0, 3).peer_id
        last = summary["crashed"][victim]
        assert list(summary["crashed"]) == [victim] and KILL_AFTER - 1 <= last < STEPS - 1
        assert "peer 3 was killed by SIGKILL" in stderr and "peer 0" not in stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert rows[-1]["peers"] == 3 and summary["final_accuracy"] > 0.8
        deadline = time.monotonic() + 10
        while marked_processes(token, prefix=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(token, prefix=True) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_marked(token, prefix=True)
