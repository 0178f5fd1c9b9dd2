"""What one data-parallel peer writes to a checkpoint, and how it takes it back.

The replica's state is catch-up's canonical snapshot (`state.state_bytes`:
model, optimizer state, step, ban ledger), so a checkpoint and a catch-up
download are the same bytes and are loaded by the same checked code. A
checkpoint adds what is this peer's own and what a continued run depends on:
the all-reduce's step (which messages it accepts), its named random streams
(the MPRNG/BTARD entropy stream of a deterministic run), its attack's memory,
the process's global random generators, and, in a BTARD run, the bans that
its last settled verification has not reported yet and the signed joins for
the next step that it already holds (and, with admission of joiners, the
admission state: launched BTARD runs have it). A BTARD peer resolves
its background verifications before the cut (`run_peer`), so a checkpoint
never holds a verification in flight.

`capture` returns plain values and tensors; `to_bytes` / `from_bytes` turn
them into a `torch.save` file that loads with `weights_only=True` (no pickled
code). Where files go and when they are written is the business of the runs
(`phalanx.runs.dp.checkpoints`); runs call a `PeerCheckpoints` hook.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Protocol

import torch

from ...core.errors import ConfigError, LocalError, RemoteError
from ...core.serialization import digest
from ..rounds.btard import SecureRound
from .peer import DataParallelPeer
from .state import load_state, state_bytes

FORMAT = 1


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # write a checkpoint at the start of every k-th step (and after the last one when it is a multiple); 0: never
    keep: int = 2  # complete checkpoints kept in DIR/checkpoints (older ones are deleted)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0: no checkpoints)")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep={self.keep} must be >= 1")

    def due(self, step: int) -> bool:
        """Whether a checkpoint is taken when the peers stand at `step` (before training it)."""
        return self.every > 0 and step > 0 and step % self.every == 0


class PeerCheckpoints(Protocol):
    """The hook a peer's run loop calls: `attach` once before training, `at_step` before each step and at the end."""

    def attach(self, peer: DataParallelPeer, streams: dict[str, random.Random]) -> None: ...

    async def at_step(self, step: int) -> None: ...


def capture(peer: DataParallelPeer, step: int, streams: dict[str, random.Random]) -> dict:
    """Everything `peer`, standing at `step`, needs to go on exactly as if it had never stopped."""
    state = state_bytes(peer, step)
    return {
        "format": FORMAT,
        "step": step,
        "peer": peer.transport.peer_id,
        "state": state,
        "digest": digest(state).hex(),
        "allreduce_step": peer.allreduce._step,
        "streams": {name: stream.getstate() for name, stream in streams.items()},
        "attack": peer.attack.state() if peer.attack is not None else {},
        "rng": global_rng_state(),
        "btard": peer.allreduce.checkpoint_state(step) if _secure(peer) else {},
    }


def restore(peer: DataParallelPeer, saved: dict, streams: dict[str, random.Random], source: str) -> int:
    """Load `saved` (from `capture`) into `peer` in place; return its step. LocalError naming `source` if it does not fit."""
    if saved.get("format") != FORMAT or not isinstance(saved.get("state"), bytes):
        raise LocalError(f"{source} is not a phalanx peer checkpoint of format {FORMAT}")
    try:
        step = load_state(peer, saved["state"], "checkpoint")
    except RemoteError as exc:
        raise LocalError(f"{source} does not fit this run: {exc.evidence.detail}") from None
    missing = sorted(set(streams) - set(saved["streams"]))
    if missing:
        raise LocalError(f"{source} has no state for the random stream(s) {', '.join(missing)}")
    for name, stream in streams.items():
        stream.setstate(as_tuples(saved["streams"][name]))
    peer.allreduce._step = saved["allreduce_step"]
    if peer.attack is not None:
        peer.attack.load_state(saved["attack"])
    if _secure(peer):
        peer.allreduce.load_checkpoint_state(step, saved["btard"])
    set_global_rng_state(saved["rng"])
    return step


def _secure(peer: DataParallelPeer) -> bool:
    return isinstance(peer.allreduce, SecureRound)


def global_rng_state() -> dict:
    """The process-wide generators: torch's default CPU generator and Python's `random`."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_global_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(as_tuples(state["python"]))


def to_bytes(saved: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, source: str) -> dict:
    """A saved dict back from `to_bytes` (tensors and plain values only); LocalError naming `source` if unreadable."""
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # torch raises many kinds (pickle, zip, runtime) on a broken file
        raise LocalError(f"{source} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(saved, dict):
        raise LocalError(f"{source} does not hold a checkpoint mapping")
    return saved


def as_tuples(value: object) -> object:
    """`random.Random.getstate()` is nested tuples; a saved copy may come back with lists."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
