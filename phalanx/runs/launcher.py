"""One process launcher for every run kind: workers that end with their run.

`launch` (data-parallel), the pipeline launcher and the Aspis launcher start
their workers through `ProcessLauncher`, so each worker gets the same
discipline (see `processes.py` for the mechanisms):

* its own process group and its own marker (`<run marker>/<name>`), which
  its DHT child and p2pd inherit;
* `--die-with-parent`: the worker arms a parent-death signal and starts a
  watchdog (`guard_worker`), so killing the launcher, even with SIGKILL, ends it;
* a sweep of its group and marker once it exits, however it exited;
* on the launcher's side, SIGTERM becomes a clean stop (`stop_on_sigterm`);
* with `netns` (`launch --netns`), its own network namespace of a test bed
  (`netns.Testbed`) that the first start builds and `stop` tears down: a
  worker runs on the host of its name and listens on that host's address
  (`--host`). The bed's hosts go in first-start order; a worker started again
  keeps its host; a new one, a joiner, takes the host of a worker that has
  exited and been swept, else a host added to the bed (see `host`);
* a name may be started again once its process has exited or been killed
  (churn brings a worker back under its identity): the new process starts
  only when the old one, its group and everything carrying its marker are
  gone; its stderr file is appended to, and the old process stays listed
  (`processes`) and is waited for at `stop` like the others.

All workers start at once: the first one writes its address file once it
listens, the others (`--initial-peers-file`) import, load and then wait for
that file (`first_address`), so a launch pays one worker start-up, not two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from ..core.errors import LocalError
from ..transport.base import Transport
from .netns import NetnsConfig, Testbed
from .processes import MARKER_ENV, STOP_GRACE, group_members, kill_group, kill_marked, marked_processes

GONE_TIMEOUT = 10.0  # seconds to wait for killed process groups to be reaped
REAP_GRACE = 2.0  # seconds more for their zombies to be reaped by init (where it reaps)

BARRIER_TIMEOUT = 120.0  # seconds a launch's workers wait for each other at a barrier
BARRIER_STEP = 1 << 40  # the broadcast slot of barriers: beyond any training step, so never pruned


class NotGone(LocalError):
    """A worker cannot start again under its name: its old processes did not go within GONE_TIMEOUT of the sweep."""


class ProcessLauncher:
    """A run's worker processes, by name: each in its own process group, with its own marker."""

    def __init__(self, base: Sequence[str], marker: str, err_dir: Path | None = None, netns: NetnsConfig | None = None) -> None:
        self.base = list(base)  # the worker's command line, before its own arguments
        self.token = marker
        self.err_dir = err_dir  # with it, each worker's stderr goes to `err_dir/<name>.err` (quoted on failure)
        self.netns = netns
        self.bed: Testbed | None = None
        self.hosts: dict[Hashable, int] = {}  # worker -> its host in the test bed (the last one it had)
        self.holders: dict[int, Hashable] = {}  # host -> the worker on it (now, or last)
        self.free: list[int] = []  # hosts whose worker has exited and been swept: a new worker may take one
        self.procs: dict[Hashable, subprocess.Popen] = {}  # name -> its process (the last one started)
        self.earlier: list[subprocess.Popen] = []  # processes a later start under the same name replaced (dead)
        self.failed: dict[Hashable, int] = {}  # name -> exit status, for workers that ended by themselves
        self.stopped: set[Hashable] = set()  # workers the launcher killed on purpose
        self.stopping = False

    def command(self, name: Hashable, args: Sequence[str]) -> list[str]:
        """The full command line of worker `name`: inside its host's namespace when there is a test bed."""
        cmd = [*self.base, *args, "--die-with-parent"]
        if self.bed is None:
            return cmd
        host = self.host(name)
        return [*self.bed.exec_prefix(host), *cmd, "--host", self.bed.listen_maddr(host)]

    def host(self, name: Hashable) -> int:
        """Worker `name`'s host: the one it had, unless another worker has taken it since; else the next of the
        bed's own hosts; once those are all given, the lowest host of a worker that has exited (swept first),
        else one the bed adds. Reusing hosts keeps a long churn run within the bed's 250 hosts."""
        own = self.hosts.get(name)
        if own is not None and self.holders[own] == name:
            if own in self.free:
                self.free.remove(own)
            return own
        if len(self.holders) >= self.netns.hosts:
            self._sweep_exited()
        if self.free and len(self.holders) >= self.netns.hosts:
            host = min(self.free)
            self.free.remove(host)
        else:
            host = len(self.holders)
            if host >= self.bed.hosts:
                self.bed.add_host()
        self.hosts[name] = host
        self.holders[host] = name
        return host

    def _sweep_exited(self) -> None:
        """Sweep every worker that holds a host and has exited by itself (a joiner that gave up): frees its host."""
        for name, host in list(self.hosts.items()):
            proc = self.procs.get(name)
            if self.holders[host] == name and host not in self.free and proc is not None and proc.poll() is not None:
                self.sweep(name)

    def start(self, name: Hashable, *args: str) -> subprocess.Popen:
        if self.netns is not None and self.bed is None:
            self.bed = Testbed(self.netns)
            self.bed.up()
        if name in self.procs:
            self._retire(name)
        self.stopped.discard(name)
        env = {**os.environ, MARKER_ENV: self.marker(name)}
        cmd = self.command(name, args)
        if self.err_dir is None:
            self.procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True)
        else:
            with open(self.err_dir / f"{name}.err", "ab") as err:  # a worker started again appends
                self.procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=err)
        return self.procs[name]

    def _retire(self, name: Hashable) -> None:
        """Before `name` is started again: its process must have ended (LocalError if it runs), and nothing of
        it may be left (its group, its marker: the new process carries the same marker); NotGone if something
        lives on past GONE_TIMEOUT after the sweep (the name is not started; the caller may go on without it)."""
        old = self.procs[name]
        if old.poll() is None:
            raise LocalError(f"worker {name} still runs: kill it (or let it exit) before starting it again")
        self.sweep(name)
        deadline = time.monotonic() + GONE_TIMEOUT
        while _group_alive(old.pid) or marked_processes(self.marker(name)):
            if time.monotonic() > deadline:
                left = sorted(set(group_members(old.pid) + marked_processes(self.marker(name))))
                raise NotGone(f"worker {name}'s processes did not go within {GONE_TIMEOUT:.0f} s of its kill "
                              f"(still alive: {', '.join(map(str, left))})")
            time.sleep(0.05)
        self.earlier.append(old)

    def processes(self) -> list[subprocess.Popen]:
        """Every process started, those replaced by a later start under their name included."""
        return [*self.earlier, *self.procs.values()]

    def address(self, name: Hashable, address_file: Path, timeout: float, who: str) -> list[str]:
        """The multiaddrs worker `name` writes to `address_file` once it listens; LocalError if it exits or times out."""
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while not address_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LocalError(f"{who} did not start (exit code {proc.poll()}){self.tail(name)}")
            time.sleep(0.1)
        return address_file.read_text().split()

    def marker(self, name: Hashable) -> str:
        return f"{self.token}/{name}"

    def running(self) -> list[Hashable]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def reap(self) -> list[Hashable]:
        """Note workers that ended by themselves; sweep what each one left. Returns newly failed names."""
        new = []
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None or name in self.failed or name in self.stopped or self.stopping:
                continue
            self.sweep(name)
            if code != 0:
                self.failed[name] = code
                new.append(name)
        return new

    def kill(self, name: Hashable) -> None:
        """SIGKILL worker `name` on purpose (it is not listed as failed) and sweep what it leaves."""
        self.stopped.add(name)
        self.procs[name].kill()
        self.procs[name].wait()
        self.sweep(name)

    def sweep(self, name: Hashable) -> None:
        """Kill what worker `name` (which has exited, or is killed with its group here) left; its host is free."""
        kill_group(self.procs[name].pid)
        kill_marked(self.marker(name))
        host = self.hosts.get(name)
        if host is not None and self.holders[host] == name and host not in self.free:
            self.free.append(host)

    def wait(self, names: Sequence[Hashable], timeout: float) -> None:
        """Give the workers `names` up to `timeout` seconds in all to exit by themselves."""
        deadline = time.monotonic() + timeout
        for name in names:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Ask workers that still run to stop, kill those that do not, sweep every group and marker, wait them gone;
        then tear the test bed down, even when a second SIGTERM (a KeyboardInterrupt) cuts the rest short."""
        self.stopping = True
        try:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + STOP_GRACE
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for name in self.procs:
                self.sweep(name)
            kill_marked(f"{self.token}/", prefix=True)  # anything a worker started that left its group
            self._wait_gone()
        finally:
            if self.bed is not None:
                self.bed.down()  # kills whatever still runs in the namespaces too

    def netns_record(self) -> dict:
        """For summary.json under --netns: per worker (by name) its host, the host's address and the shaping
        its link got (a host a joiner took over from a worker that left appears under both names)."""
        if self.bed is None:
            return {}
        return {"netns": {str(name): {"host": host, "address": self.bed.address(host), "link": self.bed.applied[host]}
                          for name, host in self.hosts.items()}}

    def _wait_gone(self) -> None:
        """Until the swept groups are reaped (a dead worker's watchdog is reaped by init a moment after its kill):
        no live member within GONE_TIMEOUT, then no member at all within REAP_GRACE (a zombie where PID 1 reaps
        goes a moment later; where it does not reap, the zombie stays and counts as gone)."""
        deadline = time.monotonic() + GONE_TIMEOUT
        for proc in self.processes():
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        deadline = time.monotonic() + REAP_GRACE
        for proc in self.processes():
            while _group_exists(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def tail(self, name: Hashable, lines: int = 40) -> str:
        """The last lines worker `name` wrote to its stderr file, to quote in an error."""
        path = self.err_dir / f"{name}.err" if self.err_dir is not None else None
        text = path.read_text(errors="replace").strip() if path is not None and path.exists() else ""
        if not text:
            return " (no output)" if path is not None else "; see its output above"
        return f" ({path}), its last lines:\n" + "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    """Whether a live process is left in process group `pgid` (a zombie has exited: not one)."""
    return bool(group_members(pgid))


def _group_exists(pgid: int) -> bool:
    """Whether anything is left in process group `pgid`, zombies included."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def barrier(transport: Transport, name: str, peers: list[str]) -> None:
    """Wait until every peer of a launch has announced `name` (or the timeout passes): workers of every kind
    start training together.

    An announcement that did not arrive is fetched from its sender and from
    other peers after a quarter of the timeout: a peer that passed the barrier
    alone would train a whole timeout ahead of the rest, and never meet them.
    The slot's step is beyond any training step, so pruning old broadcasts never
    drops the announcement of a peer that left early (a banned peer stops at once).
    """
    await transport.broadcast(f"barrier.{name}", BARRIER_STEP, b"")
    await transport.collect_broadcasts(f"barrier.{name}", BARRIER_STEP, peers, BARRIER_TIMEOUT)


def worker_parser(description: str, first: str = "the first worker") -> argparse.ArgumentParser:
    """The command line every kind's worker process takes from `ProcessLauncher` (a kind adds its own options)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--address-file")
    parser.add_argument("--host", default="/ip4/127.0.0.1/tcp/0", help="multiaddr to listen on")
    parser.add_argument("--initial-peers-file", help=f"wait for {first} to write its address here, then join it")
    parser.add_argument("--die-with-parent", action="store_true", help="stop (SIGTERM) when the launcher dies")
    return parser


async def first_address(address_file: Path, timeout: float) -> list[str]:
    """Worker side of the parallel start: the first worker's multiaddrs, once it has written `address_file`."""
    deadline = time.monotonic() + timeout
    while not address_file.exists():
        if time.monotonic() > deadline:
            raise LocalError(f"the first peer wrote no address to {address_file} within {timeout:.0f} s")
        await asyncio.sleep(0.1)
    return address_file.read_text().split()


def exit_done() -> NoReturn:
    """End a worker whose work is done (records closed, transport stopped) with status 0, now.

    Skips the interpreter's final garbage collection: with torch and hivemind loaded it took 5-25 s
    after the last step (measured in session 16), and every launch waited for it. The watchdog sweeps
    whatever the worker leaves, as after any exit.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_text(code: int) -> str:
    """How a worker ended, in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _raise_on_sigterm(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the launcher runs, SIGTERM stops it like Ctrl-C: its `finally` blocks end the workers."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
