"""Multi-host test bed: one network namespace per peer, joined by a bridge, with shaped links.

Topology (the root namespace is left untouched):

* a hub namespace ``<prefix>-hub`` holds a bridge ``br0``;
* host i lives in namespace ``<prefix>-h<i>``; its interface ``eth0`` has
  address ``<subnet>.<i+1>/24`` and is one end of a veth pair whose other end,
  ``v<i>``, sits in the hub, enslaved to the bridge;
* a running bed takes further (unshaped) hosts, up to 250 in all (`add_host`):
  a launch's joiners get theirs as they start (or the host of a worker that
  has exited: see `launcher.ProcessLauncher.host`).

Traffic between hosts crosses the hub and nowhere else: no namespace has a
route out, and the root namespace has no route in (a peer outside the bed
cannot reach one inside it). A link's shape applies to both directions: to ``eth0``'s egress
(host to hub) and to ``v<i>``'s egress (hub to host). Delay, jitter and loss
need ``sch_netem``; rate uses netem's own rate when netem shapes that link,
otherwise ``tbf`` (or ``htb``). Which qdiscs the kernel has is probed on the
first link, and every link's line says what was applied and what was not.

Teardown (`Testbed.down`, also on an exception, Ctrl-C or SIGTERM through the
caller's ``with``) kills every process left in the namespaces named with the
bed's prefix and deletes them, which deletes the veths and the bridge. A janitor process deletes them
too when the process that built the bed dies without tearing it down (SIGKILL).

    python -m phalanx.runs.netns --probe          # what shaping this kernel supports
    python -m phalanx.runs.netns --cleanup PREFIX # delete leftover namespaces named PREFIX*
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..core.errors import ConfigError, LocalError
from .processes import MARKER_ENV

PREFIX = "phx-"  # every namespace a test bed creates starts with this
HUB_DEVICE = "br0"
HOST_DEVICE = "eth0"
TBF_LATENCY_MS = 100  # how long a packet may wait in tbf's queue before it is dropped
JANITOR_INTERVAL = 0.2  # seconds between the janitor's looks at its parent
EXAMPLE_SPEC = "1:rate=10mbit;2:delay=40ms,jitter=10ms;3:loss=1%"
CLONE_NEWNET = 0x40000000
MAX_HOSTS = 250  # host i has address <subnet>.<i+1>


@dataclass(frozen=True)
class LinkShape:
    """How one host's link to the hub is shaped, per direction: rate (Mbit/s), delay and jitter (ms), loss (%)."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not 0 < self.rate_mbit <= 100_000:
            raise ConfigError(f"link rate must be in (0, 100000] mbit, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000 or not 0 <= self.jitter_ms <= self.delay_ms:
            raise ConfigError(
                f"link delay must be in [0, 10000] ms and jitter in [0, delay], got {self.delay_ms}/{self.jitter_ms}"
            )
        if not 0 <= self.loss_pct < 100:
            raise ConfigError(f"link loss must be in [0, 100) %, got {self.loss_pct}")

    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0

    def describe(self) -> str:
        parts = []
        if self.rate_mbit is not None:
            parts.append(f"rate {self.rate_mbit:g}mbit")
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g}ms" + (f" jitter {self.jitter_ms:g}ms" if self.jitter_ms else ""))
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:g}%")
        return ", ".join(parts) or "unshaped"


@dataclass(frozen=True)
class NetnsConfig:
    """A test bed: `hosts` namespaces on subnet `<subnet>.0/24`; `shapes` maps a host index to its link's shape."""

    hosts: int
    shapes: tuple[tuple[int, LinkShape], ...] = ()
    subnet: str = "10.77.0"

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ConfigError(f"a netns test bed has 1 to {MAX_HOSTS} hosts, got {self.hosts}")
        indices = [i for i, _ in self.shapes]
        if len(set(indices)) != len(indices) or not all(0 <= i < self.hosts for i in indices):
            raise ConfigError(f"--netns names hosts {indices}; each at most once and in [0, {self.hosts})")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", self.subnet):
            raise ConfigError(f"subnet must be the first three octets of an IPv4 /24, e.g. 10.77.0, got {self.subnet!r}")

    def shape(self, host: int) -> LinkShape:
        return dict(self.shapes).get(host, LinkShape())


