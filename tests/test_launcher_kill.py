"""Every run kind's launcher ends its workers when it is killed: `phalanx launch` of a data-parallel, a
pipeline and an Aspis preset, each killed with SIGKILL once its workers and their hivemind children run.
Nothing marked with the run's marker (workers, watchdogs, DHT children, p2pd) may be left."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phalanx.runs.processes import MARKER_ENV, kill_marked, marked_processes

pytestmark = pytest.mark.hivemind

KINDS = {
    "data-parallel": ["digits-dp", "--peers", "2"],
    "pipeline": ["chars-gpt-pipeline", "--peers", "4"],
    "aspis": ["aspis-digits", "--peers", "4", "--set", "aspis.q=1", "--set", "attack.orchestration=none"],
}
SETTLE = 15.0  # seconds the workers' trees may take to go away


def test_killing_the_launcher_ends_every_worker_process(tmp_path):
    """The three launchers run at once (one start-up wait for all), then each is killed."""
    token = f"test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    launchers = {}
    try:
        for kind, args in KINDS.items():
            cmd = [sys.executable, "-m", "phalanx.cli", "launch", *args, "--steps", "100000", "--out", str(tmp_path / kind),
                   "--no-progress"]
            launchers[kind] = subprocess.Popen(cmd, env={**env, MARKER_ENV: f"{token}-{kind}"}, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        for kind, launcher in launchers.items():
            # Each worker is up with its watchdog and its hivemind children (DHT child, p2pd): >= 3 processes
            # carry its own marker (the launcher starts all workers at once; all but the first wait for its address).
            workers = [f"{token}-{kind}/{index}" for index in range(int(KINDS[kind][2]))]
            while min(len(marked_processes(marker)) for marker in workers) < 3:
                assert launcher.poll() is None, launcher.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"the {kind} workers did not come up"
                time.sleep(0.1)
        for launcher in launchers.values():
            launcher.kill()
            launcher.wait()
        deadline = time.monotonic() + SETTLE
        while (left := marked_processes(token, prefix=True)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {kind: marked_processes(f"{token}-{kind}", prefix=True) for kind in KINDS} == {kind: [] for kind in KINDS}
    finally:
        for launcher in launchers.values():
            launcher.kill()
        kill_marked(token, prefix=True)
