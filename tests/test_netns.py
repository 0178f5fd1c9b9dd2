"""The multi-host test bed: link specs, shaping plans, teardown, and a real swarm across 4 namespaces.

The real tests need root and `ip netns` (they skip with the reason otherwise).
The swarm test trains digits-dp for 10 steps across 4 namespaces (host 1's
link at 10 Mbit; host 2 delayed and host 3 lossy, by netem or else the
user-space tap link) and asserts an accuracy in the loopback band: the same
command on loopback gives 0.533 at step 10 (`phalanx launch digits-dp --peers 4
--steps 10`; the simulator gives the same). Ten steps, not more: each step
over the shaped links takes ~0.6 s, and the accuracy at step 10 is as far from
an untrained model's (0.1) as the check needs.
"""

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from phalanx import api
from phalanx.core.errors import ConfigError, LocalError
from phalanx.runs.launcher import ProcessLauncher
from phalanx.runs.netns import (
    EXAMPLE_SPEC,
    LinkShape,
    NetnsConfig,
    namespaces,
    parse_spec,
    plan_link,
    unavailable_reason,
)
from phalanx.runs.netns import Testbed as NetnsBed  # not Test*: pytest would try to collect it
from phalanx.runs.processes import MARKER_ENV, kill_marked, marked_processes
from phalanx.runs.tap_link import forward

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
LOOPBACK_ACCURACY = 0.533  # digits-dp, 4 peers, 10 steps, seed 0, on loopback
BAND = 0.04


def test_spec_parses_units_and_rejects_bad_text():
    config = parse_spec(EXAMPLE_SPEC, 4)
    assert config.shape(1) == LinkShape(rate_mbit=10.0)
    assert config.shape(2) == LinkShape(delay_ms=40.0, jitter_ms=10.0)
    assert config.shape(3) == LinkShape(loss_pct=1.0)
    assert config.shape(0) == LinkShape() and parse_spec("", 2).shapes == ()
    assert parse_spec("0:rate=500kbit,delay=0.1s", 1).shape(0) == LinkShape(rate_mbit=0.5, delay_ms=100.0)
    for bad, hosts in [("4:rate=1mbit", 4), ("1:rate=fast", 4), ("1:speed=1", 4), ("rate=1mbit", 4),
                       ("1:loss=100%", 4), ("1:delay=5ms,jitter=10ms", 4), ("1:rate=1mbit;1:loss=1", 4)]:
        with pytest.raises(ConfigError):
            parse_spec(bad, hosts)
    with pytest.raises(ConfigError):
        NetnsConfig(0)


def test_shaping_plan_uses_netem_where_present_and_says_what_it_could_not_apply():
    shape = LinkShape(rate_mbit=10.0, delay_ms=40.0, jitter_ms=5.0, loss_pct=1.0)
    commands, text = plan_link(shape, "eth0", {"netem", "tbf"})
    assert commands == [["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "limit", "10000",
                         "delay", "40ms", "5ms", "loss", "1%", "rate", "10000kbit"]]
    assert "netem" in text and "NOT" not in text
    commands, text = plan_link(shape, "eth0", {"tbf", "htb"})
    assert [c[6] for c in commands] == ["tbf"] and "rate 10mbit (tbf" in text
    assert "delay 40ms jitter 5ms, loss 1% NOT applied" in text
    commands, text = plan_link(LinkShape(rate_mbit=2.0), "v1", {"htb"})
    assert commands[0][6:9] == ["handle", "1:", "htb"] and commands[1][-2:] == ["rate", "2000kbit"]
    assert plan_link(LinkShape(loss_pct=1.0), "v1", set()) == ([], "loss 1% NOT applied (this kernel has no sch_netem)")
    commands, text = plan_link(shape, "eth0", {"tbf", "tap"})
    assert [c[6] for c in commands] == ["tbf"]
    assert text == "rate 10mbit (tbf, each direction); delay 40ms jitter 5ms, loss 1% (user-space tap link, each direction; this kernel has no sch_netem)"
    assert plan_link(LinkShape(), "v1", {"netem"}) == ([], "unshaped")


needs_netns = pytest.mark.skipif(bool(reason := unavailable_reason()), reason=f"no netns test bed: {reason}")

_BED_HOLDER = """
import subprocess, sys, time
from phalanx.runs.netns import NetnsConfig, Testbed
bed = Testbed(NetnsConfig(1), log=lambda line: None)
bed.up()
subprocess.Popen(bed.exec_prefix(bed.add_host()) + ["sleep", "600"])  # a host added to the running bed (a joiner's)
print(bed.prefix, flush=True)
time.sleep(600)
"""


