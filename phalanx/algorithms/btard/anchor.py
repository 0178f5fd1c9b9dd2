"""App. F's anchor: a chain of per-step state digests that trusted peers sign (pure; no I/O).

Each replica, at the start of step s, links (s, the digest of step s - 1's
link, the digest of its model, the digest of its ban ledger, the trusted
set step s uses); honest replicas hold identical states, so they make the
same link. The signature is the one a trusted peer already sends every
step: its signed join for step s + 1 carries the link of step s, so the
anchor costs no message of its own.

A peer that joins mid-run knows only the initial set (the run's first
trusted peers). It verifies a chain from there: a link counts once a strict
majority of the trusted set of the last link it verified (the initial set
before any) signed it, and the link's own trusted set then becomes the set
whose majority the next link needs. Sybil identities are never in a
verified trusted set, so the votes a joiner takes (catch-up's snapshot vote,
the admission state) count only the trusted peers of the chain's tip, and a
state made up by Sybils that lists only themselves has no chain.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...core.errors import RemoteError
from ...core.serialization import decode, digest, encode

GENESIS = "phalanx.btard.anchor.genesis"


@dataclass(frozen=True)
class Link:
    step: int
    prev: bytes  # the digest of step - 1's link (genesis(initial) at the first step)
    model: bytes  # digest of the model parameters at the start of the step
    ledger: bytes  # digest of the ban ledger at the start of the step
    trusted: tuple[str, ...]  # the trusted set the step uses, sorted

    def to_bytes(self) -> bytes:
        return encode([self.step, self.prev, self.model, self.ledger, list(self.trusted)])

    @classmethod
    def from_bytes(cls, data: bytes, sender: str) -> "Link | None":
        """The link `data` (from `sender`) encodes, or None if it is not one."""
        try:
            obj = decode(data, sender)
        except RemoteError:
            return None
        if not (isinstance(obj, list) and len(obj) == 5):
            return None
        step, prev, model, ledger, trusted = obj
        if type(step) is not int or step < 0 or not all(isinstance(x, bytes) for x in (prev, model, ledger)):
            return None
        if not (isinstance(trusted, list) and all(isinstance(p, str) for p in trusted) and trusted == sorted(set(trusted))):
            return None
        return cls(step, prev, model, ledger, tuple(trusted))

    def digest(self) -> bytes:
        return digest(self.to_bytes())


def genesis(initial: Iterable[str]) -> bytes:
    """The `prev` of the chain's first link: a digest of the initial trusted set."""
    return digest(encode([GENESIS, sorted(set(initial))]))


def walk_chain(initial: Iterable[str], candidates: dict[int, dict[Link, set[str]]]) -> list[tuple[Link, bool]]:
    """The chain a peer that trusts only `initial` follows, in step order, each link with whether it is verified.

    `candidates[s]` maps each link offered for step s to the peers whose signature on it was
    checked. From the first step on, each next link must name the digest of the one before; of
    several, the one most peers of the current set signed is followed. A link is verified when a
    strict majority of the last verified trusted set (the initial set before any) signed it; its
    trusted set is then the one the next links need. Unverified links still carry the chain (their
    signatures may come later). Stops at the first step with no link that continues it.
    """
    voters = frozenset(initial)
    prev = genesis(voters)
    path: list[tuple[Link, bool]] = []
    for step in sorted(candidates):
        if path and step != path[-1][0].step + 1:
            break
        options = [(len(signers & voters), link.to_bytes(), link) for link, signers in candidates[step].items() if link.step == step and link.prev == prev]
        if not options:
            break
        votes, _, link = max(options, key=lambda o: (o[0], o[1]))
        prev = link.digest()
        verified = 2 * votes > len(voters)
        if verified:
            voters = frozenset(link.trusted)
        path.append((link, verified))
    return path


def verify_chain(initial: Iterable[str], candidates: dict[int, dict[Link, set[str]]]) -> list[Link]:
    """The verified links of `walk_chain`."""
    return [link for link, verified in walk_chain(initial, candidates) if verified]
