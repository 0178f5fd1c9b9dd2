"""`phalanx launch` of a pipeline preset: data nodes and relays as OS processes over hivemind.

Each worker runs in its own process group (its hivemind DHT child and libp2p
daemon with it), so a relay can be killed mid-iteration as a whole
(`faults.crash_relay`, `faults.crash_iteration`, `faults.crash_at`) and no
daemon outlives the run. Workers write their iteration records and events to
peers/INDEX.jsonl; the launcher merges them into the files `simulate` writes.
With SENTINEL's boundary placement the launcher also starts one verifier
process per stage boundary (`--verifier LINK`, records in peers/vLINK.jsonl).
Workers are started by the common `ProcessLauncher` (`launcher.py`): each
carries its own marker, arms a parent-death signal and has a watchdog, and
the launcher sweeps each group and marker at the end. With `--netns` each
process gets a host of its own (`launch_hosts`), joining relays too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ...core.errors import ConfigError, LocalError
from ...runtime.pipeline import DataNode
from ...runtime.pipeline.relay import JoinRefused, ask_for_stage
from ...runtime.pipeline.verifier import VerifierNode
from ..dp.launch import JOIN_TIMEOUT, prepare_run_dir
from ..dp.swarm import peer_identity
from ..launcher import (
    NotGone,
    ProcessLauncher,
    barrier,
    exit_done,
    first_address,
    stop_on_sigterm,
    worker_parser,
)
from ..netns import NetnsConfig
from ..processes import MARKER_ENV, guard_worker, new_marker
from .config import PipelineRunConfig
from .launch_churn import PipelineChurn, stage_floor
from .run import (
    PipelineRecorder,
    build_node,
    param_digest,
    pipeline_task,
    verifier_identity,
    verifier_ids,
)

FINISHED = "pp.finished"
RUN_TIMEOUT = 3600.0
FINISHED_PATIENCE = 30.0  # seconds between fetches of a data node's FINISHED that has not arrived (a lost one would hold a relay for RUN_TIMEOUT; each wait fetches this often for the whole run)


async def run_pipeline_worker(
    config: PipelineRunConfig, index: int, initial_peers: list[str], records_path: Path, address_file: Path | None,
    join: bool = False, host: str = "/ip4/127.0.0.1/tcp/0", initial_peers_file: Path | None = None,
    append: bool = False,
) -> None:
    """One real pipeline node: join, build the role, train or serve, leave when the data nodes are done.

    With `join`, a fresh relay process joins a running pipeline: the leader places it, it downloads its
    stage's weights, then serves (GWTF V-B). Its identity `index` is a new one (>= config.peers) or that of
    a relay that left and comes back (churn): a Byzantine index stays Byzantine, a banned one is refused.
    `initial_peers_file`: started with the first worker, take its address from this file once it is written.
    `append`: add to `records_path` (a relay started again keeps its earlier records) instead of rewriting it.
    The first data node writes an `opened` row as each iteration opens (the launcher's churn clock).
    """
    from ...transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    if initial_peers_file is not None:
        initial_peers = await first_address(initial_peers_file, JOIN_TIMEOUT)
    identity = peer_identity(config.seed, index)
    run_id = f"{config.preset}-pipeline-seed{config.seed}"
    transport = HivemindTransport(identity, run_id=run_id, initial_peers=initial_peers, host_maddrs=[host])
    await transport.start()
    records_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(transport.visible_maddrs()) + "\n")
            tmp.rename(address_file)
        ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
        directory = {pid: config.stage_of(i) for i, pid in enumerate(ids)}
        members = config.peers + len(verifier_ids(config))
        cut = append and records_path.exists() and not records_path.read_bytes().endswith(b"\n")
        with open(records_path, "a" if append else "w") as sink:
            if cut:
                sink.write("\n")  # the killed process left its last line unfinished

            def write(kind: str, row: dict) -> None:
                sink.write(json.dumps({"type": kind, **row}, sort_keys=True) + "\n")
                sink.flush()

            transport.on_evidence(lambda e: write("evidence", {"by": transport.peer_id, "peer": e.peer, "kind": e.kind}))

            if join:
                await _join_and_serve(config, transport, index, directory, write, ids[: config.data_nodes])
                return
            node = build_node(config, transport, index, directory, pipeline_task(config), lambda e: write("event", e))
            try:
                peers = await transport.wait_for_members(members, JOIN_TIMEOUT)
            except TimeoutError:
                raise LocalError(f"only {len(transport.members())} of {members} peers joined within {JOIN_TIMEOUT:.0f} s") from None
            await barrier(transport, "start", peers)
            data_nodes = ids[: config.data_nodes]
            if isinstance(node, DataNode):
                opened = (lambda it, duration: write("opened", {"it": it, "duration": duration, "t": node.now()})) \
                    if index == 0 else None
                watching = asyncio.create_task(_write_banned(node, write)) if index == 0 else None
                await node.run(config.steps, lambda r: write("iteration", r), opened)
                if watching is not None:
                    watching.cancel()
                await transport.broadcast(FINISHED, 0, b"")
                await transport.collect_broadcasts(FINISHED, 0, data_nodes, 30.0, patience=FINISHED_PATIENCE)
                await asyncio.sleep(1.0)  # let the last CAN TAKE and FINISHED messages leave
            else:
                serving = asyncio.create_task(node.serve())
                await transport.collect_broadcasts(FINISHED, 0, data_nodes, RUN_TIMEOUT, patience=FINISHED_PATIENCE)
                node.stop()
                await serving
                await _last_aggregation(node, config)
            write("final", _final_state(node))
            await node.close()
    finally:
        await transport.stop()


async def run_verifier_worker(config: PipelineRunConfig, link: int, initial_peers: list[str], records_path: Path,
                              initial_peers_file: Path | None = None, host: str = "/ip4/127.0.0.1/tcp/0") -> None:
    """One boundary verifier process (SENTINEL, placement=boundary): the VIA hop of `link` until the data
    nodes finish. Its verdicts and bans go to `records_path` as events."""
    from ...transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    if initial_peers_file is not None:
        initial_peers = await first_address(initial_peers_file, JOIN_TIMEOUT)
    run_id = f"{config.preset}-pipeline-seed{config.seed}"
    transport = HivemindTransport(verifier_identity(config.seed, link), run_id=run_id, initial_peers=initial_peers,
                                  host_maddrs=[host])
    await transport.start()
    records_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
        directory = {pid: config.stage_of(i) for i, pid in enumerate(ids)}
        verifiers = verifier_ids(config)
        with open(records_path, "w") as sink:

            def write(event: dict) -> None:
                sink.write(json.dumps({"type": "event", **event}, sort_keys=True) + "\n")
                sink.flush()

            node = VerifierNode(transport, config.sentinel, config.pipeline, config.seed, directory, write, verifiers)
            members = config.peers + len(verifiers)
            try:
                peers = await transport.wait_for_members(members, JOIN_TIMEOUT)
            except TimeoutError:
                raise LocalError(f"only {len(transport.members())} of {members} peers joined within {JOIN_TIMEOUT:.0f} s") from None
            await barrier(transport, "start", peers)
            serving = asyncio.create_task(node.serve())
            await transport.collect_broadcasts(FINISHED, 0, ids[: config.data_nodes], RUN_TIMEOUT, patience=FINISHED_PATIENCE)
            await asyncio.sleep(1.0)  # let the last bans leave
            node.stop()
            await serving
            await node.close()
    finally:
        await transport.stop()


async def _join_and_serve(config: PipelineRunConfig, transport, index: int, directory: dict[str, int], write,
                          data_nodes: list[str]) -> None:
    await transport.wait_for_members(2, JOIN_TIMEOUT)
    task = pipeline_task(config)  # built before the placement, so that the placement is fresh when the download starts
    placed = None
    try:
        for _ in range(10):
            placed = await ask_for_stage(transport, directory, config.pipeline.capacity, 2 * config.pipeline.complete_timeout)
            if placed is not None or _run_ended(transport, data_nodes):
                break
            await asyncio.sleep(1.0)
    except JoinRefused as exc:
        print(f"phalanx: {exc}", file=sys.stderr)
        write("refused", {"peer": transport.peer_id})
        return
    if _run_ended(transport, data_nodes):
        print("phalanx: the run ended before this relay was placed", file=sys.stderr)
        return
    if placed is None:
        raise LocalError("no data node placed this joiner")
    stage, it = placed.stage, placed.it
    node = build_node(config, transport, index, placed.directory, task, lambda e: write("event", e), stage=stage,
                      joiner=True)
    node.banned.update(placed.banned)
    placed_at = node.now()

    async def placement() -> tuple[int, dict[str, int]] | None:
        try:
            again = await ask_for_stage(transport, node.directory, config.pipeline.capacity, 2 * config.pipeline.complete_timeout)
        except JoinRefused:
            return None
        return None if again is None else (again.it, again.directory)

    outcome = await download(node, it, placement, lambda: _run_ended(transport, data_nodes),
                             JOIN_PATIENCE * config.pipeline.aggregation_timeout)
    if outcome == "ended":
        print("phalanx: the run ended before this relay had its stage's weights", file=sys.stderr)
        await node.close()
        return
    if outcome == "failed":
        raise LocalError(f"could not download the weights of stage {stage}")
    # Written once it has the weights (t0: placed, t1: weights in; it serves from iteration `since`): the launcher's
    # churn counts it as a live replica from that iteration.
    write("event", {"kind": "join", "peer": transport.peer_id, "stage": stage, "it": it, "since": node.serving_from,
                    "t0": placed_at, "t1": node.now()})
    serving = asyncio.create_task(node.serve())
    await transport.collect_broadcasts(FINISHED, 0, data_nodes, RUN_TIMEOUT, patience=FINISHED_PATIENCE)
    node.stop()
    await serving
    await _last_aggregation(node, config)
    write("final", _final_state(node))
    await node.close()


BANNED_POLL = 0.2  # seconds between the first data node's looks at its banned set


async def _write_banned(node: DataNode, write: Callable[[str, dict], None]) -> None:
    """The first data node's banned set (SENTINEL's bans, stage bans and retirements reported by a majority of
    their stage, its own evidence), a `banned` row each time it changes: the launcher's churn reads the set
    the simulator's churn reads (`leave_allowed`)."""
    last: frozenset[str] = frozenset()
    while True:
        now = frozenset(node.banned)
        if now != last:
            write("banned", {"peers": sorted(now), "t": node.now()})
            last = now
        await asyncio.sleep(BANNED_POLL)


