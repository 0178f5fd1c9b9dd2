"""Phalanx's butterfly all-reduce next to hivemind's DecentralizedAverager, real processes on loopback.

Two swarms live side by side in the same invocation: ``--peers`` OS
processes that each run `phalanx.runtime.rounds.butterfly.ButterflyAllReduce` over
`phalanx.transport.p2p.HivemindTransport`, and ``--peers`` OS processes that
each run `hivemind.averaging.DecentralizedAverager` on their own
`hivemind.DHT` (in both swarms peer 0's visible multiaddrs are the others'
initial_peers). Each peer averages a float32 vector of ``--dim`` coordinates,
``1 + --rounds`` times; round 0 is a warm-up and is not counted. The rounds
alternate between the swarms (phalanx then hivemind, then the other way
round), so a change in the machine's load hits both alike; while one swarm
runs a round the other one idles. Prints figures only, never asserts on them.

How a round is timed. Each swarm's peers and this process share one
``multiprocessing.Barrier`` (the same primitive for both systems, so neither
pays for a network barrier). Inputs and the expected mean are computed before
the barrier; each peer times from its release of the barrier to the moment
it holds the averaged vector (perf_counter, one clock for all processes of
the machine); the correctness check runs after a second barrier, once every
peer of the swarm is done, and workers shut down only after the last round
of both swarms. A round takes the slowest peer's time, and a system's figure
is the median over the timed rounds.

Fairness.

- Same data, dtype and reduction: float32 on the wire, no compression on
  either side (hivemind's ``compression`` is ``NoCompression()`` by default;
  it is passed explicitly), plain unweighted mean over all peers.
- Same transport underneath: both use hivemind's libp2p daemon (p2pd) on
  loopback with its defaults (TLS/noise secure channel), one DHT process and
  one daemon per peer, streams opened with the same `P2P.call_binary_stream_handler`.
  Hivemind opens one stream per pair of peers and round and sends protobuf
  messages of 512 KiB parts both ways on it, so reducing and returning
  averaged parts overlaps with the upload; phalanx opens one stream per
  message (a whole part, dim/peers floats, then a whole reduced part) and
  writes its own frames.
- One torch thread per peer process on both sides.
- No timeouts in the way: hivemind's allreduce has none by default; phalanx's
  per-phase timeout is raised to 120 s so that a slow peer is never dropped
  (the default 5 s is a fault-tolerance knob, not a speed knob). Phalanx's
  ``pull_after`` (when missing parts are pulled again) keeps its default
  unless ``--pull-after`` says otherwise.
- Group formation. Phalanx's group is given: the sorted membership view, the
  same on every peer. Hivemind must form its group every round by DHT-based
  matchmaking, which is part of what ``averager.step()`` costs a user, so the
  main hivemind figure is the whole step. It is also split in two: matchmaking
  (from the step call until the peer's step enters RUNNING_ALLREDUCE, polled
  every 2 ms from the peer's main process) and the all-reduce phase (from the
  first peer entering RUNNING_ALLREDUCE to the last peer holding its result).
  The ratio against the all-reduce phase alone is the transfer-for-transfer
  comparison; the ratio against the full step is what each system costs.
- ``target_group_size = min_group_size = peers``, so the group forms as soon
  as all peers joined a leader; ``min_matchmaking_time`` (default 5 s in
  hivemind) is how long a peer declares itself looking for a group, and only
  sets how long matchmaking waits when the group does not fill up. It is set
  to 2 s here (``--min-matchmaking-time``), with ``request_timeout`` 1 s
  (hivemind requires request_timeout < min_matchmaking_time).

Correctness: every peer's result is compared with the float64 mean of the
inputs of all peers (each peer recomputes them from their seeds), outside the
timed region; the table shows the max abs error over peers and rounds and
whether every result is allclose(rtol=1e-5, atol=1e-5). For phalanx it also
counts results that dropped a sender or missed a part.

Resources: at the default size the whole process tree peaks at about 6.5 GB
(PSS; about 1.9 GB of it is the 8 workers, their DHT and averager processes
and daemons at any size, the rest copies of the vector: inputs, the float64
expected mean, messages, inboxes). A run takes 0.5 to 1.5 minutes on 2 cores,
most of it start-up.

    .venv/bin/python bench/allreduce.py [--dim 10000000] [--peers 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _allreduce_worker as worker  # noqa: E402

BARRIER_TIMEOUT = 300.0  # seconds for one pass of a swarm's barrier (start-up included)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=10_000_000, help="float32 coordinates per vector")
    parser.add_argument("--peers", type=int, default=4, help="OS processes per swarm")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="phalanx,hivemind", help="comma-separated subset, in run order")
    parser.add_argument("--pull-after", type=float, default=0.2, help="phalanx AllReduceConfig.pull_after (s)")
    parser.add_argument("--min-matchmaking-time", type=float, default=2.0, help="hivemind averager (s)")
    parser.add_argument("--request-timeout", type=float, default=1.0, help="hivemind averager (s)")
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in ("phalanx", "hivemind") for s in systems):
        parser.error("--systems takes phalanx and/or hivemind")
    if args.peers < 2 or args.rounds < 1 or args.dim < args.peers:
        parser.error("need --peers >= 2, --rounds >= 1 and --dim >= --peers")

    settings = {
        "dim": args.dim,
        "peers": args.peers,
        "rounds": args.rounds,
        "seed": args.seed,
        "pull_after": args.pull_after,
        "min_matchmaking_time": args.min_matchmaking_time,
        "request_timeout": args.request_timeout,
    }
    print(
        f"all-reduce of float32[{args.dim:,}] ({args.dim * 4 / 1e6:.0f} MB) among {args.peers} OS processes "
        f"on loopback, {os.cpu_count()} CPU cores; {args.rounds} timed rounds after 1 warm-up"
    )
    print(
        f"phalanx: ButterflyAllReduce, timeout={worker.STEP_TIMEOUT:.0f}s, pull_after={args.pull_after}s | "
        f"hivemind: DecentralizedAverager, NoCompression, target=min group size={args.peers}, "
        f"min_matchmaking_time={args.min_matchmaking_time}s, request_timeout={args.request_timeout}s"
    )
    wall = time.perf_counter()
    outcomes = run(systems, settings)
    print(f"  finished in {time.perf_counter() - wall:.0f}s wall, start-up included", flush=True)
    report(outcomes, args)


# --- running the swarms ------------------------------------------------------------------------------


def run(systems: list[str], settings: dict) -> dict[str, dict]:
    """Start one swarm per system, run their rounds alternately, return each system's figures."""
    swarms = [Swarm(system, settings) for system in systems]
    try:
        for swarm in swarms:
            swarm.start_first()
        for swarm in swarms:
            swarm.start_others()
        for swarm in swarms:
            swarm.wait()  # ready: every peer is up and holds its round-0 input
            swarm.record_descendants()
        wall = time.perf_counter()
        for round_index in range(1 + settings["rounds"]):
            # Alternate which system goes first, so that neither always follows the other.
            for swarm in swarms if round_index % 2 == 0 else swarms[::-1]:
                for _ in ("start", "end", "checked"):
                    swarm.wait()
            name = "warm-up" if round_index == 0 else f"round {round_index}"
            print(f"  {name} done ({time.perf_counter() - wall:.0f}s since the swarms were ready)", flush=True)
        for swarm in swarms:
            swarm.wait()  # finished: from here on the workers shut down
        return {swarm.system: summarize(swarm.system, swarm.collect(), settings) for swarm in swarms}
    finally:
        for swarm in swarms:
            swarm.close()
        started = {pid: cmd for swarm in swarms for pid, cmd in swarm.descendants.items()}
        alive = [pid for pid, cmd in started.items() if _cmdline(pid) == cmd]
        workers = sum(len(swarm.procs) for swarm in swarms)
        print(
            f"  clean-up: {workers} workers and {len(started)} processes under them (DHTs, averagers, p2pd "
            f"daemons) were started; {'none is left' if not alive else f'still alive: {alive}'}",
            flush=True,
        )


