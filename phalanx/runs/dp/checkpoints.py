"""Checkpoint directories of a data-parallel run, and `--resume`.

Layout: `DIR/checkpoints/step-000040/` holds one `peer-I.pt` per peer (see
`phalanx.runtime.dp.checkpoint`), `run.pt` for a simulated run (virtual clock,
message-loss stream, the records the run files are made of, network
counters), and `MANIFEST.json`, written last, listing every file with its size
and sha256. A checkpoint is complete only when its manifest is there and every
file matches it; anything else (a crash mid-write, a torn temp file) is
ignored and the previous complete checkpoint is used. Every file is written
to a temp file in the same directory, fsynced, then renamed over its name.

Simulated runs take a checkpoint at a quiet cut: at a due step every peer
stops before training it, the simulation runs until no peer task is pending
and the last message sent has arrived, then the checkpoint is written and all
peers go on at that same virtual time. A resumed run starts its clock there,
so it is the uninterrupted run (with the same `checkpoint.every`), bit for bit.
Over hivemind each worker writes its own file when it reaches a due step and
the launcher seals a step once every worker has written it or exited.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import ConfigError, LocalError
from ...runtime.dp.checkpoint import (
    as_tuples,
    capture,
    from_bytes,
    global_rng_state,
    restore,
    set_global_rng_state,
    to_bytes,
)
from ...runtime.dp.peer import DataParallelPeer
from ...transport.sim import SimNetwork
from ..config import override
from .config import FaultsConfig, RunConfig

MANIFEST = "MANIFEST.json"
FORMAT = 1
RESUMABLE = ("steps", "checkpoint.every", "checkpoint.keep")  # what --resume may change
_STEP_DIR = re.compile(r"step-(\d{6,})")


# --- files --------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its directory, step, run mode, the run's config and its peers' files."""

    dir: Path
    step: int
    mode: str
    config: dict
    peers: dict[int, dict]  # index -> {"file", "peer_id", "digest"}

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def peer_state(self, index: int) -> tuple[dict, str]:
        """The saved state of peer `index` (or, if it wrote none, of the lowest-indexed peer that did) and its file."""
        entry = self.peers.get(index) or self.peers[min(self.peers)]
        source = str(self.dir / entry["file"])
        return from_bytes(self.read(entry["file"]), source), source