async def _last_aggregation(node, config: PipelineRunConfig) -> None:
    """Until the relay's stage round of the last iteration is over (bounded by the aggregation timeout): the
    data nodes finish once their microbatches are done, while the relays may still be aggregating that update."""
    if node.version < config.steps:
        try:
            await asyncio.wait_for(node.aggregated_event(config.steps - 1).wait(), config.pipeline.aggregation_timeout)
        except TimeoutError:
            pass


def _final_state(node) -> dict:
    """What a node ends with: its stage, version and weights digest (replicas of a stage must agree) and
    the peers it routes around and leaves out of groups (its bans: SENTINEL's, BTARD's, its own evidence)."""
    return {"peer": node.me, "stage": node.stage, "version": node.version, "digest": param_digest(node),
            "banned": sorted(node.banned)}


JOIN_PATIENCE = 2  # a joiner tries to download its stage's weights for this many aggregation timeouts


async def download(node, version: int, placement: Callable[[], Awaitable[tuple[int, dict[str, int]] | None]],
                   ended: Callable[[], bool], patience: float) -> str:
    """A placed joiner's download: "served" once it has its stage's weights, "ended" when the data nodes
    finished first, "failed" after `patience` seconds. Between tries it asks the leader again for the
    current iteration and stage directory: under load a joiner takes tens of seconds from its placement
    to its first try, and the replicas it was told of may have left by then."""
    deadline = node.now() + patience
    while True:
        if await node.enter(version):
            return "served"
        if ended():
            return "ended"
        if node.now() >= deadline:
            return "failed"
        fresh = await placement()
        if fresh is not None:
            version = fresh[0]
            node.directory.update({p: s for p, s in fresh[1].items() if p != node.me})


