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

from collections.abc import Callable, Iterable, Mapping
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


def walk_chain(
    initial: Iterable[str],
    candidates: Mapping[int, Mapping[Link, Iterable[str]]],
    tip: Link | None = None,
    check: Callable[[Link, str], bool] | None = None,
    slack: int | None = None,
) -> list[tuple[Link, bool]]:
    """The chain a peer that trusts only `initial` follows, in step order, each link with whether it is verified.

    `candidates[s]` maps each link offered for step s to the peers said to have signed it; a signer
    counts if it is in the current set and `check(link, signer)` holds (None: every listed signature
    was checked already; only signers a vote could count are ever checked). The walk starts after
    `tip`, a link already verified (its trusted set is the current set), or at the chain's start.
    From there each next link must name the digest of the one before; of several, the one most
    peers of the current set signed is followed, and the walk stops where two tie (an unsigned link
    anybody can make up is no rival to follow). A link is verified when a strict majority of the
    last verified trusted set (the initial set before any) signed it; its trusted set is then the one
    the next links need. Unverified links still carry the chain (their signatures may come later),
    at most `slack` of them in a row. Stops at the first step with no link that continues it.
    """
    voters = frozenset(tip.trusted) if tip is not None else frozenset(initial)
    prev = tip.digest() if tip is not None else genesis(voters)
    step = tip.step + 1 if tip is not None else 0
    path: list[tuple[Link, bool]] = []
    unverified = 0
    while step in candidates:
        options = sorted(
            ((sum(1 for p in [p for p in signers if p in voters] if check is None or check(link, p)), link)
             for link, signers in candidates[step].items() if link.step == step and link.prev == prev),
            key=lambda o: o[0], reverse=True,
        )
        if not options or (len(options) > 1 and options[1][0] == options[0][0]):
            break
        votes, link = options[0]
        verified = 2 * votes > len(voters)
        unverified = 0 if verified else unverified + 1
        if slack is not None and unverified > slack:
            break
        if verified:
            voters = frozenset(link.trusted)
        path.append((link, verified))
        prev, step = link.digest(), step + 1
    return path


def verify_chain(initial: Iterable[str], candidates: Mapping[int, Mapping[Link, Iterable[str]]]) -> list[Link]:
    """The verified links of `walk_chain`."""
    return [link for link, verified in walk_chain(initial, candidates) if verified]
