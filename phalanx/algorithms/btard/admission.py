"""Sybil-resistant admission of peers that join mid-run (BTARD App. F), as a pure state machine.

A joiner starts untrusted: it computes and commits a gradient every step,
validators may check it, but nobody aggregates it and it validates nobody.
After T approved gradients it becomes trusted. At most floor(t/2) peers are
untrusted at once (t = trusted peers); later joiners wait in a FIFO queue
until an untrusted slot frees up (its holder became trusted or was banned).
An untrusted peer that misses a commitment or has one invalidated is banned:
the chain of gradient records must not break. A trusted peer that misses a
step's commitment (it crashed, or went quiet) departs: it leaves the trusted
set, no longer counts in t, and comes back only through admission, so an
identity cannot bank trust and wake it later.

The machine only decides; the runtime feeds it what happened in a step
(entries, bans, validations) and acts on the events it returns. Fed the same
agreed inputs in the same order, every honest replica holds the same state;
`to_dict` / `from_dict` carry it to a peer that joins mid-run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...core.errors import ConfigError


@dataclass(frozen=True)
class AdmissionConfig:
    approvals: int = 10  # T: approved gradients an untrusted peer needs to become trusted

    def __post_init__(self) -> None:
        if self.approvals < 1:
            raise ConfigError(f"admission.approvals={self.approvals} must be >= 1")


@dataclass(frozen=True)
class Roles:
    """Who does what in one step's group.

    owners: the trusted members; each owns a partition and its gradient is aggregated.
    committers: owners and untrusted members; each commits a gradient that validators may check.
    Every other member (queued) only receives the step's aggregate.
    """

    owners: tuple[str, ...]
    committers: tuple[str, ...]


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


@dataclass(frozen=True)
class Departed:
    peer: str  # left without a fault anyone can prove: not banned, no longer trusted


Event = Admitted | Queued | Trusted | Banned | Departed


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

    def roles(self, group: list[str]) -> Roles:
        """The roles of `group`'s members at this step (sorted)."""
        owners = tuple(sorted(p for p in group if p in self.trusted))
        return Roles(owners, tuple(sorted(p for p in group if p in self.trusted or p in self.untrusted)))

    def status(self, peer: str) -> str:
        """trusted | untrusted | queued | banned | unknown."""
        for name, holder in (("trusted", self.trusted), ("untrusted", self.untrusted), ("queued", self.queue), ("banned", self.banned)):
            if peer in holder:
                return name
        return "unknown"

    def to_dict(self) -> dict:
        """The whole state in canonical form (equal on replicas that agree)."""
        return {
            "approvals": self.config.approvals,
            "trusted": sorted(self.trusted),
            "untrusted": dict(sorted(self.untrusted.items())),
            "queue": list(self.queue),
            "banned": sorted(self.banned),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Admission":
        """The inverse of `to_dict`; ValueError if `data` is not such a state."""
        if not isinstance(data, dict) or set(data) != {"approvals", "trusted", "untrusted", "queue", "banned"}:
            raise ValueError("admission state must hold exactly approvals, trusted, untrusted, queue, banned")
        lists = [data["trusted"], data["queue"], data["banned"]]
        if not all(isinstance(x, list) and all(isinstance(p, str) for p in x) for x in lists):
            raise ValueError("admission state lists must hold peer ids")
        untrusted = data["untrusted"]
        if not isinstance(untrusted, dict) or not all(isinstance(p, str) and type(n) is int and n >= 0 for p, n in untrusted.items()):
            raise ValueError("admission state untrusted must map peer ids to approval counts")
        if type(data["approvals"]) is not int or data["approvals"] < 1:
            raise ValueError("admission state approvals must be an int >= 1")
        state = cls(data["trusted"], AdmissionConfig(data["approvals"]))
        state.untrusted = dict(untrusted)
        state.queue = list(data["queue"])
        state.banned = set(data["banned"])
        return state

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

    def depart(self, peer: str) -> list[Event]:
        """`peer` missed a step (no commitment, or silent through its verification): it leaves
        whatever set it was in without a ban, and may join again later like any new identity."""
        if peer in self.banned or self.status(peer) == "unknown":
            return []
        self.trusted.discard(peer)
        self.untrusted.pop(peer, None)
        if peer in self.queue:
            self.queue.remove(peer)
        return [Departed(peer), *self._admit()]

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
