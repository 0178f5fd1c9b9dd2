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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ...algorithms.btard.bans import BanLedger, BanRecord
from ...algorithms.btard.mprng import (
    SALT_BYTES,
    VALUE_BYTES,
    Reveal,
    commitment,
    resolve,
)
from ...core.envelope import SignedEnvelope
from ...core.errors import ConfigError, Evidence, LocalError, RemoteError
from ...core.serialization import decode, encode
from ...transport.base import BROADCAST_TOPIC, Transport


@dataclass(frozen=True)
class MPRNGConfig:
    timeout: float = 5.0  # seconds to wait for commitments, then again for reveals
    max_attempts: int = 5

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"mprng.timeout={self.timeout!r} must be > 0 seconds")
        if self.max_attempts < 1:
            raise ConfigError(f"mprng.max_attempts={self.max_attempts} must be >= 1")


def commit_payload(peer: str, value: bytes, salt: bytes) -> bytes:
    return encode({"h": commitment(peer, value, salt)})


def reveal_payload(value: bytes, salt: bytes, seen: bytes) -> bytes:
    return encode({"x": value, "s": salt, "seen": seen})


class MPRNGBehaviour:
    """How a peer publishes its commitment and reveal; attackers subclass and lie."""

    async def commit(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes) -> None:
        await transport.broadcast(topic, round_id, commit_payload(transport.peer_id, value, salt))

    async def reveal(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes, seen: bytes) -> None:
        await transport.broadcast(topic, round_id, reveal_payload(value, salt, seen))


class WithholdReveal(MPRNGBehaviour):
    """Attack: commit, then never reveal (tries to abort rounds it dislikes)."""

    async def reveal(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes, seen: bytes) -> None:
        return None


class WrongReveal(MPRNGBehaviour):
    """Attack: reveal a value other than the one committed to."""

    async def reveal(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes, seen: bytes) -> None:
        await transport.broadcast(topic, round_id, reveal_payload(bytes(b ^ 0xFF for b in value), salt, seen))


class SplitView(MPRNGBehaviour):
    """Attack: commit and reveal one value to half of the peers and another to the rest.

    Each half alone sees a consistent commit and reveal; only by comparing
    views can honest peers notice, and then the two signed commitments are an
    equivocation proof.
    """

    async def commit(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes) -> None:
        me = transport.peer_id
        other = bytes(b ^ 0x5A for b in value)
        await self._split(transport, topic, round_id, commit_payload(me, value, salt), commit_payload(me, other, salt))

    async def reveal(self, transport: Transport, topic: str, round_id: int, value: bytes, salt: bytes, seen: bytes) -> None:
        other = bytes(b ^ 0x5A for b in value)
        await self._split(transport, topic, round_id, reveal_payload(value, salt, seen), reveal_payload(other, salt, seen))

    async def _split(self, transport: Transport, topic: str, round_id: int, first: bytes, second: bytes) -> None:
        others = [p for p in transport.members() if p != transport.peer_id]
        envelope = SignedEnvelope.create(transport.identity, topic, round_id, first)
        transport.board.add(envelope)
        alternative = SignedEnvelope.create(transport.identity, topic, round_id, second)
        for index, peer in enumerate(others):
            chosen = envelope if index < len(others) // 2 else alternative
            await transport.send(peer, BROADCAST_TOPIC, chosen.to_bytes())


@dataclass(frozen=True)
class MPRNGResult:
    value: bytes
    participants: tuple[str, ...]
    attempts: int
    banned: tuple[str, ...]


class MPRNGFailed(LocalError):
    """No attempt produced an agreed value within max_attempts."""


def _seen_digest(commits: dict[str, bytes]) -> bytes:
    """Names the exact commitments a peer saw, so split views show up in the reveals."""
    h = hashlib.sha256()
    for peer in sorted(commits):
        h.update(peer.encode() + b"=" + commits[peer] + b";")
    return h.digest()


