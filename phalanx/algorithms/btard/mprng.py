"""MPRNG: multi-party random number generation by commit-reveal (BTARD App. A.2).

Each peer i draws x_i and a salt s_i, broadcasts h_i = H(i || x_i || s_i),
waits for every commitment, then reveals (x_i, s_i). Everyone checks each
reveal against its commitment; the output is x_1 XOR ... XOR x_n. A peer that
committed but did not reveal, or revealed something else, is named, and the
round is run again without it. Pure rules only; the network round lives in
`phalanx.runtime.rounds.mprng`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

VALUE_BYTES = 32
SALT_BYTES = 32


def commitment(peer: str, value: bytes, salt: bytes) -> bytes:
    """h = sha256(peer || value || salt), with length-prefixed fields."""
    h = hashlib.sha256(b"phalanx-mprng")
    for field in (peer.encode(), value, salt):
        h.update(len(field).to_bytes(4, "little"))
        h.update(field)
    return h.digest()


@dataclass(frozen=True)
class Reveal:
    value: bytes
    salt: bytes


@dataclass(frozen=True)
class Misbehaviour:
    peer: str
    reason: str  # "no_reveal" or "bad_reveal"


@dataclass(frozen=True)
class MPRNGOutcome:
    """`value` is the XOR of all reveals, or None when someone misbehaved."""

    value: bytes | None
    participants: tuple[str, ...]
    misbehaving: tuple[Misbehaviour, ...]


def resolve(commits: dict[str, bytes], reveals: dict[str, Reveal]) -> MPRNGOutcome:
    """Decide one round from the commitments and reveals a peer received.

    Only peers that committed take part; reveals from anyone else are ignored.
    """
    participants = tuple(sorted(commits))
    bad: list[Misbehaviour] = []
    for peer in participants:
        reveal = reveals.get(peer)
        if reveal is None:
            bad.append(Misbehaviour(peer, "no_reveal"))
        elif len(reveal.value) != VALUE_BYTES or commitment(peer, reveal.value, reveal.salt) != commits[peer]:
            bad.append(Misbehaviour(peer, "bad_reveal"))
    if bad:
        return MPRNGOutcome(None, participants, tuple(bad))
    out = bytearray(VALUE_BYTES)
    for peer in participants:
        for k, byte in enumerate(reveals[peer].value):
            out[k] ^= byte
    return MPRNGOutcome(bytes(out), participants, ())


def choose(value: bytes, options: list[str], k: int) -> list[str]:
    """Pick k distinct options from sorted `options`, driven only by `value` (e.g. validators)."""
    if not 0 <= k <= len(options):
        raise ValueError(f"cannot choose {k} of {len(options)} options")
    pool = sorted(options)
    picked = []
    for i in range(k):
        digest = hashlib.sha256(value + i.to_bytes(4, "little")).digest()
        picked.append(pool.pop(int.from_bytes(digest, "little") % len(pool)))
    return picked