def _run_ended(transport, data_nodes: list[str]) -> bool:
    """The data nodes broadcast FINISHED: nothing is left to train."""
    return bool(transport.board.get(FINISHED, 0).keys() & set(data_nodes))


def launch_hosts(config: PipelineRunConfig) -> int:
    """The hosts of `launch --netns`: node i on host i, then the boundary verifiers by link; each joining
    relay (`faults.rejoin_after`, churn) gets a further, unshaped host as it starts."""
    return config.peers + len(verifier_ids(config))


def launch_pipeline(config: PipelineRunConfig, out: Path, progress: bool = True, netns: NetnsConfig | None = None) -> dict:
    """Run a pipeline config as config.peers processes on loopback; write the run's files to `out`.

    With `netns`, each process runs in its own network namespace (`launch_hosts`)."""
    wall_start = time.perf_counter()
    config_path, peer_dir, address_file = prepare_run_dir(config, out)
    base = [sys.executable, "-m", "phalanx.runs.pipeline.launch", "--config", str(config_path), "--out", str(peer_dir)]
    # One marker per child: a worker's watchdog SIGKILLs everything carrying its marker when the worker
    # exits, so children sharing one (the three verifiers did) killed each other at the end of a run.
    workers = ProcessLauncher(base, os.environ.get(MARKER_ENV) or new_marker(), err_dir=peer_dir, netns=netns)
    links = sorted(verifier_ids(config))
    nodes = [str(index) for index in range(config.peers)]
    victim = str(config.data_nodes + config.faults.crash_relay) if config.faults.crash_relay >= 0 else None
    killed = False
    joins = Joins(peer_dir)
    with stop_on_sigterm():
        try:
            workers.start("0", "--index", "0", "--address-file", str(address_file))
            for name in nodes[1:]:
                workers.start(name, "--index", name, "--initial-peers-file", str(address_file))
            for link in links:
                workers.start(f"v{link}", "--index", "0", "--verifier", str(link), "--initial-peers-file", str(address_file))
            addrs = workers.address("0", address_file, JOIN_TIMEOUT, "the first peer")
            bar = tqdm(total=config.steps, desc=f"launch {config.preset}", disable=not progress, leave=False)
            churn = PipelineChurn(config, stage_floor(config)) if PipelineChurn.wanted(config) else None
            placed = {n: config.stage_of(int(n)) for n in nodes[config.data_nodes:]}  # live relays that serve, by stage
            names = {peer_identity(config.seed, int(n)).peer_id: n for n in nodes}
            opened_at = None
            data = [workers.procs[n] for n in nodes[: config.data_nodes]]
            while any(p.poll() is None for p in data) and not any(p.poll() not in (None, 0) for p in data):
                now = time.monotonic()  # before the rows are read: no decision is taken past an opening not yet read
                done, opened, banned = _progress(peer_dir / "0.jsonl")
                bar.update(done - bar.n)
                if victim is not None and not killed and done >= config.faults.crash_iteration:
                    # from the crash iteration's opening on the first data node's clock, as the simulator does
                    opened_at = next((at for it, at, _ in opened if it == config.faults.crash_iteration), now) if opened_at is None else opened_at
                    if now - opened_at >= config.faults.crash_at:
                        workers.kill(victim)
                        placed.pop(victim, None)
                        killed = True
                        if churn is not None:
                            churn.crashed(victim)
                rejoin = config.faults.rejoin_after
                if killed and rejoin and str(config.peers) not in nodes and done >= config.faults.crash_iteration + rejoin:
                    nodes.append(str(config.peers))
                    names[peer_identity(config.seed, config.peers).peer_id] = nodes[-1]
                    joins.started(nodes[-1])
                    workers.start(nodes[-1], "--index", nodes[-1], "--join", "--initial-peers", *addrs)
                joins.follow(workers, placed, run_over=done >= config.steps)
                if churn is not None:
                    _churn(churn, workers, joins, placed, frozenset(names[p] for p in banned if p in names), opened, addrs, now)
                time.sleep(0.02)
            bar.close()
            workers.wait([n for n in nodes if n != victim and n not in workers.stopped], 60)
            workers.wait([f"v{link}" for link in links], 30)
        finally:
            workers.stop()
    joins.end_run(workers)  # a joiner that has not served by now: the end of the run overtook it
    joined = set(joins.outcomes)  # every relay started with --join (new identities and relays that came back)
    ended = [(f"peer {n}", n) for n in nodes if n != victim and n not in workers.stopped]
    ended = [(who, name, workers.procs[name].returncode) for who, name in ended + [(f"verifier {link}", f"v{link}") for link in links]]
    # A joining relay that has not served may fail (its download, a refusal, the end of the run overtaking it):
    # that is a join outcome. One that served and then exited with an error crashed, as a launched relay can.
    failed = [(who, name, code) for who, name, code in ended if code != 0 and name not in joined]
    failed += [(f"peer {name} (joined)", name, code) for name, code in joins.crashes]
    for name in sorted(joined, key=int):
        tries = joins.outcomes[name].count("failed")
        if tries:  # a volunteer that could not join; the run went on without it
            print(f"phalanx: joining relay {name} failed {tries} of {len(joins.outcomes[name])} joins{workers.tail(name, 5)}",
                  file=sys.stderr)
    late = sorted((n for n, outs in joins.outcomes.items() if "late" in outs), key=int)
    if late:
        print(f"phalanx: the end of the run overtook {len(late)} joining relays before they served ({', '.join(late)})",
              file=sys.stderr)
    ids = [peer_identity(config.seed, i).peer_id for i in range(1 + max(int(n) for n in nodes))]
    recorder = PipelineRecorder(config, ids)
    names = nodes + [f"v{link}" for link in links]
    evidence: list[list[str]] = []  # [by, against, kind]: a run without attackers should have none
    finals: list[dict] = []
    for name in names:
        for row in _rows(peer_dir / f"{name}.jsonl"):
            kind = row.pop("type")
            if kind == "iteration":
                recorder.iterations.append(row)
            elif kind == "evidence":
                evidence.append([row["by"], row["peer"], row["kind"]])
            elif kind == "final":
                finals.append(row)
            elif kind == "event":
                recorder.on_event(row)
    _to_relative_time(recorder)
    extra = {"mode": "launch", "wall_seconds": time.perf_counter() - wall_start, "verifier_ids": verifier_ids(config),
             "killed": ids[int(victim)] if killed and victim is not None else None,
             "process_groups": [p.pid for p in workers.processes()], "evidence": evidence,
             # as `simulate`'s: stage, version and weights digest of every node that finished every iteration
             "replicas": {f["peer"]: [f["stage"], f["version"], f["digest"]] for f in finals if f["version"] == config.steps},
             "excluded": {f["peer"]: f["banned"] for f in finals},  # node -> the peers it ended routing around
             **workers.netns_record()}
    if joined:
        extra["joiners"] = {name: joins.outcomes[name] for name in sorted(joined, key=int)}  # one outcome per join
    if churn is not None:
        extra["churn"] = [{"it": e.it, "peer": ids[int(e.name)], "index": int(e.name), "event": e.event} for e in churn.events]
    # processes that exited with an error by themselves (not the launcher's kills: churn, the crash fault, the stop)
    extra["crashed"] = [{"name": name, "code": code} for _, name, code in failed]
    summary = recorder.write(out, extra)
    if failed:
        raise LocalError("; ".join(f"{who} exited with code {code}{workers.tail(name)}" for who, name, code in failed)
                         + f" (the run's records are in {out})")
    return summary