def parse_spec(spec: str, hosts: int) -> NetnsConfig:
    """`--netns` text, e.g. "1:rate=10mbit;2:delay=40ms,jitter=10ms;3:loss=1%" ("" for unshaped links)."""
    shapes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        index, sep, options = part.partition(":")
        if not sep or not index.strip().isdigit():
            raise ConfigError(f"--netns part {part!r} must read HOST:key=value,... e.g. {EXAMPLE_SPEC!r}")
        values: dict[str, float] = {}
        for option in filter(None, (o.strip() for o in options.split(","))):
            key, sep, value = option.partition("=")
            if not sep or key not in _UNITS:
                raise ConfigError(f"--netns option {option!r}: use rate=10mbit, delay=40ms, jitter=10ms or loss=1%")
            values[key] = _quantity(key, value.strip())
        rate = values.pop("rate", None)
        shape = LinkShape(rate, values.get("delay", 0.0), values.get("jitter", 0.0), values.get("loss", 0.0))
        shapes.append((int(index), shape))
    return NetnsConfig(hosts, tuple(shapes))


_UNITS = {
    "rate": {"gbit": 1000.0, "mbit": 1.0, "kbit": 0.001, "": 1.0},
    "delay": {"ms": 1.0, "s": 1000.0, "": 1.0},
    "jitter": {"ms": 1.0, "s": 1000.0, "": 1.0},
    "loss": {"%": 1.0, "": 1.0},
}


def _quantity(key: str, text: str) -> float:
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z%]*)", text.lower())
    if not match or match.group(2) not in _UNITS[key]:
        units = sorted(u for u in _UNITS[key] if u)
        raise ConfigError(f"--netns {key}={text!r}: expected a number with one of the units {units}")
    return float(match.group(1)) * _UNITS[key][match.group(2)]


def uses_tap_link(shape: LinkShape, qdiscs: set[str]) -> bool:
    """Whether this link's delay and loss come from a user-space TAP link (`tap_link`): no netem, but TAP devices."""
    return shape.needs_netem() and "netem" not in qdiscs and "tap" in qdiscs