class Swarm:
    """`peers` worker processes of one system, in lock-step with this process through a shared barrier."""

    def __init__(self, system: str, settings: dict) -> None:
        self.system = system
        self.settings = dict(settings, run_id=f"bench-ar-{uuid.uuid4().hex[:8]}")
        self.n = settings["peers"]
        self.target = worker.phalanx_worker if system == "phalanx" else worker.hivemind_worker
        self.ctx = mp.get_context("spawn")
        self.sync = self.ctx.Barrier(self.n + 1)  # the peers and this process
        self.results = self.ctx.Queue()
        self.procs: list = []
        self.descendants: dict[int, str] = {}
        self.pending: list[dict] = []

    def _spawn(self, index: int, initial_peers: list[str]) -> None:
        args = (index, self.settings, initial_peers, self.sync, self.results)
        proc = self.ctx.Process(target=self.target, args=args, name=f"{self.system}-{index}")
        proc.start()
        self.procs.append(proc)

    def start_first(self) -> None:
        self._spawn(0, [])

    def start_others(self) -> None:
        """Wait for peer 0's multiaddrs, then start the other peers with them as initial peers."""
        item = self._next_item(time.monotonic() + worker.JOIN_TIMEOUT)
        if "maddrs" not in item:
            self.pending.append(item)
            self._raise_failure()
        for index in range(1, self.n):
            self._spawn(index, item["maddrs"])

    def wait(self) -> None:
        """Pass the barrier with the peers; raise with a peer's traceback if the swarm broke."""
        done, failure = threading.Event(), []

        def pass_barrier() -> None:
            try:
                self.sync.wait()
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=pass_barrier, daemon=True).start()
        deadline = time.monotonic() + BARRIER_TIMEOUT
        while not done.wait(0.5):
            # A worker that fails reports and aborts the barrier itself; this catches one that died silently.
            if any(p.exitcode not in (None, 0) for p in self.procs) or time.monotonic() > deadline:
                self.sync.abort()
        if failure:
            self._raise_failure()

    def _raise_failure(self):
        try:
            while True:
                self.pending.append(self.results.get(timeout=5.0))
        except queue.Empty:
            pass
        errors = [f"peer {item['index']}:\n{item['error']}" for item in self.pending if "error" in item]
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode not in (None, 0)]
        detail = "\n".join(errors) or f"no traceback; dead workers: {dead or 'none'} (or the swarm timed out)"
        raise RuntimeError(f"the {self.system} swarm failed: {detail}")

    def _next_item(self, deadline: float) -> dict:
        while True:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                pass
            if any(p.exitcode not in (None, 0) for p in self.procs) or time.monotonic() > deadline:
                self._raise_failure()

    def collect(self) -> list[dict]:
        """Each peer's record, by index."""
        by_index = {item["index"]: item for item in self.pending if "seconds" in item}
        deadline = time.monotonic() + 60.0
        while len(by_index) < self.n:
            item = self._next_item(deadline)
            if "error" in item:
                self.pending.append(item)
                self._raise_failure()
            by_index[item["index"]] = item
        return [by_index[i] for i in range(self.n)]

    def record_descendants(self) -> None:
        self.descendants.update(_descendants([p.pid for p in self.procs if p.is_alive()]))

    def close(self) -> None:
        """Let the workers shut down their DHTs and daemons; kill whatever of ours is left."""
        self.record_descendants()
        self.sync.abort()  # after an error here, frees workers still waiting; after a normal run, no one waits
        deadline = time.monotonic() + 60.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        _kill_leftovers(self.descendants)
        self.results.close()


