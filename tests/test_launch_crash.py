"""Four real worker processes over hivemind; one is killed with SIGKILL mid-run and restarted.

The run finishes, summary.json lists the killed worker under `crashed` with the
last step it recorded, the launcher exits 0 and names only that worker. The
killed worker, restarted at once with the same identity (`phalanx peer --index 3
--run-token ...`), catches up (downloads the agreed state, replays the agreed
updates), trains the rest of the run in the others' groups and ends with their
state digest. No process of the run (workers, DHT children, p2pd, watchdogs) is left.
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

pytestmark = pytest.mark.hivemind

STEPS = 300
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


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_worker_is_dropped_rejoins_and_nothing_is_left(tmp_path):
    token = f"test-{uuid.uuid4().hex}"
    out, rejoin_out = tmp_path / "run", tmp_path / "rejoin"
    env = {**os.environ, MARKER_ENV: token, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = ["digits-dp", "--peers", "4", "--steps", str(STEPS), "--set", "train.eval_every=100"]
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", *run, "--out", str(out), "--no-progress"]
    launcher = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    rejoined = None
    try:
        records = out / "peers" / "3.jsonl"
        deadline = time.monotonic() + 240
        while not (records.exists() and len(records.read_text().splitlines()) >= KILL_AFTER):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach the kill step"
            time.sleep(0.05)
        pid = _worker_pid(f"{token}/3")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        run_token = (out / "run_token").read_text().strip()
        first = (out / "peers" / "0.addr").read_text().split()[0]
        rejoin = [sys.executable, "-m", "phalanx.cli", "peer", *run, "--index", "3", "--run-token", run_token,
                  "--initial-peers", first, "--host", "/ip4/127.0.0.1/tcp/0", "--out", str(rejoin_out)]
        rejoined = subprocess.Popen(rejoin, env=env, stderr=subprocess.PIPE, text=True)
        _, stderr = launcher.communicate(timeout=400)
        _, rejoin_stderr = rejoined.communicate(timeout=60)
        assert launcher.returncode == 0, stderr
        assert rejoined.returncode == 0, rejoin_stderr
        summary = json.loads((out / "summary.json").read_text())
        victim = summary["peer_ids"][3]
        last = summary["crashed"][victim]
        assert list(summary["crashed"]) == [victim] and KILL_AFTER - 1 <= last < STEPS - 1
        assert "peer 3 was killed by SIGKILL" in stderr and "peer 0" not in stderr
        rows = _records(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert rows[-1]["peers"] == 3 and rows[-1]["group"] == 4, rejoin_stderr[-3000:]  # the restarted peer trains with them
        assert summary["final_accuracy"] > 0.8
        # The restarted process has the killed one's identity, trains a contiguous range up to the
        # last step, and ends with the state digest of the three that never stopped.
        tail = rejoin_stderr[-3000:]
        steps = [r["step"] for r in _records(rejoin_out / "peers" / "3.jsonl")]
        assert steps and steps == list(range(steps[0], STEPS)) and steps[0] > last, tail
        final = json.loads((rejoin_out / "summary.json").read_text())["final_digests"]
        assert list(final) == [victim], tail
        assert len(summary["final_digests"]) == 3 and set(summary["final_digests"].values()) == {final[victim]}, tail
        deadline = time.monotonic() + 10
        while marked_processes(token, prefix=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(token, prefix=True) == []
    finally:
        for proc in (launcher, rejoined):
            if proc is not None and proc.poll() is None:
                proc.kill()
        kill_marked(token, prefix=True)