def plan_link(shape: LinkShape, device: str, qdiscs: set[str]) -> tuple[list[list[str]], str]:
    """`tc` commands that shape `device`'s egress as `shape` with what the kernel has; and what is applied.

    `qdiscs` names what works here: netem, tbf, htb, and "tap" when TAP devices
    can stand in for netem's delay and loss (see `tap_link`).
    """
    base = ["tc", "qdisc", "add", "dev", device, "root"]
    rate = None if shape.rate_mbit is None else f"{shape.rate_mbit * 1000:g}kbit"
    if shape.needs_netem() and "netem" in qdiscs:
        netem = [*base, "netem", "limit", "10000"]
        if shape.delay_ms:
            netem += ["delay", f"{shape.delay_ms:g}ms"] + ([f"{shape.jitter_ms:g}ms"] if shape.jitter_ms else [])
        if shape.loss_pct:
            netem += ["loss", f"{shape.loss_pct:g}%"]
        if rate:
            netem += ["rate", rate]
        return [netem], f"{shape.describe()} (netem, each direction)"
    lost = ""
    if shape.needs_netem():
        dropped = LinkShape(delay_ms=shape.delay_ms, jitter_ms=shape.jitter_ms, loss_pct=shape.loss_pct).describe()
        if uses_tap_link(shape, qdiscs):
            lost = f"{dropped} (user-space tap link, each direction; this kernel has no sch_netem)"
        else:
            lost = f"{dropped} NOT applied (this kernel has no sch_netem)"
    if rate is None:
        return [], lost or "unshaped"
    if "tbf" in qdiscs:
        burst = max(16 * 1024, int(shape.rate_mbit * 1e6 / 8 / 250))  # at least one timer tick's worth at HZ=250
        commands = [[*base, "tbf", "rate", rate, "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]]
        applied = f"rate {shape.rate_mbit:g}mbit (tbf, each direction)"
    elif "htb" in qdiscs:
        commands = [
            [*base, "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", rate],
        ]
        applied = f"rate {shape.rate_mbit:g}mbit (htb, each direction)"
    else:
        missing = f"rate {shape.rate_mbit:g}mbit NOT applied (this kernel has neither tbf nor htb)"
        return [], missing + (f"; {lost}" if lost else "")
    return commands, applied + (f"; {lost}" if lost else "")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LocalError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _in(namespace: str, command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return _ip("netns", "exec", namespace, *command, check=check)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces that start with `prefix`."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def unavailable_reason() -> str | None:
    """Why a test bed cannot be built here (None when it can): platform, tools, privileges."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    name = f"{PREFIX}probe-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` is not permitted here: {done.stderr.strip()}"
    try:
        made = _ip("-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if made.returncode != 0:
            return f"veth pairs cannot be created here: {made.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Run the block with the calling thread in `namespace`.

    Sockets created and processes forked in the block belong to that
    namespace and stay there afterwards (a hivemind DHT child and its p2pd
    started here listen inside it). Only this thread moves.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{namespace}") as target:
        if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            raise LocalError(f"cannot enter network namespace {namespace}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


def delete_namespaces(names: list[str]) -> None:
    """Kill every process inside each namespace, then delete it (its veths and bridge go with it)."""
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Testbed:
    """The namespaces, veths, bridge and shaping of one `NetnsConfig`; use as a context manager.

    `log` receives one line per link saying what shaping was applied.
    """

    def __init__(self, config: NetnsConfig, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.prefix = f"{PREFIX}{uuid.uuid4().hex[:8]}"
        self.hub = f"{self.prefix}-hub"
        self.log = log or (lambda line: print(f"phalanx: netns: {line}", file=sys.stderr))
        self.qdiscs: set[str] = set()
        self.hosts = 0  # hosts built so far: the config's, then those `add_host` adds
        self.started = False  # whether `up` got past its checks (before that there is nothing to tear down)
        self.applied: dict[int, str] = {}
        self._janitor: subprocess.Popen | None = None
        self._links: list[subprocess.Popen] = []  # user-space tap links (tap_link processes)

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        return f"{self.config.subnet}.{host + 1}"

    def listen_maddr(self, host: int) -> str:
        """Where a hivemind peer on `host` listens (its own address, any port)."""
        return f"/ip4/{self.address(host)}/tcp/0"

    def exec_prefix(self, host: int) -> list[str]:
        """Prepend to a command to run it inside `host`'s namespace (`ip netns exec` keeps the pid)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> dict[int, str]:
        """Build the bed; return (and log) what shaping each host's link got. Tears down what it built on failure."""
        reason = unavailable_reason()
        if reason is not None:
            raise LocalError(f"cannot build the netns test bed: {reason}")
        self.started = True
        self._janitor = subprocess.Popen(
            [sys.executable, "-m", "phalanx.runs.netns", "--janitor", str(os.getpid()), "--cleanup", f"{self.prefix}-"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal must not stop it before it has cleaned up
            env={k: v for k, v in os.environ.items() if k != MARKER_ENV},  # a sweep of the run's processes spares it
        )
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", HUB_DEVICE, "type", "bridge")
            _ip("-n", self.hub, "link", "set", HUB_DEVICE, "up")
            self.qdiscs = probe_qdiscs(self.hub)
            for host in range(self.config.hosts):
                self._add_host(host)
            for host in range(self.config.hosts):
                self._shape(host)
        except BaseException:
            self.down()
            raise
        self.log(f"the hosts ({self.config.subnet}.0/24) reach only each other: a peer started outside the bed cannot"
                 f" reach them; start it inside one (`ip netns exec {self.namespace(0)} ...`)")
        return self.applied

    def add_host(self) -> int:
        """One more host on the running bed (unshaped: a spec names only the config's hosts); returns its index."""
        host = self.hosts
        if host >= MAX_HOSTS:
            raise LocalError(f"the netns test bed has room for {MAX_HOSTS} hosts (one /24), all taken")
        self._add_host(host)
        self._shape(host)
        return host

    def _add_host(self, host: int) -> None:
        ns, hub_end = self.namespace(host), f"v{host}"
        _ip("netns", "add", ns)
        self.hosts = host + 1
        shape = self.config.shape(host)
        if uses_tap_link(shape, self.qdiscs):
            self._start_tap_link(host, shape)
        else:
            _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", HOST_DEVICE, "netns", ns)
        _ip("-n", self.hub, "link", "set", hub_end, "master", HUB_DEVICE)
        _ip("-n", self.hub, "link", "set", hub_end, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", HOST_DEVICE)
        _ip("-n", ns, "link", "set", HOST_DEVICE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _start_tap_link(self, host: int, shape: LinkShape) -> None:
        command = [
            *[sys.executable, "-m", "phalanx.runs.tap_link", self.namespace(host), HOST_DEVICE, self.hub, f"v{host}"],
            *["--delay", str(shape.delay_ms), "--jitter", str(shape.jitter_ms), "--loss", str(shape.loss_pct)],
            *["--seed", str(host)],
        ]
        link = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        self._links.append(link)
        if link.stdout.readline().strip() != "ready":
            raise LocalError(f"the user-space link of host {host} did not start (exit code {link.wait()})")

    def _shape(self, host: int) -> None:
        """Shape `host`'s link; note and log what was applied."""
        shape = self.config.shape(host)
        description = "unshaped"
        for ns, device in ((self.namespace(host), HOST_DEVICE), (self.hub, f"v{host}")):
            commands, description = plan_link(shape, device, self.qdiscs)
            for command in commands:
                _in(ns, command)
        self.applied[host] = description
        self.log(f"host {host} ({self.namespace(host)}, {self.address(host)}): {description}")

    def down(self) -> None:
        """Kill what runs in the bed's namespaces and delete them; safe to call twice, and nothing to do (no `ip`
        run) for a bed that never started.

        Deletes every namespace named with the bed's prefix, as the janitor does, not only the hosts counted so
        far: one added by `ip netns add` just before a signal is gone too. The janitor stays until they are.
        """
        if not self.started:
            return
        for link in self._links:
            link.kill()
            link.wait()
        self._links = []
        delete_namespaces(namespaces(f"{self.prefix}-"))
        if self._janitor is not None:
            self._janitor.terminate()
            self._janitor.wait()
            self._janitor = None


def probe_qdiscs(namespace: str) -> set[str]:
    """Which of netem, tbf and htb the kernel accepts (tried on a veth pair made in `namespace` for it), plus
    "tap" where TAP devices can be made."""
    trials = {
        "netem": ["netem", "delay", "1ms"],
        "tbf": ["tbf", "rate", "1mbit", "burst", "16384", "latency", "50ms"],
        "htb": ["htb", "default", "1"],
    }
    device = "probe0"
    _in(namespace, ["ip", "link", "add", device, "type", "veth", "peer", "name", "probe1"])
    found = {"tap"} if os.access("/dev/net/tun", os.R_OK | os.W_OK) else set()
    for name, args in trials.items():
        if _in(namespace, ["tc", "qdisc", "add", "dev", device, "root", *args], check=False).returncode == 0:
            found.add(name)
            _in(namespace, ["tc", "qdisc", "del", "dev", device, "root"], check=False)
    _in(namespace, ["ip", "link", "del", device])
    return found


def _janitor(parent: int, prefix: str) -> None:
    """Wait until `parent` is gone (we are re-parented) or we are told to stop; then delete `prefix`* namespaces."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == parent and not stop:
        time.sleep(JANITOR_INTERVAL)
    if not stop:
        delete_namespaces(namespaces(prefix))


def _main() -> None:
    parser = argparse.ArgumentParser(description="phalanx's netns test bed: probe shaping, clean up leftovers")
    parser.add_argument("--probe", action="store_true", help="print which tc qdiscs this kernel supports")
    parser.add_argument("--cleanup", metavar="PREFIX", help=f"delete namespaces named PREFIX* (ours start {PREFIX!r})")
    parser.add_argument("--janitor", type=int, metavar="PID", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.janitor is not None:
        _janitor(args.janitor, args.cleanup)
    elif args.cleanup:
        if not args.cleanup.startswith(PREFIX):
            raise SystemExit(f"--cleanup deletes only namespaces phalanx made; the prefix must start with {PREFIX!r}")
        names = namespaces(args.cleanup)
        delete_namespaces(names)
        print(f"deleted {len(names)} namespaces: {' '.join(names)}")
    elif args.probe:
        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"no test bed here: {reason}")
        with Testbed(NetnsConfig(1), log=lambda line: None) as bed:
            print(f"qdiscs: {', '.join(sorted(bed.qdiscs)) or 'none'} (of netem, tbf, htb, tap)")
    else:
        parser.print_help()


if __name__ == "__main__":
    _main()