class Joins:
    """The relay processes started with --join (a new identity, or a relay that comes back under its own),
    each read from where its rows begin in its records file (the file is appended to), and what each join
    came to: "served" (its stage's weights in), "refused" (a banned identity), "left" (churn took it before
    it served), "late" (the end of the run overtook it), "failed" (it exited during the run without serving)
    or "crashed" (it served, then exited with an error by itself: not killed by the launcher)."""

    def __init__(self, peer_dir: Path) -> None:
        self.peer_dir = peer_dir
        self.offset: dict[str, int] = {}  # relay -> where its current process's rows begin, while that one is open
        self.outcomes: dict[str, list[str]] = {}
        self.crashes: list[tuple[str, int]] = []  # (relay, exit code) of each join that served and then crashed
        # relay -> the first iteration its current process serves (its join event's `since`: the iteration under
        # way when its weights came in is not one); launched relays serve from 0
        self.serves_from: dict[str, int] = {}

    def started(self, name: str) -> None:
        path = self.peer_dir / f"{name}.jsonl"
        self.offset[name] = path.stat().st_size if path.exists() else 0
        self.outcomes.setdefault(name, [])
        self.serves_from.pop(name, None)

    def rows(self, name: str) -> list[dict]:
        return _rows(self.peer_dir / f"{name}.jsonl", self.offset[name])

    def stage(self, name: str) -> int | None:
        """The stage the current process of `name` serves (its `join` event, written once its weights are in)."""
        joined = self._join(name)
        return None if joined is None else int(joined["stage"])

    def _join(self, name: str) -> dict | None:
        return next((r for r in self.rows(name) if r.get("kind") == "join"), None)

    def close(self, name: str, otherwise: str, code: int | None = None) -> None:
        """The current process of `name` is over: "served" or "refused" as its rows say, else `otherwise`;
        "crashed" if it served and exited by itself with `code` other than 0 (None: it runs on, or the
        launcher killed it)."""
        rows = self.rows(name)
        served = any(r.get("kind") == "join" for r in rows)
        if served and code not in (None, 0):
            self.outcomes[name].append("crashed")
            self.crashes.append((name, code))
        else:
            self.outcomes[name].append("served" if served else "refused" if any(r["type"] == "refused" for r in rows) else otherwise)
        del self.offset[name]

    def follow(self, workers: ProcessLauncher, placed: dict[str, int], run_over: bool) -> None:
        """Note joiners that serve now (`placed`) and close those whose process exited ("late" once the data
        nodes are done: their daemons closing ended it; else "failed")."""
        for name in list(self.offset):
            if name not in placed and workers.procs[name].poll() is None:
                joined = self._join(name)
                if joined is not None:
                    placed[name] = int(joined["stage"])
                    self.serves_from[name] = int(joined.get("since", 0))
            code = workers.procs[name].poll()
            if code is not None:
                placed.pop(name, None)
                self.close(name, "late" if run_over else "failed", code)

    def end_run(self, workers: ProcessLauncher) -> None:
        """The run is over and its processes have exited: close the joins still open ("late" if not served)."""
        for name in list(self.offset):
            self.close(name, "late", None if name in workers.stopped else workers.procs[name].returncode)


