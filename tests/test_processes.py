"""No process outlives its run: a worker's tree (forked DHT child, its p2pd-like child, the watchdog) ends
when the worker is killed with SIGKILL, stopped with SIGTERM or SIGINT, or when its launcher is killed."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phalanx.runs.processes import (
    MARKER_ENV,
    kill_marked,
    marked_processes,
    set_parent_death_signal,
)

WORKER = Path(__file__).resolve().parent / "process_tree_worker.py"
SETTLE = 10.0  # seconds the tree may take to go away


def _start(tmp_path: Path, *flags: str) -> tuple[str, subprocess.Popen]:
    marker = f"test-{uuid.uuid4().hex}"
    ready = tmp_path / "ready"
    env = {**os.environ, MARKER_ENV: marker}
    # SIGINT at its default, as for a worker in a terminal's foreground: a test run started in the background
    # (`cmd &` in a script) ignores SIGINT, and its children would inherit that
    proc = subprocess.Popen([sys.executable, str(WORKER), marker, str(ready), *flags], env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, f"the worker exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "the process tree did not come up"
        time.sleep(0.05)
    return marker, proc


def _gone(marker: str) -> list[int]:
    deadline = time.monotonic() + SETTLE
    while (left := marked_processes(marker, prefix=True)) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_marked(marker, prefix=True)  # leave nothing behind even when the test fails
    return left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_worker_tree_ends_with_the_worker(tmp_path, sig):
    marker, proc = _start(tmp_path)
    # worker, DHT-like child, its grandchild and the watchdog all carry the marker
    assert len(marked_processes(marker, prefix=True)) == 4
    proc.send_signal(sig)
    proc.wait(timeout=SETTLE)
    assert _gone(marker) == []


def test_worker_tree_ends_when_the_launcher_is_killed(tmp_path):
    marker, launcher = _start(tmp_path, "--spawn-worker")
    assert len(marked_processes(marker, prefix=True)) == 5
    launcher.kill()
    launcher.wait()
    assert _gone(marker) == []


def test_parent_death_signal_is_armed():
    assert set_parent_death_signal(0) is sys.platform.startswith("linux")
