"""Every run kind's launcher ends its workers when it is killed: `phalanx launch` of a data-parallel, a
pipeline and an Aspis preset, each killed with SIGKILL once its workers and their hivemind children run.
Nothing marked with the run's marker (workers, watchdogs, DHT children, p2pd) may be left.

Where a netns test bed can be built (root, `ip netns`: on CI), the pipeline launch runs with `--netns`: each
worker and its hivemind children must run in the worker's own namespace and listen on its address, and the
namespaces must go with the killed launcher."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phalanx.runs.netns import delete_namespaces, namespaces, unavailable_reason
from phalanx.runs.processes import MARKER_ENV, kill_marked, marked_processes

pytestmark = pytest.mark.hivemind

KINDS = {
    "data-parallel": ["digits-dp", "--peers", "2"],
    "pipeline": ["chars-gpt-pipeline", "--peers", "4"],
    "aspis": ["aspis-digits", "--peers", "4", "--set", "aspis.q=1", "--set", "attack.orchestration=none"],
}
SETTLE = 15.0  # seconds the workers' trees may take to go away
NETNS = unavailable_reason() is None
if NETNS:
    KINDS["pipeline"] += ["--netns", "1:rate=100mbit"]


def test_killing_the_launcher_ends_every_worker_process(tmp_path):
    """The three launchers run at once (one start-up wait for all), then each is killed."""
    token = f"test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    launchers = {}
    bed = ""  # the prefix of the pipeline launch's namespaces, under --netns
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
        if NETNS:
            bed = _namespaced(f"{token}-pipeline", int(KINDS["pipeline"][2]))
        for launcher in launchers.values():
            launcher.kill()
            launcher.wait()
        deadline = time.monotonic() + SETTLE
        while (marked_processes(token, prefix=True) or bed and namespaces(bed)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {kind: marked_processes(f"{token}-{kind}", prefix=True) for kind in KINDS} == {kind: [] for kind in KINDS}
        assert not bed or namespaces(bed) == []  # the janitor deleted the killed launcher's namespaces
    finally:
        for launcher in launchers.values():
            launcher.kill()
        kill_marked(token, prefix=True)
        if bed:
            delete_namespaces(namespaces(bed))


def _namespaced(marker: str, workers: int) -> str:
    """Assert worker i's processes all run in namespace `<bed>-h<i>` and its p2pd listens on host i's address,
    and host 1's link is shaped; return the bed's prefix."""
    deadline = time.monotonic() + 120
    while not all(_p2pd(marked_processes(f"{marker}/{index}")) for index in range(workers)):
        assert time.monotonic() < deadline, "the pipeline workers' p2pd did not start"
        time.sleep(0.1)
    beds = set()
    for index in range(workers):
        pids = marked_processes(f"{marker}/{index}")
        spaces = {_read(lambda: os.readlink(f"/proc/{pid}/ns/net")) for pid in pids} - {None}
        named = [n for n in namespaces() if n.endswith(f"-h{index}")
                 and spaces == {_read(lambda: f"net:[{os.stat(f'/run/netns/{n}').st_ino}]")}]
        assert len(named) == 1, f"worker {index}'s processes are in namespaces {spaces}, none of them its own"
        beds.add(named[0].rsplit("-h", 1)[0])
        assert any(f"-hostAddrs=/ip4/10.77.0.{index + 1}/tcp/0".encode() in c for c in _p2pd(pids))
    assert len(beds) == 1
    bed = beds.pop()
    shaping = subprocess.run(["tc", "-n", f"{bed}-h1", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
    assert "tbf" in shaping.stdout and "rate 100Mbit" in shaping.stdout, shaping
    return bed


def _read(get):
    """`get()`, or None when what it reads is gone (a process that ended, another bed's namespace deleted)."""
    try:
        return get()
    except OSError:
        return None


def _p2pd(pids: list[int]) -> list[list[bytes]]:
    """The command lines of the p2pd daemons among `pids`."""
    lines = [_read(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")) or [b""] for pid in pids]
    return [line for line in lines if line[0].endswith(b"p2pd")]