def _churn(churn: PipelineChurn, workers: ProcessLauncher, joins: Joins, placed: dict[str, int], banned: frozenset[str],
           opened: list[tuple[int, float, float]], addrs: list[str], now: float) -> None:
    """Apply the churn decisions for the iterations opened so far (the first data node's `opened` rows, its
    clock: monotonic, as ours): at each opening, first the leaves due by then or drawn in an earlier iteration
    (a leave falls within its iteration), then the relays that come back
    (started again under their own index, with --join, once the old process is gone); then the leaves due by
    `now`, the time the rows were read (a later time could pass an opening not read yet). `banned`: the relays
    (by name) in the first data node's banned set, as its rows say."""
    for it, at, duration in opened[churn.opened + 1:]:
        _leaves(churn, at, workers, joins, placed, banned, opening=it)
        for event in churn.open(it, at, duration):
            print(f"phalanx: churn: relay {event.name} returns in iteration {event.it}", file=sys.stderr)
            joins.started(event.name)
            try:
                workers.start(event.name, "--index", event.name, "--join", "--initial-peers", *addrs)
            except NotGone as exc:  # an old process of it will not die: this join fails, the run goes on
                print(f"phalanx: churn: relay {event.name} cannot return: {exc}", file=sys.stderr)
                joins.close(event.name, "failed")
    _leaves(churn, now, workers, joins, placed, banned)


