"""`phalanx launch` and `phalanx peer`: real peers as OS processes over hivemind.

`launch` starts N worker processes on loopback at once (the first one's
address, read from its file, seeds the others), shows progress, and merges
their per-peer records into the same files `simulate` writes. `peer` runs one worker that joins a swarm elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...core.errors import ConfigError, LocalError
from ...core.identity import Identity
from ...runtime.dp.admission import admission_for
from ...runtime.dp.catchup import CatchupFailed, CatchupService, collect_offers
from ...runtime.dp.peer import task_of
from ..launcher import (
    BARRIER_STEP,
    BARRIER_TIMEOUT,
    ProcessLauncher,
    barrier,
    exit_done,
    exit_text,
    first_address,
    stop_on_sigterm,
    worker_parser,
)
from ..netns import NetnsConfig
from ..processes import MARKER_ENV, STOP_GRACE, guard_worker, kill_marked, new_marker
from ..records import count_lines
from .checkpoints import (
    Checkpoint,
    LaunchSealer,
    WorkerCheckpoints,
    rewind_run_dir,
    worker_args,
)
from .config import RunConfig
from .launch_churn import LaunchChurn
from .swarm import Recorder, build_peer, peer_identity, run_peer

JOIN_TIMEOUT = 120.0  # seconds for all peers to appear in the membership view
MEMBERSHIP_TTL = 20.0  # seconds a dead peer's membership record outlives it (its detection delay)


def run_id_of(config: RunConfig, token: str = "") -> str:
    """The run's DHT namespace; `token` (random per launch) keeps concurrent runs on one host apart."""
    return f"{config.preset}-seed{config.seed}{'-' + token if token else ''}"


async def _leave_together(transport) -> None:
    """Announce we are done; wait until every live member has too (a dead one leaves the view)."""
    await transport.broadcast("barrier.done", BARRIER_STEP, b"")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BARRIER_TIMEOUT
    while loop.time() < deadline:
        done = transport.board.get("barrier.done", BARRIER_STEP)
        if all(p in done for p in transport.members() if p != transport.peer_id):
            return
        await asyncio.sleep(0.2)


async def _swarm_is_training(transport, initial_peers: list[str], config: RunConfig) -> bool:
    """Whether peers we can see are already training this run (then we join by catch-up)."""
    if not initial_peers:
        return False
    try:
        await transport.wait_for_members(2, JOIN_TIMEOUT)
    except TimeoutError:
        return False
    others = [p for p in transport.members() if p != transport.peer_id]
    # As a joiner at once: a restarted peer is in the initial roster, and training peers must
    # leave it out of their groups before they see its record and wait for it.
    return bool(await collect_offers(transport, others, config.catchup, joining=True))


async def run_worker(
    config: RunConfig,
    index: int | None,
    initial_peers: list[str],
    records_path: Path,
    host: str = "/ip4/127.0.0.1/tcp/0",
    address_file: Path | None = None,
    *,
    checkpoints: WorkerCheckpoints | None = None,
    token: str = "",
    append: bool = False,
    initial_peers_file: Path | None = None,
) -> list[dict]:
    """One real peer: join, wait for the swarm, train, leave together (writing `checkpoints` if given).

    `append` adds to `records_path` (a worker the launcher started again) instead of replacing it.
    `initial_peers_file`: started with the first worker, take its address from this file once it is written.

    SIGTERM stops it cleanly (like Ctrl-C): the transport, its DHT child and
    p2pd are shut down before it returns.
    """
    from ...transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        task.cancel()
        _exit_after(STOP_GRACE, 128 + signal.SIGTERM)

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    task_of(config.train, config.task)  # its imports and data loading block for seconds: do them before our record is visible
    if initial_peers_file is not None:
        initial_peers = await first_address(initial_peers_file, JOIN_TIMEOUT)
    identity = peer_identity(config.seed, index) if index is not None else Identity.generate()
    transport = HivemindTransport(
        identity, run_id=run_id_of(config, token), initial_peers=initial_peers, host_maddrs=[host], membership_ttl=MEMBERSHIP_TTL
    )
    await transport.start()
    records: list[dict] = []
    try:
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(transport.visible_maddrs()) + "\n")
            tmp.rename(address_file)
        joining = await _swarm_is_training(transport, initial_peers, config)
        role = -1 if index is None else index
        peer = build_peer(config, transport, role)
        service = CatchupService(peer, config.catchup)
        # A joiner anchors to the run's initial set: the identities `phalanx launch` gives indices 0 .. peers - 1.
        initial = [peer_identity(config.seed, i).peer_id for i in range(config.peers)] if joining else None
        admission = admission_for(peer, service, config.btard, initial)
        if joining:
            try:
                await service.join(end=config.steps)  # a running swarm: catch up, then train from where it is
            except CatchupFailed as exc:
                print(f"phalanx: could not join the running swarm: {exc}", file=sys.stderr)
                return records
        else:
            try:
                peers = await transport.wait_for_members(config.peers, JOIN_TIMEOUT)
            except TimeoutError:
                raise LocalError(
                    f"only {len(transport.members())} of {config.peers} peers joined within {JOIN_TIMEOUT:.0f} s: check"
                    " --initial-peers, and that every peer runs the same preset, seed, --peers and --run-token"
                    " (a launch writes its token to OUT/run_token)"
                ) from None
            service.set_roster(peers)
            await barrier(transport, "start", peers)
        records_path.parent.mkdir(parents=True, exist_ok=True)
        append = append or (checkpoints is not None and checkpoints.resuming)
        cut = append and records_path.exists() and not records_path.read_bytes().endswith(b"\n")
        with open(records_path, "a" if append else "w") as sink:
            if cut:
                sink.write("\n")  # the killed process left its last line unfinished

            def on_step(record: dict) -> None:
                records.append(record)
                sink.write(json.dumps(record, sort_keys=True) + "\n")
                sink.flush()

            await run_peer(config, peer, role, False, on_step, service, checkpoints, admission=admission)
        # Stay until everyone is done: a slower peer may still pull our parts.
        await _leave_together(transport)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        _exit_after(3 * STOP_GRACE, 1)  # a shutdown that hangs (a stuck DHT child) must not keep us alive
        await transport.stop()
    return records