async def run_mprng(
    transport: Transport,
    ledger: BanLedger,
    round_id: int,
    config: MPRNGConfig = MPRNGConfig(),
    entropy: Callable[[int], bytes] = secrets.token_bytes,
    behaviour: MPRNGBehaviour = MPRNGBehaviour(),
    before_reveal: Callable[[], Awaitable[None]] | None = None,
    among: list[str] | None = None,
    reveal_wait: Callable[[], float] | None = None,
) -> MPRNGResult:
    """Run one MPRNG round among the current, unbanned members (or the unbanned ones of `among`).

    `among` is a protocol's agreed group (BTARD's step group): members that do
    not take part in the protocol yet, such as a joiner still catching up, are
    then not waited for.

    `before_reveal`, when given, is awaited before the first reveal: a caller
    can commit early and reveal only once what r must not influence is fixed
    (BTARD: every aggregate commitment); `reveal_wait()`, asked after it, how long
    the first attempt's reveals are waited for (default the timeout). Raises MPRNGFailed when no attempt
    agreed (e.g. a peer keeps lying about what it saw); callers treat that as
    "no random value this round".
    """
    newly_banned: list[str] = []
    for attempt in range(config.max_attempts):
        commit_topic, reveal_topic = f"mprng.commit.{attempt}", f"mprng.reveal.{attempt}"
        participants = ledger.filter(transport.members() if among is None else among)
        value, salt = entropy(VALUE_BYTES), entropy(SALT_BYTES)
        await behaviour.commit(transport, commit_topic, round_id, value, salt)
        envelopes = await transport.collect_broadcasts(commit_topic, round_id, participants, config.timeout)
        commits = {p: h for p, env in envelopes.items() if (h := _field(transport, env.payload, p, "h", 32)) is not None}
        seen = _seen_digest(commits)
        if before_reveal is not None and attempt == 0:
            await before_reveal()
        await behaviour.reveal(transport, reveal_topic, round_id, value, salt, seen)
        # Reveals are read from every participant, not only from those whose
        # commitment reached us: a peer we missed must still be able to tell us
        # that it saw another set, or we would settle on a different value.
        # A participant whose commitment missed my deadline was silent already: once every committed
        # participant has revealed it gets a grace, not the whole timeout. Its reveal only matters when
        # it names another seen set, and one sent on time reaches everyone within the grace.
        wait = reveal_wait() if reveal_wait is not None and attempt == 0 else config.timeout
        envelopes = await transport.collect_passing_over(
            reveal_topic, round_id, participants, wait, lambda got: {p for p in participants if p not in commits},
            grace=config.timeout / 4,
        )
        reveals, disagreeing = {}, []
        for peer, env in envelopes.items():
            x = _field(transport, env.payload, peer, "x", VALUE_BYTES)
            s = _field(transport, env.payload, peer, "s", SALT_BYTES)
            if x is None or s is None:
                continue
            if peer in commits:
                reveals[peer] = Reveal(x, s)
            if peer not in commits or _field(transport, env.payload, peer, "seen", 32) != seen:
                disagreeing.append(peer)
        if disagreeing:
            # Someone saw other commitments: fetch theirs, so that an equivocating
            # committer is caught by a proof every honest peer can check.
            await transport.fetch_broadcasts(commit_topic, round_id, participants, disagreeing, config.timeout / 2)
        outcome = resolve(commits, reveals)
        cheaters = [(m.peer, m.reason) for m in outcome.misbehaving]
        cheaters += [(p.first.sender, "equivocation") for p in transport.board.proofs if p.first.step == round_id]
        applied = ledger.apply([BanRecord(round_id, peer, reason) for peer, reason in cheaters])
        for record in applied:
            newly_banned.append(record.peer)
            if record.reason != "equivocation":  # the board already reported the proof
                transport.report(Evidence(record.peer, record.reason, f"MPRNG round {round_id} attempt {attempt}", round_id))
        if outcome.value is not None and not disagreeing and not applied:
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
