"""Sybil-resistant admission of peers that join mid-run (BTARD App. F), as a pure state machine.

A joiner starts untrusted: it computes and commits a gradient every step,
validators may check it, but nobody aggregates it and it validates nobody.
After T approved gradients it becomes trusted. At most floor(t/2) peers are
untrusted at once (t = trusted peers); later joiners wait in a FIFO queue
until an untrusted slot frees up (its holder became trusted or was banned).
A peer, trusted or not, that misses a commitment or has one invalidated is
banned: the chain of gradient records must not break.

The machine only decides; the runtime feeds it what happened in a step
(commitments seen, validations) and acts on the events it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..core.errors import ConfigError


@dataclass(frozen=True)
class AdmissionConfig:
    approvals: int = 10  # T: approved gradients an untrusted peer needs to become trusted

    def __post_init__(self) -> None:
        if self.approvals < 1:
            raise ConfigError(f"admission.approvals={self.approvals} must be >= 1")


@dataclass(frozen=True)
class Admitted:
    peer: str  # now untrusted: it computes and commits, nobody aggregates it


@dataclass(frozen=True)
class Queued:
    peer: str
    position: int  # 0: next to be admitted


@dataclass(frozen=True)
class Trusted:
    peer: str


@dataclass(frozen=True)
class Banned:
    peer: str
    reason: str


Event = Admitted | Queued | Trusted | Banned


class Admission:
    def __init__(self, trusted: Iterable[str], config: AdmissionConfig = AdmissionConfig()) -> None:
        self.config = config
        self.trusted: set[str] = set(trusted)
        self.untrusted: dict[str, int] = {}  # peer -> approved gradients so far
        self.queue: list[str] = []
        self.banned: set[str] = set()

    @property
    def slots(self) -> int:
        """How many peers may be untrusted at once: floor(t / 2)."""
        return len(self.trusted) // 2

    def aggregated(self) -> list[str]:
        """The peers whose gradients are aggregated and who may validate: the trusted ones, sorted."""
        return sorted(self.trusted)

    def committing(self) -> list[str]:
        """The peers that must commit a gradient every step (trusted and untrusted), sorted."""
        return sorted(self.trusted | set(self.untrusted))

    def join(self, peer: str) -> list[Event]:
        """A new identity asks to join."""
        if peer in self.banned or peer in self.trusted or peer in self.untrusted or peer in self.queue:
            return []
        self.queue.append(peer)
        events = self._admit()
        if peer in self.queue:
            events.append(Queued(peer, self.queue.index(peer)))
        return events

    def approved(self, peer: str) -> list[Event]:
        """A validator chosen by MPRNG approved `peer`'s committed gradient."""
        if peer not in self.untrusted:
            return []
        self.untrusted[peer] += 1
        if self.untrusted[peer] < self.config.approvals:
            return []
        del self.untrusted[peer]
        self.trusted.add(peer)
        return [Trusted(peer), *self._admit()]

    def broke_chain(self, peer: str, reason: str) -> list[Event]:
        """`peer` missed a commitment or had one invalidated (ACCUSE upheld): ban it."""
        return self.ban(peer, reason)

    def ban(self, peer: str, reason: str) -> list[Event]:
        """Ban `peer` wherever it stands, and admit waiting peers into freed slots."""
        if peer in self.banned:
            return []
        self.trusted.discard(peer)
        self.untrusted.pop(peer, None)
        if peer in self.queue:
            self.queue.remove(peer)
        self.banned.add(peer)
        return [Banned(peer, reason), *self._admit()]

    def _admit(self) -> list[Event]:
        events: list[Event] = []
        while self.queue and len(self.untrusted) < self.slots:
            peer = self.queue.pop(0)
            self.untrusted[peer] = 0
            events.append(Admitted(peer))
        return events