def _exit_after(seconds: float, code: int) -> None:
    """Unless this process has exited `seconds` from now: kill what it started, then exit with `code`."""

    def hard_exit() -> None:
        kill_marked(os.environ.get(MARKER_ENV, ""))
        os._exit(code)

    if os.environ.get(MARKER_ENV):
        timer = threading.Timer(seconds, hard_exit)
        timer.daemon = True
        timer.start()


def prepare_run_dir(config, out: Path, clear: bool = True) -> tuple[Path, Path, Path]:
    """Write `out`/config.json and empty `out`/peers (unless not `clear`); return (config file, peers dir, peer 0's address file)."""
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(config.to_json() + "\n")
    peer_dir = out / "peers"
    peer_dir.mkdir(exist_ok=True)
    for old in peer_dir.glob("*" if clear else "*.addr"):
        old.unlink()
    return config_path, peer_dir, peer_dir / "0.addr"


def launch_hosts(config: RunConfig) -> int:
    """The hosts of `launch --netns`: worker i on host i (a restarted worker on its own again)."""
    return config.peers


def launch(config: RunConfig, out: Path, progress: bool = True, resume: Checkpoint | None = None, netns: NetnsConfig | None = None) -> dict:
    """Run `config` as config.peers OS processes on loopback; write the run's files to `out`.

    With `netns`, each worker runs in its own network namespace (`launch_hosts`)
    of a test bed built for the run and torn down after it.

    A worker that dies (killed, out of memory, an exception) is dropped by
    the others and the run goes on; it is listed under `crashed` with the
    last step it recorded. Raises LocalError only when no worker finished.
    With `config.checkpoint.every`, checkpoints go to `out`/checkpoints; `resume` continues from one.
    """
    wall_start = time.perf_counter()
    config_path, peer_dir, address_file = prepare_run_dir(config, out, clear=resume is None)
    if resume is not None:
        rewind_run_dir(out, resume.step)
    sealer = LaunchSealer(config, out) if config.checkpoint.every else None
    extra = worker_args(config, out, resume)
    token = secrets.token_hex(4)
    (out / "run_token").write_text(token + "\n")  # `phalanx peer --run-token` joins this run (not one under --netns: closed)
    base = [sys.executable, "-m", "phalanx.runs.dp.launch", "--config", str(config_path), "--out", str(peer_dir)]
    workers = ProcessLauncher([*base, "--run-token", token], os.environ.get(MARKER_ENV) or new_marker(), netns=netns)
    with stop_on_sigterm():
        try:
            workers.start(0, "--index", "0", *extra, "--address-file", str(address_file))
            for index in range(1, config.peers):
                workers.start(index, "--index", str(index), *extra, "--initial-peers-file", str(address_file))
            addrs = workers.address(0, address_file, JOIN_TIMEOUT, "the first peer")
            bar = tqdm(total=config.steps, desc=f"launch {config.preset}", disable=not progress, leave=False)
            churn = LaunchChurn(config, resume.step if resume is not None else 0) if LaunchChurn.wanted(config) else None
            rejoin = worker_args(config, out, None)  # a churned worker catches up: checkpoint args, never --resume-from
            last_at: dict[int, int | None] = {}
            while workers.running():
                if churn is not None:
                    _churn(churn, workers, peer_dir, [*rejoin, "--initial-peers", *addrs], last_at)
                for index in workers.reap():
                    last = _last_step(peer_dir / f"{index}.jsonl")
                    print(
                        f"phalanx: peer {index} {exit_text(workers.failed[index])} after step {last}; the others go on",
                        file=sys.stderr,
                    )
                bar.update(max(count_lines(peer_dir / f"{i}.jsonl") for i in workers.procs) - bar.n)
                if sealer is not None:
                    sealer.poll(set(workers.running()))
                time.sleep(0.5)
            workers.reap()
            bar.close()
        finally:
            workers.stop()
            if sealer is not None:
                sealer.poll(set())  # every worker has exited: seal what they wrote
    ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
    recorder = Recorder(config, ids)
    for index in range(config.peers):
        path = peer_dir / f"{index}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                recorder.add(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill (a restarted worker appends after it)
    finished = any(r["step"] == config.steps - 1 for r in recorder.records)
    if not finished:
        failed = ", ".join(f"{i} {exit_text(c)}" for i, c in sorted(workers.failed.items()))
        raise LocalError(f"the run did not finish: peers {failed}; see their output above")
    _to_relative_time(recorder.records)
    recorder.crashed = [ids[i] for i in sorted(workers.failed)]
    extra = {"mode": "launch", "run_token": token, "wall_seconds": time.perf_counter() - wall_start}
    extra.update(workers.netns_record())
    if churn is not None:
        extra["churn"] = [{"step": e.step, "peer": ids[e.index], "index": e.index, "event": e.event} for e in churn.events]
    return recorder.write(out, extra)


