"""`phalanx launch` and `phalanx peer`: real peers as OS processes over hivemind.

`launch` starts N worker processes on loopback (the first one's address seeds
the others), shows progress, and merges their per-peer records into the same
files `simulate` writes. `peer` runs one worker that joins a swarm elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig
from ..core.errors import ConfigError, LocalError
from ..core.identity import Identity
from .swarm import Recorder, build_peer, peer_identity, run_peer

JOIN_TIMEOUT = 120.0  # seconds for all peers to appear in the membership view
BARRIER_TIMEOUT = 120.0
BARRIER_STEP = 1 << 40


def run_id_of(config: RunConfig) -> str:
    return f"{config.preset}-seed{config.seed}"


async def _barrier(transport, name: str, peers: list[str]) -> None:
    """Wait until every peer has announced `name` (or the timeout passes).

    The slot's step is beyond any training step, so pruning old broadcasts never
    drops the announcement of a peer that left early (a banned peer stops at once).
    """
    await transport.broadcast(f"barrier.{name}", BARRIER_STEP, b"")
    await transport.board.wait(f"barrier.{name}", BARRIER_STEP, peers, BARRIER_TIMEOUT)


async def run_worker(
    config: RunConfig,
    index: int | None,
    initial_peers: list[str],
    records_path: Path,
    host: str = "/ip4/127.0.0.1/tcp/0",
    address_file: Path | None = None,
) -> list[dict]:
    """One real peer: join, wait for the swarm, train, leave together."""
    from ..transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    identity = peer_identity(config.seed, index) if index is not None else Identity.generate()
    transport = HivemindTransport(identity, run_id=run_id_of(config), initial_peers=initial_peers, host_maddrs=[host])
    await transport.start()
    records: list[dict] = []
    try:
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(transport.visible_maddrs()) + "\n")
            tmp.rename(address_file)
        try:
            peers = await transport.wait_for_members(config.peers, JOIN_TIMEOUT)
        except TimeoutError:
            raise LocalError(
                f"only {len(transport.members())} of {config.peers} peers joined within {JOIN_TIMEOUT:.0f} s: check"
                " --initial-peers, and that every peer runs the same preset, seed and --peers"
            ) from None
        await _barrier(transport, "start", peers)
        records_path.parent.mkdir(parents=True, exist_ok=True)
        with open(records_path, "w") as sink:

            def on_step(record: dict) -> None:
                records.append(record)
                sink.write(json.dumps(record, sort_keys=True) + "\n")
                sink.flush()

            role = -1 if index is None else index
            await run_peer(config, build_peer(config, transport, role), role, False, on_step)
        # Stay until everyone is done: a slower peer may still pull our parts.
        await _barrier(transport, "done", peers)
    finally:
        await transport.stop()
    return records


def launch(config: RunConfig, out: Path, progress: bool = True) -> dict:
    """Run `config` as config.peers OS processes on loopback; write the run's files to `out`."""
    if not isinstance(config, RunConfig):
        from .aspis_launch import launch_aspis

        return launch_aspis(config, out, progress)
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()
    config_path = out / "config.json"
    config_path.write_text(config.to_json() + "\n")
    peer_dir = out / "peers"
    peer_dir.mkdir(exist_ok=True)
    for old in peer_dir.glob("*"):
        old.unlink()
    address_file = peer_dir / "0.addr"
    base = [sys.executable, "-m", "phalanx.experiments.launch", "--config", str(config_path), "--out", str(peer_dir)]
    procs = [subprocess.Popen([*base, "--index", "0", "--address-file", str(address_file)])]
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not address_file.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise LocalError(f"the first peer did not start (exit code {procs[0].poll()}); see its output above")
            time.sleep(0.1)
        addrs = address_file.read_text().split()
        for index in range(1, config.peers):
            procs.append(subprocess.Popen([*base, "--index", str(index), "--initial-peers", *addrs]))
        bar = tqdm(total=config.steps, desc=f"launch {config.preset}", disable=not progress, leave=False)
        while any(p.poll() is None for p in procs) and not any(p.poll() not in (None, 0) for p in procs):
            bar.update(_lines(peer_dir / "0.jsonl") - bar.n)
            time.sleep(0.5)
        bar.close()
    finally:
        _stop(procs)
    failed = [i for i, p in enumerate(procs) if p.wait() != 0]
    if failed:
        raise LocalError(f"peers {failed} exited with errors; see their output above")
    ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
    recorder = Recorder(config, ids)
    for index in range(config.peers):
        for line in (peer_dir / f"{index}.jsonl").read_text().splitlines():
            recorder.add(json.loads(line))
    _to_relative_time(recorder.records)
    return recorder.write(out, {"mode": "launch", "wall_seconds": time.perf_counter() - wall_start})


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ask workers that are still running to stop, then kill those that do not."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def _to_relative_time(records: list[dict]) -> None:
    """Shift wall-clock timestamps so the run starts at 0, like simulated time."""
    if records:
        origin = min(r["t_start"] for r in records)
        for r in records:
            for key in ("t_start", "t_computed", "t_end"):
                r[key] -= origin


def _lines(path: Path) -> int:
    try:
        return sum(1 for _ in open(path))
    except FileNotFoundError:
        return 0


def run_single_peer(config: RunConfig, args: argparse.Namespace) -> dict:
    """`phalanx peer`: one peer joining a swarm through --initial-peers."""
    if not isinstance(config, RunConfig):
        raise ConfigError(f"'phalanx peer' runs data-parallel presets only; run {config.preset!r} with 'phalanx launch'")
    if args.index is not None and not 0 <= args.index < config.peers:
        raise ConfigError(f"--index {args.index} must be in [0, {config.peers}) for a swarm of --peers {config.peers}")
    out = Path(args.out) if args.out else Path("runs") / f"{config.preset}-peer-seed{config.seed}"
    wall_start = time.perf_counter()
    name = str(args.index) if args.index is not None else "peer"
    address_file = Path(args.address_file) if args.address_file else None
    records = asyncio.run(run_worker(config, args.index, args.initial_peers, out / "peers" / f"{name}.jsonl", args.host, address_file))
    recorder = Recorder(config, sorted({r["peer"] for r in records}))
    for record in records:
        recorder.add(record)
    _to_relative_time(recorder.records)
    return recorder.write(out, {"mode": "peer", "wall_seconds": time.perf_counter() - wall_start})


def _worker_main() -> None:
    parser = argparse.ArgumentParser(description="one phalanx worker process (started by `phalanx launch`)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--address-file")
    args = parser.parse_args()
    config = RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    address_file = Path(args.address_file) if args.address_file else None
    asyncio.run(run_worker(config, args.index, args.initial_peers, Path(args.out) / f"{args.index}.jsonl", address_file=address_file))


if __name__ == "__main__":
    _worker_main()