def _descendants(roots: list[int]) -> dict[int, str]:
    """pid -> command line of every live descendant of `roots` (DHT and averager processes, p2pd daemons)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            cmdline = _cmdline(child)
            if cmdline:  # empty for a zombie, which is gone once its parent reaps it
                found[child] = cmdline
    return found


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _kill_leftovers(processes: dict[int, str]) -> None:
    """Kill those of our recorded descendants still alive after their parents shut down (same pid and cmdline)."""
    time.sleep(0.5)  # let daemons that are shutting down finish on their own
    for pid, cmdline in processes.items():
        if _cmdline(pid) == cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                print(f"  killed leftover process {pid}: {cmdline.replace(chr(0), ' ')[:80]}", file=sys.stderr)
            except ProcessLookupError:
                pass


# --- figures -------------------------------------------------------------------------------------------


def summarize(system: str, peers: list[dict], settings: dict) -> dict:
    """Per-round figures from the peers' records; round 0 (warm-up) is left out of the timings."""
    timed = range(1, 1 + settings["rounds"])
    every = range(1 + settings["rounds"])
    out = {
        "rounds": [max(p["seconds"][r] for p in peers) for r in timed],
        "warmup": max(p["seconds"][0] for p in peers),
        "max_error": max(max(p["errors"]) for p in peers),
        "bad_rounds": [r for r in every if not all(p["all_close"][r] for p in peers)],
        "incomplete": sum(sum(p["incomplete"]) for p in peers),
        "evidence": sum(p.get("evidence", 0) for p in peers),
    }
    if system == "hivemind":
        # release of the barrier ~ the earliest step call; matchmaking lasts until the first peer enters
        # RUNNING_ALLREDUCE, the all-reduce phase from then until the last peer holds its result.
        release = [min(p["allreduce_end"][r] - p["seconds"][r] for p in peers) for r in timed]
        first_in = [min(p["allreduce_start"][r] for p in peers) for r in timed]
        last_out = [max(p["allreduce_end"][r] for p in peers) for r in timed]
        out["matchmaking"] = [b - a for a, b in zip(release, first_in)]
        out["allreduce"] = [b - a for a, b in zip(first_in, last_out)]
    return out