def _churn(churn: LaunchChurn, workers: ProcessLauncher, peer_dir: Path, args: list[str], last_at: dict[int, int | None]) -> None:
    """Apply the churn decisions for the steps finished so far: kill leavers, start returners again.

    `last_at` holds, per worker started again, the last step it had recorded then (to see it train).
    """
    for index in sorted(churn.starting):
        if _last_step(peer_dir / f"{index}.jsonl") != last_at[index]:
            churn.trained(index)
        elif workers.procs[index].poll() is not None:
            workers.stopped.add(index)  # not a failure of the run: it may come back later
            workers.sweep(index)
            churn.failed_start(index)
    progress = max(-1 if (last := _last_step(peer_dir / f"{i}.jsonl")) is None else last for i in workers.procs)
    training = [i for i in workers.running() if i not in churn.starting]
    for event in churn.advance(progress, training):
        print(f"phalanx: churn: peer {event.index} {event.event} after step {event.step}", file=sys.stderr)
        if event.event == "left":
            workers.kill(event.index)
        else:
            last_at[event.index] = _last_step(peer_dir / f"{event.index}.jsonl")
            workers.start(event.index, "--index", str(event.index), *args, "--append")


def _last_step(path: Path) -> int | None:
    """The step of the last record in a peer's file (None before its first step)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue  # a line cut by the kill
    return None


def _to_relative_time(records: list[dict]) -> None:
    """Shift wall-clock timestamps so the run starts at 0, like simulated time."""
    if records:
        origin = min(r["t_start"] for r in records)
        for r in records:
            for key in ("t_start", "t_computed", "t_end"):
                r[key] -= origin


def run_single_peer(config: RunConfig, args: argparse.Namespace) -> dict:
    """`phalanx peer`: one peer joining a swarm through --initial-peers."""
    if args.index is not None and not 0 <= args.index < config.peers:
        raise ConfigError(f"--index {args.index} must be in [0, {config.peers}) for a swarm of --peers {config.peers}")
    out = Path(args.out) if args.out else Path("runs") / f"{config.preset}-peer-seed{config.seed}"
    wall_start = time.perf_counter()
    name = str(args.index) if args.index is not None else "peer"
    address_file = Path(args.address_file) if args.address_file else None
    inherited = os.environ.get(MARKER_ENV)
    guard_worker(f"{inherited}/peer-{os.getpid()}" if inherited else new_marker(), die_with_parent=False)
    records = asyncio.run(
        run_worker(config, args.index, args.initial_peers, out / "peers" / f"{name}.jsonl", args.host, address_file, token=args.run_token)
    )
    recorder = Recorder(config, sorted({r["peer"] for r in records}))
    for record in records:
        recorder.add(record)
    _to_relative_time(recorder.records)
    return recorder.write(out, {"mode": "peer", "wall_seconds": time.perf_counter() - wall_start})


def _worker_main() -> None:
    parser = worker_parser("one phalanx worker process (started by `phalanx launch`)")
    parser.add_argument("--run-token", default="")
    parser.add_argument("--append", action="store_true", help="add to this worker's records (a restarted worker)")
    parser.add_argument("--checkpoint-dir", help="write this worker's checkpoints under this directory")
    parser.add_argument("--resume-from", help="a complete checkpoint directory (step-NNNNNN) to start from")
    args = parser.parse_args()
    guard_worker(os.environ.get(MARKER_ENV) or new_marker(), die_with_parent=args.die_with_parent)
    config = RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    address_file = Path(args.address_file) if args.address_file else None
    checkpoints = None
    if args.checkpoint_dir or args.resume_from:
        root = Path(args.checkpoint_dir or Path(args.out).parent / "checkpoints")
        checkpoints = WorkerCheckpoints(config, root, args.index, Path(args.resume_from) if args.resume_from else None)
    records = Path(args.out) / f"{args.index}.jsonl"
    try:
        asyncio.run(
            run_worker(
                config, args.index, args.initial_peers, records, args.host, address_file,
                checkpoints=checkpoints, token=args.run_token, append=args.append,
                initial_peers_file=Path(args.initial_peers_file) if args.initial_peers_file else None,
            )
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit(128 + signal.SIGTERM)
    exit_done()


if __name__ == "__main__":
    _worker_main()