def read_checkpoint(step_dir: Path) -> Checkpoint | None:
    """The checkpoint in `step_dir` if it is complete (manifest present, every file of the size and hash it names)."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            return None
        for name, entry in manifest["files"].items():
            path = step_dir / name
            if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
                return None
        peers = {int(i): entry for i, entry in manifest["peers"].items()}
        if not peers or not all(entry["file"] in manifest["files"] for entry in peers.values()):
            return None
        return Checkpoint(step_dir, int(manifest["step"]), manifest["mode"], manifest["config"], peers)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class CheckpointStore:
    """`DIR/checkpoints`: write a step's files, seal it with its manifest, find the latest complete one, prune."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = root
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def steps(self) -> list[int]:
        """Steps that have a directory (complete or not), ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)))

    def write(self, step: int, name: str, data: bytes) -> None:
        path = self.step_dir(step)
        path.mkdir(parents=True, exist_ok=True)
        write_atomic(path / name, data)

    def sealed(self, step: int) -> bool:
        return (self.step_dir(step) / MANIFEST).exists()

    def seal(self, step: int, mode: str, config: RunConfig, peers: dict[int, dict]) -> None:
        """Write the manifest of `step` (last: it makes the checkpoint complete), then drop old checkpoints."""
        path = self.step_dir(step)
        files = {name: {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)} for name in _files(path)}
        manifest = {
            "format": FORMAT,
            "step": step,
            "mode": mode,
            "config": config.to_dict(),
            "files": files,
            "peers": {str(i): peers[i] for i in sorted(peers)},
        }
        write_atomic(path / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        self.prune()

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint (older ones are tried when a newer one is partial or corrupt)."""
        for step in reversed(self.steps()):
            found = read_checkpoint(self.step_dir(step))
            if found is not None:
                return found
        return None

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop older ones and partial ones older than the newest kept."""
        complete = [s for s in self.steps() if read_checkpoint(self.step_dir(s)) is not None]
        kept = complete[-self.keep :]
        for step in self.steps():
            if step not in kept and (not kept or step < kept[-1]):
                shutil.rmtree(self.step_dir(step), ignore_errors=True)


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(".pt") and not p.name.startswith("."))


# --- resume -------------------------------------------------------------------


def resume_config(run_dir: Path, preset: str, assignments: list[str], mode: str) -> tuple[RunConfig, Checkpoint]:
    """The config to continue the run in `run_dir` with, and its latest complete checkpoint.

    The run keeps its saved config; `assignments` may change only the keys in
    RESUMABLE (e.g. more `steps`): anything else would make it another run.
    """
    store = CheckpointStore(run_dir / "checkpoints")
    checkpoint = store.latest()
    if checkpoint is None:
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint in {store.root}; run with --checkpoint-every K first")
    if checkpoint.mode != mode:
        raise ConfigError(f"--resume {run_dir}: its checkpoints are of a '{checkpoint.mode}' run; resume it with 'phalanx {checkpoint.mode}'")
    saved = RunConfig.from_dict(checkpoint.config)
    if preset != saved.preset:
        raise ConfigError(f"--resume {run_dir}: the run is of preset {saved.preset!r}, not {preset!r}")
    config = override(saved, assignments)
    before, after = _flat(saved.to_dict()), _flat(config.to_dict())
    for key in sorted(set(before) | set(after)):
        if key not in RESUMABLE and before.get(key) != after.get(key):
            raise ConfigError(
                f"--resume {run_dir}: {key}={after.get(key)!r} differs from the run's {key}={before.get(key)!r};"
                f" a resumed run keeps its config (only {', '.join(RESUMABLE)} may change)"
            )
    if config.steps <= checkpoint.step:
        raise ConfigError(f"--resume {run_dir}: steps={config.steps} must be > {checkpoint.step}, the step of its latest checkpoint")
    return config, checkpoint


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "params":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def rewind_run_dir(out: Path, step: int) -> None:
    """Make the run files of `out` end before `step` (the checkpoint's) and drop later checkpoint directories:
    what came after it is redone by the resumed run."""
    for path in [out / "metrics.jsonl", out / "timeline.jsonl", out / "bans.jsonl", *sorted((out / "peers").glob("*.jsonl"))]:
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True) if _before(line, step)]
            write_atomic(path, "".join(kept).encode())
    (out / "summary.json").unlink(missing_ok=True)  # the run is not finished: its summary is written again at the end
    store = CheckpointStore(out / "checkpoints")
    for later in store.steps():
        if later > step:  # partial or corrupt: the resumed run writes these steps afresh
            shutil.rmtree(store.step_dir(later))


def _before(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] < step
    except (ValueError, KeyError, TypeError):
        return False  # a line cut by a kill


# --- simulated runs -----------------------------------------------------------


class SimCheckpoints:
    """Checkpoints of a simulated run (and its resumption) at quiet cuts of the simulation.

    `begin(network)` before any peer starts; `for_peer(index)` is each peer's
    hook; `network_stats(stats)` adds the counters of the part before a resume.
    """

    def __init__(self, config: RunConfig, out: Path, records: list[dict], resume: Checkpoint | None = None) -> None:
        if config.faults != FaultsConfig():
            raise ConfigError(
                "checkpoint.every and --resume need a simulated run without injected faults (faults.*): "
                "crashes and churn are not part of a simulated checkpoint"
            )
        self.config = config
        self.store = CheckpointStore(out / "checkpoints", config.checkpoint.keep)
        self.records = records
        self.resume = resume
        self.start = resume.step if resume is not None else 0
        self._network: SimNetwork | None = None
        self._mains: dict[int, asyncio.Task] = {}
        self._peers: dict[int, tuple[DataParallelPeer, dict[str, random.Random]]] = {}
        self._waiting: dict[int, tuple[int, asyncio.Future]] = {}
        self._draining = False
        self._stats: dict = {}
        if resume is not None:
            rewind_run_dir(out, resume.step)

    async def begin(self, network: SimNetwork) -> None:
        """Before the peers start: on a resume, move the clock, loss stream, RNGs and records to the checkpoint."""
        self._network = network
        if self.resume is None:
            return
        run = from_bytes(self.resume.read("run.pt"), str(self.resume.dir / "run.pt"))
        await _until(run["time"])
        network.set_loss_state(as_tuples(run["loss"]))
        set_global_rng_state(run["rng"])
        self.records[:0] = run["records"]
        self._stats = run["network"]

    def for_peer(self, index: int) -> _SimPeer:
        return _SimPeer(self, index)

    def network_stats(self, stats: dict) -> dict:
        return _add_counts(self._stats, stats)

    def _attach(self, index: int, peer: DataParallelPeer, streams: dict[str, random.Random]) -> None:
        task = asyncio.current_task()
        self._mains[index] = task
        self._peers[index] = (peer, streams)
        task.add_done_callback(lambda _: self._check())
        if self.resume is not None:
            saved, source = self.resume.peer_state(index)
            restore(peer, saved, streams, source)

    async def _arrive(self, index: int, step: int) -> None:
        arrived = asyncio.get_running_loop().create_future()
        self._waiting[index] = (step, arrived)
        self._check()
        await arrived

    def _check(self) -> None:
        """Once every running peer waits at the cut, drain the network and write the checkpoint."""
        if self._draining or not self._waiting:
            return
        running = [i for i, task in self._mains.items() if not task.done()]
        if all(i in self._waiting for i in running):
            self._draining = True
            loop = asyncio.get_running_loop()
            loop.create_task(self._drain(), name="checkpoint", context=contextvars.Context())  # owned by no peer

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        waiting = {self._mains[i] for i in self._waiting}
        while True:
            busy = [task for task in self._network.pending_tasks() if task not in waiting]
            if busy:
                await asyncio.wait(busy)
                continue
            quiet = self._network.drained_at()
            if quiet <= loop.time():
                break
            await _until(quiet)
        steps = {step for step, _ in self._waiting.values()}
        if len(steps) != 1:
            raise LocalError(f"peers stopped for a checkpoint at different steps {sorted(steps)}")
        self._write(steps.pop(), loop.time())
        waiting, self._waiting = self._waiting, {}
        self._draining = False
        for index in sorted(waiting):
            waiting[index][1].set_result(None)

    def _write(self, step: int, now: float) -> None:
        peers = {}
        for index in sorted(self._waiting):
            peer, streams = self._peers[index]
            saved = capture(peer, step, streams)
            self.store.write(step, f"peer-{index}.pt", to_bytes(saved))
            peers[index] = {"file": f"peer-{index}.pt", "peer_id": saved["peer"], "digest": saved["digest"]}
        run = {
            "format": FORMAT,
            "time": now,
            "loss": self._network.loss_state(),
            "rng": global_rng_state(),
            "records": [dict(r) for r in self.records],
            "network": self.network_stats(self._network.stats()),
        }
        self.store.write(step, "run.pt", to_bytes(run))
        self.store.seal(step, "simulate", self.config, peers)


async def _until(at: float) -> None:
    """Sleep until virtual time `at` exactly (the virtual clock jumps there at no cost)."""
    loop = asyncio.get_running_loop()
    if at > loop.time():
        arrived = loop.create_future()
        loop.call_at(at, arrived.set_result, None)
        await arrived


class _SimPeer:
    """One simulated peer's hook: restore on a resume, stop at each due step until the cut is written."""

    def __init__(self, owner: SimCheckpoints, index: int) -> None:
        self.owner = owner
        self.index = index

    def attach(self, peer: DataParallelPeer, streams: dict[str, random.Random]) -> None:
        self.owner._attach(self.index, peer, streams)

    async def at_step(self, step: int) -> None:
        if step != self.owner.start and self.owner.config.checkpoint.due(step):
            await self.owner._arrive(self.index, step)


def _add_counts(before: dict, after: dict) -> dict:
    """Network counters of a run in two parts: numbers added, anything else taken from the later part."""
    out = dict(after)
    for key, value in before.items():
        if key not in after:
            out[key] = value
        elif isinstance(value, dict) and isinstance(after[key], dict):
            out[key] = _add_counts(value, after[key])
        elif type(value) is int and type(after[key]) is int:
            out[key] = value + after[key]
    return out


# --- runs over hivemind -------------------------------------------------------


class WorkerCheckpoints:
    """One launched worker's hook: write its own file at each due step; on a resume, load it first."""

    def __init__(self, config: RunConfig, root: Path, index: int, resume: Path | None = None) -> None:
        self.config = config
        self.store = CheckpointStore(root, config.checkpoint.keep)
        self.index = index
        self.resume = read_checkpoint(resume) if resume is not None else None
        if resume is not None and self.resume is None:
            raise LocalError(f"{resume} is not a complete checkpoint")
        self.start = self.resume.step if self.resume is not None else 0
        self._peer: DataParallelPeer | None = None
        self._streams: dict[str, random.Random] = {}

    @property
    def resuming(self) -> bool:
        return self.resume is not None

    def attach(self, peer: DataParallelPeer, streams: dict[str, random.Random]) -> None:
        self._peer, self._streams = peer, streams
        if self.resume is not None:
            saved, source = self.resume.peer_state(self.index)
            restore(peer, saved, streams, source)

    async def at_step(self, step: int) -> None:
        if step != self.start and self.config.checkpoint.due(step):
            self.store.write(step, f"peer-{self.index}.pt", to_bytes(capture(self._peer, step, self._streams)))


def worker_args(config: RunConfig, out: Path, resume: Checkpoint | None) -> list[str]:
    """The launcher's extra arguments for each worker."""
    args = ["--checkpoint-dir", str(out / "checkpoints")] if config.checkpoint.every else []
    return args + (["--resume-from", str(resume.dir)] if resume is not None else [])


class LaunchSealer:
    """The launcher's side: seal a step once every worker has written its file there or has exited."""

    def __init__(self, config: RunConfig, out: Path) -> None:
        self.config = config
        self.store = CheckpointStore(out / "checkpoints", config.checkpoint.keep)

    def poll(self, running: set[int]) -> None:
        for step in self.store.steps():
            if self.store.sealed(step):
                continue
            path = self.store.step_dir(step)
            written = {i for i in range(self.config.peers) if (path / f"peer-{i}.pt").exists()}
            if written and all(i in written or i not in running for i in range(self.config.peers)):
                peers = {}
                for i in sorted(written):
                    saved = from_bytes((path / f"peer-{i}.pt").read_bytes(), str(path / f"peer-{i}.pt"))
                    peers[i] = {"file": f"peer-{i}.pt", "peer_id": saved["peer"], "digest": saved["digest"]}
                self.store.seal(step, "launch", self.config, peers)
