"""Process hygiene for real runs: every process a run starts ends with it.

A hivemind peer is three processes: the worker (Python), its DHT child (a
fork of the worker, a `multiprocessing` daemon) and the DHT child's `p2pd`
(the Go libp2p daemon, started with `asyncio.create_subprocess_exec`). When
the worker is killed with SIGKILL nothing in hivemind stops the other two:
the DHT child holds both ends of its command pipe, so it never sees EOF, and
p2pd only stops when told to. Four mechanisms close that gap:

* a **marker**: the worker puts `PHALANX_PROCESS_MARKER=<marker>` in its
  environment before hivemind starts anything, so every descendant inherits it
  and can be found in `/proc/<pid>/environ` (and only the processes of this
  run: other runs on the machine carry other markers);
* a **watchdog** process per worker that notices the worker's death (it is
  re-parented) and SIGKILLs every process carrying the worker's marker; it
  also watches the launcher, and when the launcher dies it stops the worker
  (SIGTERM, then SIGKILL after a grace period, in case the worker's own
  handler cannot run);
* a **parent-death signal** (`prctl(PR_SET_PDEATHSIG)`): the DHT child, forked
  from the worker, gets SIGKILL when the worker dies; a worker started by the
  launcher gets SIGTERM (a clean stop) when the launcher dies;
* the launcher starts each worker in its own **process group** and sweeps the
  group and the marker after the worker exits, however it exited.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid

MARKER_ENV = "PHALANX_PROCESS_MARKER"
PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.2  # seconds between the watchdog's looks at its parent
STOP_GRACE = 10.0  # seconds a worker has to stop after SIGTERM before it is killed

_fork_hook_installed = False


def new_marker() -> str:
    """A marker no other run uses."""
    return uuid.uuid4().hex


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def marked_processes(marker: str, *, prefix: bool = False) -> list[int]:
    """Pids of live processes whose environment carries `marker` (or a marker starting with it)."""
    wanted = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or another user's process
            continue
        if state == "Z":
            continue
        if any(v == wanted or (prefix and v.startswith(wanted)) for v in variables):
            found.append(int(entry))
    return sorted(found)


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of process group `pgid`. A zombie is not one: it has exited, and where
    PID 1 does not reap (a container's init) it stays in the group until its parent waits for it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return sorted(found)


def kill_marked(marker: str, sig: int = signal.SIGKILL, *, prefix: bool = False) -> list[int]:
    """Send `sig` to every process carrying `marker` except this one; return their pids."""
    me = os.getpid()
    pids = [p for p in marked_processes(marker, prefix=prefix) if p != me]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to process group `pgid` if anything is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def guard_worker(marker: str, *, die_with_parent: bool) -> subprocess.Popen:
    """Make sure nothing this worker starts outlives it; call before starting hivemind.

    Sets the marker in the environment, gives forked children (the DHT child)
    a SIGKILL parent-death signal, optionally asks for SIGTERM when our own
    parent (the launcher) dies, and starts the watchdog. Returns the watchdog.
    """
    global _fork_hook_installed
    os.environ[MARKER_ENV] = marker
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=lambda: set_parent_death_signal(signal.SIGKILL))
        _fork_hook_installed = True
    watch_args = ["--watch", str(os.getpid()), "--marker", marker]
    if die_with_parent:
        parent = os.getppid()
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
        watch_args += ["--launcher", str(parent), "--launcher-start", str(start_time(parent))]
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.runs.processes", *watch_args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None if it is gone or a zombie: with the pid, its identity."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def watch(parent: int, marker: str, launcher: int | None = None, launcher_start: int | None = None) -> None:
    """The watchdog's loop: when `parent` (the worker) is gone, SIGKILL everything that carries `marker`.

    With `launcher`, also when the launcher dies: the worker gets SIGTERM (as its parent-death
    signal also says) and `STOP_GRACE` seconds to stop; a worker whose signal handler cannot run
    (stuck in native code) is killed with everything it started.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the worker; we clean up after it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent:
        if launcher is not None and start_time(launcher) != launcher_start:
            _stop(parent)
            break
        time.sleep(WATCH_INTERVAL)
    # Twice: a process forked while the first sweep ran is caught by the second.
    for _ in range(2):
        kill_marked(marker)
        time.sleep(WATCH_INTERVAL)


def _stop(worker: int) -> None:
    """SIGTERM `worker` and wait up to STOP_GRACE seconds for it to exit (we are its child: it is gone once we are re-parented)."""
    try:
        os.kill(worker, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE
    while os.getppid() == worker and time.monotonic() < deadline:
        time.sleep(WATCH_INTERVAL)


def _main() -> None:
    parser = argparse.ArgumentParser(description="phalanx watchdog: ends a worker's processes when it dies")
    parser.add_argument("--watch", type=int, required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--launcher", type=int)
    parser.add_argument("--launcher-start", type=int)
    args = parser.parse_args()
    watch(args.watch, args.marker, args.launcher, args.launcher_start)


if __name__ == "__main__":
    _main()