class _Bed:
    """A running bed of `hosts` hosts as `ProcessLauncher` sees it, without namespaces (`namespaced`: the
    command lines say which namespace a worker would run in)."""

    def __init__(self, hosts: int, namespaced: bool = True) -> None:
        self.hosts = hosts
        self.namespaced = namespaced
        self.applied = {host: "rate 10mbit (tbf, each direction)" if host == 1 else "unshaped" for host in range(hosts)}
        self.downs = 0

    def add_host(self) -> int:
        self.applied[self.hosts] = "unshaped"
        self.hosts += 1
        return self.hosts - 1

    def exec_prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", f"phx-test-h{host}"] if self.namespaced else []

    def address(self, host: int) -> str:
        return f"10.77.0.{host + 1}"

    def listen_maddr(self, host: int) -> str:
        return f"/ip4/{self.address(host)}/tcp/0"

    def down(self) -> None:
        self.downs += 1


def test_a_worker_keeps_its_host_and_a_new_worker_gets_a_host_added():
    workers = ProcessLauncher(["worker"], "marker", netns=NetnsConfig(2))
    workers.bed = _Bed(2)
    assert workers.command("0", ["--index", "0"]) == ["ip", "netns", "exec", "phx-test-h0", "worker", "--index", "0",
                                                      "--die-with-parent", "--host", "/ip4/10.77.0.1/tcp/0"]
    assert workers.command("v0", [])[3] == "phx-test-h1" and workers.bed.hosts == 2
    assert workers.command("7", ["--join"])[3:5] == ["phx-test-h2", "worker"] and workers.bed.hosts == 3  # a joiner
    assert workers.command("0", ["--append"])[-1] == "/ip4/10.77.0.1/tcp/0" and workers.bed.hosts == 3  # a restart
    assert ProcessLauncher(["worker"], "marker").command("0", []) == ["worker", "--die-with-parent"]


def test_a_joiner_takes_the_host_of_a_worker_that_has_exited_and_a_restart_keeps_its_own():
    """Real (sleeping) worker processes on a bed of 2 hosts: joiners reuse hosts instead of adding one each."""
    workers = ProcessLauncher(["sh", "-c", "exec sleep 60"], f"test-hosts-{uuid.uuid4().hex}", netns=NetnsConfig(2))
    workers.bed = bed = _Bed(2, namespaced=False)
    try:
        for name in ("0", "1", "2"):  # "2", a joiner, on an added host
            workers.start(name)
        assert workers.hosts == {"0": 0, "1": 1, "2": 2} and bed.hosts == 3
        workers.kill("1")  # left: killed and swept
        workers.start("3")
        assert workers.hosts["3"] == 1 and bed.hosts == 3
        workers.procs["2"].terminate()  # exited by itself; the launcher sweeps it before it gives its host away
        workers.procs["2"].wait()
        workers.start("4")
        assert workers.hosts["4"] == 2 and bed.hosts == 3
        workers.start("5")  # no host free: one is added
        assert workers.hosts["5"] == 3 and bed.hosts == 4
        workers.kill("3")
        workers.kill("5")
        workers.start("5")  # a restart: its own host again, not the lowest free one
        assert workers.hosts["5"] == 3 and workers.free == [1]
        workers.start("6")  # the lowest free host
        workers.kill("0")
        workers.start("7")
        workers.start("0")  # its host taken meanwhile, none free: one is added
        assert (workers.hosts["6"], workers.hosts["7"], workers.hosts["0"], bed.hosts) == (1, 0, 4, 5)
        record = workers.netns_record()["netns"]
        assert record["1"] == record["3"] == record["6"] == {"host": 1, "address": "10.77.0.2",
                                                           "link": "rate 10mbit (tbf, each direction)"}
        assert record["0"] == {"host": 4, "address": "10.77.0.5", "link": "unshaped"} and len(record) == 8
    finally:
        workers.stop()
    assert bed.downs == 1 and workers.running() == []


def test_stop_tears_the_bed_down_when_a_second_sigterm_cuts_it_short():
    workers = ProcessLauncher(["worker"], f"test-stop-{uuid.uuid4().hex}", netns=NetnsConfig(1))
    workers.bed = bed = _Bed(1)

    def interrupted() -> None:
        raise KeyboardInterrupt("signal 15")  # as `stop_on_sigterm` raises it

    workers._wait_gone = interrupted
    with pytest.raises(KeyboardInterrupt):
        workers.stop()
    assert bed.downs == 1