def report(outcomes: dict[str, dict], args: argparse.Namespace) -> None:
    rows = []
    ours = outcomes.get("phalanx")
    ours_median = statistics.median(ours["rounds"]) if ours else None

    def row(name: str, seconds: list[float], compare: bool) -> None:
        median = statistics.median(seconds)
        ratio = f"{ours_median / median:.2f}x" if compare and ours_median is not None else ""
        rows.append((name, f"{median:.3f}", ratio, " ".join(f"{s:.3f}" for s in seconds)))

    if ours:
        row("phalanx ButterflyAllReduce (ours)", ours["rounds"], False)
    hm = outcomes.get("hivemind")
    if hm:
        row("hivemind DecentralizedAverager.step()", hm["rounds"], True)
        row("  of which matchmaking", hm["matchmaking"], False)
        row("  of which all-reduce phase", hm["allreduce"], True)
    header = ("system", "median s/round", "ours/this", "timed rounds (s)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print()
    for line in [header, tuple("-" * w for w in widths), *rows]:
        cells = [c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
    print()
    print(
        f"correctness: every peer's result in every round (warm-up included) against the float64 mean "
        f"of all {args.peers} inputs, allclose(rtol={worker.RTOL:g}, atol={worker.ATOL:g}):"
    )
    for system, outcome in outcomes.items():
        bad = outcome["bad_rounds"]
        verdict = "all allclose" if not bad else f"NOT allclose in round(s) {bad} (0 = warm-up)"
        extra = (
            f"; {outcome['incomplete']} results missing a part or a sender, "
            f"{outcome['evidence']} pieces of evidence reported"
            if system == "phalanx"
            else ""
        )
        print(f"  {system:8s}: max abs error {outcome['max_error']:.2e}, {verdict}{extra}")
    print(
        "ours/this < 1.00x means phalanx is faster. Rounds alternate between the systems; other load on the "
        "machine still moves the figures, so compare medians over several runs."
    )


if __name__ == "__main__":
    main()