def _leaves(churn: PipelineChurn, now: float, workers: ProcessLauncher, joins: Joins, placed: dict[str, int],
            banned: frozenset[str], opening: int | None = None) -> None:
    """Take the leaves due by `now` (and, as iteration `opening` opens, those drawn before it; the stage rule may
    keep some), killing their processes."""
    if not churn.due(now, opening):
        return
    # A relay keeps its stage alive only from the iteration it serves: over hivemind at 20 % churn, stage 2's last
    # serving relay was taken while a joiner there had the weights but served only from the next iteration, and
    # that iteration finished nothing.
    serving = {n: stage for n, stage in placed.items()
               if workers.procs[n].poll() is None and joins.serves_from.get(n, 0) <= churn.opened}
    for event in churn.leave(now, serving, banned, opening):
        print(f"phalanx: churn: relay {event.name} leaves in iteration {event.it}", file=sys.stderr)
        workers.kill(event.name)
        placed.pop(event.name, None)
        if event.name in joins.offset:
            joins.close(event.name, "left")


def _rows(path: Path, offset: int = 0) -> list[dict]:
    """The rows of a records file from byte `offset` on; a line cut by a kill (or still being written) is skipped."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def join_pipeline(config: PipelineRunConfig, args: argparse.Namespace) -> dict:
    """`phalanx peer` of a pipeline preset: one new relay joins the pipeline at --initial-peers (GWTF V-B: the
    leader places it at the bottleneck stage, it downloads that stage's weights) and serves until the data
    nodes finish. `--index` picks a reproducible identity (>= peers: not one of the launched nodes)."""
    if args.index is not None and args.index < config.peers:
        raise ConfigError(f"--index {args.index} names a launched node; a joining relay takes an index >= {config.peers}")
    if not args.initial_peers:
        raise ConfigError("--initial-peers is required: the address of a node of the running pipeline")
    index = args.index if args.index is not None else config.peers + secrets.randbelow(1 << 30)
    out = Path(args.out) if args.out else Path("runs") / f"{config.preset}-peer-{index}"
    wall_start = time.perf_counter()
    inherited = os.environ.get(MARKER_ENV)
    guard_worker(f"{inherited}/peer-{os.getpid()}" if inherited else new_marker(), die_with_parent=False)
    records = out / "peers" / f"{index}.jsonl"
    address_file = Path(args.address_file) if args.address_file else None
    asyncio.run(run_pipeline_worker(config, index, args.initial_peers, records, address_file, join=True, host=args.host))
    events = [json.loads(line) for line in records.read_text().splitlines()]
    joined = next((e for e in events if e.get("kind") == "join"), {})
    summary = {"preset": config.preset, "mode": "peer", "peer_id": peer_identity(config.seed, index).peer_id,
               "stage": joined.get("stage"), "from_iteration": joined.get("it"), "events": len(events),
               "wall_seconds": time.perf_counter() - wall_start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _progress(path: Path) -> tuple[int, list[tuple[int, float, float]], list[str]]:
    """From the first data node's records: the iterations it finished, (iteration, when, the last
    iteration's duration) of each iteration opened, in order, and its banned set (peer ids) as last written."""
    done, opened, banned = 0, [], []
    try:
        with open(path) as f:
            for line in f:
                if '"type": "iteration"' in line:
                    done += 1
                elif line.endswith("\n") and ('"type": "opened"' in line or '"type": "banned"' in line):
                    row = json.loads(line)
                    if row["type"] == "opened":
                        opened.append((row["it"], row["t"], row["duration"]))
                    else:
                        banned = row["peers"]
    except FileNotFoundError:
        pass
    return done, opened, banned


def _to_relative_time(recorder: PipelineRecorder) -> None:
    """Shift the (system-wide monotonic) loop times so the run starts at 0, like simulated time. Only the
    iteration records and the timed spans (events with `t0`, `t1`) move; other events keep the clock they carry."""
    spans = [e for e in recorder.events if "t0" in e]
    starts = [r["t_start"] for r in recorder.iterations] + [e["t0"] for e in spans]
    if not starts:
        return
    origin = min(starts)
    for r in recorder.iterations:
        for key in ("t_start", "t_train", "t_end"):
            r[key] -= origin
        for mb in r["microbatches"]:
            for key in ("t_start", "t_loss", "t_end"):
                if mb[key] is not None:
                    mb[key] -= origin
    for e in spans:
        e["t0"] -= origin
        e["t1"] -= origin


def _say_where_stuck(signum, frame) -> None:
    """SIGTERM (the launcher gave up waiting, or died): print what this worker was waiting on, then die of it."""
    import traceback
    lines = ["phalanx: worker stopped (SIGTERM) while in:"]
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no running loop
        tasks = set()
    for task in tasks:
        for f in task.get_stack(limit=8):
            lines.append(f"  {task.get_name()}: {f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}")
    lines += [line.rstrip() for line in traceback.format_stack(frame, limit=6)]
    print("\n".join(lines), file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main() -> None:
    parser = worker_parser("one phalanx pipeline worker (started by `phalanx launch`)")
    parser.add_argument("--join", action="store_true",
                        help="join a running pipeline as a fresh relay process (its records are appended to)")
    parser.add_argument("--verifier", type=int, help="run the SENTINEL boundary verifier of this link instead")
    args = parser.parse_args()
    guard_worker(os.environ.get(MARKER_ENV) or new_marker(), die_with_parent=args.die_with_parent)
    config = PipelineRunConfig.from_dict(json.loads(Path(args.config).read_text()))
    signal.signal(signal.SIGTERM, _say_where_stuck)
    peers_file = Path(args.initial_peers_file) if args.initial_peers_file else None
    if args.verifier is not None:
        asyncio.run(run_verifier_worker(config, args.verifier, args.initial_peers, Path(args.out) / f"v{args.verifier}.jsonl",
                                        peers_file, args.host))
        exit_done()
    address_file = Path(args.address_file) if args.address_file else None
    asyncio.run(run_pipeline_worker(config, args.index, args.initial_peers, Path(args.out) / f"{args.index}.jsonl",
                                    address_file, args.join, args.host, peers_file, append=args.join))
    exit_done()


if __name__ == "__main__":
    _worker_main()
