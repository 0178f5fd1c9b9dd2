"""The MPRNG round over a transport: commit, wait for all, reveal, verify, XOR.

A committed peer that does not reveal, reveals a mismatch or equivocates is
banned by every honest peer (each sees the same broadcasts) and the round is
run again without it. A peer that never committed simply sits the attempt out.
Each reveal also names the set of commitments its sender saw; if honest views
differ (a late commit reached only some peers) the attempt is re-run, so
honest peers never settle on different outputs.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from ..algorithms.bans import BanLedger, BanRecord
from ..algorithms.mprng import SALT_BYTES, VALUE_BYTES, Reveal, commitment, resolve
from ..core.errors import ConfigError, Evidence, LocalError, RemoteError
from ..core.serialization import decode, encode
from ..transport.base import Transport


@dataclass(frozen=True)
class MPRNGConfig:
    timeout: float = 5.0  # seconds to wait for commitments, then again for reveals
    max_attempts: int = 5

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"mprng.timeout={self.timeout!r} must be > 0 seconds")
        if self.max_attempts < 1:
            raise ConfigError(f"mprng.max_attempts={self.max_attempts} must be >= 1")


class MPRNGBehaviour:
    """What an honest peer reveals; attackers subclass and lie."""

    def reveal(self, value: bytes, salt: bytes) -> Reveal | None:
        return Reveal(value, salt)


class WithholdReveal(MPRNGBehaviour):
    """Attack: commit, then never reveal (tries to abort rounds it dislikes)."""

    def reveal(self, value: bytes, salt: bytes) -> Reveal | None:
        return None


class WrongReveal(MPRNGBehaviour):
    """Attack: reveal a value other than the one committed to."""

    def reveal(self, value: bytes, salt: bytes) -> Reveal | None:
        return Reveal(bytes(b ^ 0xFF for b in value), salt)


@dataclass(frozen=True)
class MPRNGResult:
    value: bytes
    participants: tuple[str, ...]
    attempts: int
    banned: tuple[str, ...]


class MPRNGFailed(LocalError):
    """No attempt produced an agreed value within max_attempts."""


def _seen_digest(peers: list[str]) -> bytes:
    return hashlib.sha256("\n".join(sorted(peers)).encode()).digest()


async def run_mprng(
    transport: Transport,
    ledger: BanLedger,
    round_id: int,
    config: MPRNGConfig = MPRNGConfig(),
    entropy: Callable[[int], bytes] = secrets.token_bytes,
    behaviour: MPRNGBehaviour = MPRNGBehaviour(),
) -> MPRNGResult:
    """Run one MPRNG round among the current, unbanned members."""
    me = transport.peer_id
    newly_banned: list[str] = []
    for attempt in range(config.max_attempts):
        commit_topic, reveal_topic = f"mprng.commit.{attempt}", f"mprng.reveal.{attempt}"
        participants = ledger.filter(transport.members())
        value, salt = entropy(VALUE_BYTES), entropy(SALT_BYTES)
        await transport.broadcast(commit_topic, round_id, encode({"h": commitment(me, value, salt)}))
        envelopes = await transport.board.wait(commit_topic, round_id, participants, config.timeout)
        commits = {p: h for p, env in envelopes.items() if (h := _field(transport, env.payload, p, "h", 32)) is not None}
        seen = _seen_digest(list(commits))
        reveal = behaviour.reveal(value, salt)
        if reveal is not None:
            await transport.broadcast(reveal_topic, round_id, encode({"x": reveal.value, "s": reveal.salt, "seen": seen}))
        envelopes = await transport.board.wait(reveal_topic, round_id, list(commits), config.timeout)
        reveals, views_agree = {}, True
        for peer, env in envelopes.items():
            x = _field(transport, env.payload, peer, "x", VALUE_BYTES)
            s = _field(transport, env.payload, peer, "s", SALT_BYTES)
            if x is not None and s is not None:
                reveals[peer] = Reveal(x, s)
                views_agree &= _field(transport, env.payload, peer, "seen", 32) == seen
        outcome = resolve(commits, reveals)
        cheaters = [(m.peer, m.reason) for m in outcome.misbehaving]
        cheaters += [(p.first.sender, "equivocation") for p in transport.board.proofs if p.first.step == round_id]
        records = [BanRecord(round_id, peer, reason) for peer, reason in cheaters]
        applied = ledger.apply(records)
        for record in applied:
            newly_banned.append(record.peer)
            transport.report(Evidence(record.peer, record.reason, f"MPRNG round {round_id} attempt {attempt}", round_id))
        if outcome.value is not None and views_agree and not applied:
            return MPRNGResult(outcome.value, outcome.participants, attempt + 1, tuple(newly_banned))
    raise MPRNGFailed(f"MPRNG round {round_id} did not agree within {config.max_attempts} attempts")


def _field(transport: Transport, payload: bytes, sender: str, name: str, size: int) -> bytes | None:
    """A bytes field of exactly `size` from a peer's payload; anything else is evidence."""
    try:
        obj = decode(payload, sender, transport.limits)
        value = obj.get(name) if isinstance(obj, dict) else None
        if not isinstance(value, bytes) or len(value) != size:
            raise RemoteError(Evidence(sender, "malformed", f"MPRNG field {name!r} missing or not {size} bytes"))
    except RemoteError as exc:
        transport.report(exc.evidence)
        return None
    return value