def test_without_ip_a_launch_says_why_and_leaves_its_directory_and_nothing_to_tear_down(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no `ip`, no `tc`
    NetnsBed(NetnsConfig(1)).down()  # never started: nothing to do (it ran `ip` before, and raised)
    workers = ProcessLauncher(["worker"], f"test-no-ip-{uuid.uuid4().hex}", netns=NetnsConfig(1))
    with pytest.raises(LocalError, match="`ip` .iproute2. is not installed"):
        workers.start("0")
    workers.stop()
    out = tmp_path / "run"
    (out / "peers").mkdir(parents=True)
    (out / "peers" / "0.jsonl").write_text("{}\n")  # a former run's records
    with pytest.raises(LocalError, match="--netns: cannot build the test bed here: `ip`"):
        api.launch(api.config("digits-dp", peers=2), out, netns="")
    assert sorted(p.name for p in out.rglob("*")) == ["0.jsonl", "peers"]


@pytest.mark.hivemind  # builds a real bed: in the real-process group, never beside the swarm test
@needs_netns
def test_down_deletes_every_namespace_with_the_beds_prefix():
    bed = NetnsBed(NetnsConfig(1), log=lambda line: None)
    bed.up()
    try:
        subprocess.run(["ip", "netns", "add", f"{bed.prefix}-h1"], check=True)  # added, not yet counted (a signal)
        assert len(namespaces(f"{bed.prefix}-")) == 3
    finally:
        bed.down()
    assert namespaces(f"{bed.prefix}-") == []


@pytest.mark.hivemind  # builds a real bed: in the real-process group, never beside the swarm test
@needs_netns
def test_namespaces_and_their_processes_go_when_the_builder_is_killed():
    holder = subprocess.Popen([sys.executable, "-c", _BED_HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        prefix = holder.stdout.readline().strip()
        assert prefix and len(namespaces(prefix)) == 3
        pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-h1"], capture_output=True, text=True).stdout.split()
        assert len(pids) == 1
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 30
        while (namespaces(prefix) or _alive(int(pids[0]))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert namespaces(prefix) == [] and not _alive(int(pids[0]))
    finally:
        holder.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.hivemind
@needs_netns
def test_swarm_trains_across_four_shaped_namespaces(tmp_path):
    token = f"test-netns-{uuid.uuid4().hex}"
    out = tmp_path / "run"
    env = {**os.environ, MARKER_ENV: token, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", "digits-dp", "--peers", "4", "--steps", str(STEPS),
           "--out", str(out), "--no-progress", "--netns", EXAMPLE_SPEC]
    log = tmp_path / "launch.log"  # a file, not a pipe: nothing the run leaves behind can hold the test up
    try:
        with open(log, "w") as sink:
            launcher = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                code = launcher.wait(timeout=300)
            except subprocess.TimeoutExpired:
                launcher.kill()
                steps = {p.name: len(p.read_text().splitlines()) for p in sorted((out / "peers").glob("*.jsonl"))}
                pytest.fail(f"the run did not end within 300 s; records per peer {steps}:\n{log.read_text()[-3000:]}")
        output = log.read_text()
        assert code == 0, output[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["crashed"] == {} and summary["peers"] == 4
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS)) and rows[-1]["peers"] == 4
        # Every peer listened on its own namespace's address, not on loopback.
        assert (out / "peers" / "0.addr").read_text().startswith("/ip4/10.77.0.1/tcp/")
        hosts = summary["netns"]
        assert [(hosts[str(i)]["host"], hosts[str(i)]["address"]) for i in range(4)] == [(i, f"10.77.0.{i + 1}") for i in range(4)]
        assert hosts["1"]["link"].startswith("rate 10mbit (")
        for host, words in (("2", "delay 40ms jitter 10ms"), ("3", "loss 1%")):
            # netem, or else the user-space tap link; "NOT applied" only where neither exists.
            link = hosts[host]["link"]
            assert words in link and ("NOT applied" not in link or not os.access("/dev/net/tun", os.W_OK))
            assert f"host {host} " in output and link in output
        bed = re.search(r"host 0 \((phx-[0-9a-f]+)-h0, ", output)
        assert bed and namespaces(f"{bed.group(1)}-") == []  # this run's; another test's bed may be up meanwhile
        deadline = time.monotonic() + 10
        while marked_processes(token, prefix=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(token, prefix=True) == []
        # Until session 18 about one run in three (more under load) split the swarm at the start barrier:
        # two peers dialled each other at once, both dials failed, and the halves trained 120 s apart.
        missing = {p.stem: [json.loads(line)["missing_parts"] for line in p.read_text().splitlines()]
                   for p in sorted((out / "peers").glob("*.jsonl"))}
        assert abs(summary["final_accuracy"] - LOOPBACK_ACCURACY) <= BAND, f"all-reduce parts missed per peer and step: {missing}"
    finally:
        kill_marked(token, prefix=True)


def test_tap_link_drops_as_its_seeded_draws_say_and_keeps_order():
    source_in, source_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink_in, sink_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    frames = [f"frame {i}".encode() for i in range(200)]
    draws, kept = random.Random(7), []  # the same draws as forward's: loss, then jitter for each frame it keeps
    for frame in frames:
        if draws.random() < 0.3:
            continue
        draws.uniform(-0.002, 0.002)
        kept.append(frame)
    args = (source_out.fileno(), sink_in.fileno(), 0.005, 0.002, 0.3, random.Random(7))
    threading.Thread(target=forward, args=args, daemon=True).start()
    for frame in frames:
        source_in.send(frame)
    sink_out.settimeout(10)
    received = [sink_out.recv(100) for _ in kept]
    assert received == kept and 100 < len(kept) < 180
    sink_out.settimeout(0.3)
    with pytest.raises(socket.timeout):
        sink_out.recv(100)
