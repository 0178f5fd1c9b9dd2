"""`phalanx launch` for Aspis runs: 1 coordinator + K workers as OS processes over hivemind.

Process 0 is the coordinator; its address seeds the others (all start at
once and the others read it from its address file). Workers are
started by the common `ProcessLauncher` (`launcher.py`): each has its own
marker, parent-death signal and watchdog, and nothing of it (the hivemind DHT
child, the p2pd daemon) outlives the run. With `--netns` process i runs on host i.
The coordinator writes one record per iteration; the launcher turns them into
the same files `simulate` writes for an Aspis run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...core.errors import LocalError
from ..dp.launch import JOIN_TIMEOUT, prepare_run_dir, run_id_of
from ..dp.swarm import peer_identity
from ..launcher import (
    BARRIER_TIMEOUT,
    ProcessLauncher,
    exit_done,
    exit_text,
    first_address,
    stop_on_sigterm,
    worker_parser,
)
from ..netns import NetnsConfig
from ..processes import MARKER_ENV, guard_worker, new_marker
from ..records import count_lines
from .config import AspisRunConfig
from .run import build_role, count_distortion, summarize, write_run

EXIT_GRACE = 30.0  # seconds the workers get to leave after the coordinator is done


async def run_process(config: AspisRunConfig, index: int, initial_peers: list[str], records_path: Path, address_file: Path | None,
                      initial_peers_file: Path | None = None, host: str = "/ip4/127.0.0.1/tcp/0") -> None:
    """One Aspis peer over hivemind: join, wait for all, run the role, leave.

    `initial_peers_file`: started with the coordinator, take its address from this file once it is written.
    """
    from ...transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    if initial_peers_file is not None:
        initial_peers = await first_address(initial_peers_file, JOIN_TIMEOUT)
    identity = peer_identity(config.seed, index)
    transport = HivemindTransport(identity, run_id=run_id_of(config), initial_peers=initial_peers, host_maddrs=[host])
    await transport.start()
    try:
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(transport.visible_maddrs()) + "\n")
            tmp.rename(address_file)
        try:
            await transport.wait_for_members(config.peers, JOIN_TIMEOUT)
        except TimeoutError:
            raise LocalError(f"only {len(transport.members())} of {config.peers} Aspis peers joined within {JOIN_TIMEOUT:.0f} s") from None
        ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
        role = build_role(config, transport, index, ids)
        if index == 0:
            # Workers announce that their handlers are up; then the coordinator starts.
            await transport.collect_broadcasts("aspis.ready", 0, ids[1:], BARRIER_TIMEOUT)
            with open(records_path, "w") as sink:

                def on_iteration(record: dict) -> None:
                    sink.write(json.dumps(record, sort_keys=True) + "\n")
                    sink.flush()

                await role.run(config.steps, on_iteration)
        else:
            serving = asyncio.ensure_future(role.run())
            await asyncio.sleep(0)
            await transport.broadcast("aspis.ready", 0, b"")
            await serving
    finally:
        await transport.stop()


def launch_hosts(config: AspisRunConfig) -> int:
    """The hosts of `launch --netns`: the coordinator on host 0, worker i on host i."""
    return config.peers


def launch_aspis(config: AspisRunConfig, out: Path, progress: bool = True, netns: NetnsConfig | None = None) -> dict:
    """Run `config` as config.peers processes on loopback (or, with `netns`, each in its own network namespace:
    `launch_hosts`); write the run's files to `out`."""
    wall_start = time.perf_counter()
    config_path, peer_dir, address_file = prepare_run_dir(config, out)
    records_path = peer_dir / "0.jsonl"
    base = [sys.executable, "-m", "phalanx.runs.aspis.launch", "--config", str(config_path), "--out", str(records_path)]
    workers = ProcessLauncher(base, os.environ.get(MARKER_ENV) or new_marker(), err_dir=peer_dir, netns=netns)
    with stop_on_sigterm():
        try:
            coordinator = workers.start(0, "--index", "0", "--address-file", str(address_file))
            for index in range(1, config.peers):
                workers.start(index, "--index", str(index), "--initial-peers-file", str(address_file))
            workers.address(0, address_file, JOIN_TIMEOUT, "the coordinator")
            bar = tqdm(total=config.steps, desc=f"launch {config.preset}", disable=not progress, leave=False)
            while coordinator.poll() is None and not workers.reap():
                bar.update(count_lines(records_path) - bar.n)
                time.sleep(0.5)
            bar.close()
            if coordinator.returncode == 0:
                workers.wait(list(range(1, config.peers)), EXIT_GRACE)
        finally:
            workers.stop()
    failed = [(i, p.returncode) for i, p in workers.procs.items() if p.returncode != 0]
    if failed:
        raise LocalError("; ".join(f"Aspis peer {i} {exit_text(code)}{workers.tail(i)}" for i, code in failed))
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    count_distortion(config, records)
    extra = {"mode": "launch", "wall_seconds": time.perf_counter() - wall_start,
             "process_groups": [p.pid for p in workers.procs.values()], **workers.netns_record()}
    return write_run(config, records, out, summarize(config, records, extra))


def _main() -> None:
    parser = worker_parser("one Aspis peer process (started by `phalanx launch`)", first="the coordinator")
    args = parser.parse_args()
    guard_worker(os.environ.get(MARKER_ENV) or new_marker(), die_with_parent=args.die_with_parent)
    config = AspisRunConfig.from_dict(json.loads(Path(args.config).read_text()))
    address_file = Path(args.address_file) if args.address_file else None
    peers_file = Path(args.initial_peers_file) if args.initial_peers_file else None
    asyncio.run(run_process(config, args.index, args.initial_peers, Path(args.out), address_file, peers_file, args.host))
    exit_done()


if __name__ == "__main__":
    _main()
