"""What a joining peer fetches and which digests it trusts (pure; no I/O).

A state is served as fixed-size chunks. Its *manifest* lists the size and the
sha256 of every chunk; the state's digest is the sha256 of the encoded
manifest, so a joiner checks each chunk as it arrives and blames exactly the
peer that sent a bad one.

Trust comes from agreement, not from any one peer: a digest (of a state at a
sync step, or of the update applied at a step) is accepted when at least
`1 + confirmations` of the peers that answered report it, or, with fewer
answers than that, a strict majority of them; in both cases it must also be
the strict majority of the answers for that step. Honest replicas hold
bit-identical states (same public batches, same aggregated update, same
deterministic optimizer), so their digests are equal.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.serialization import digest, encode


def manifest_of(data: bytes, chunk_bytes: int) -> dict:
    """The manifest of `data` cut into chunks of `chunk_bytes`: {"size", "chunk", "hashes"}."""
    hashes = [digest(data[i : i + chunk_bytes]) for i in range(0, max(len(data), 1), chunk_bytes)]
    return {"size": len(data), "chunk": chunk_bytes, "hashes": hashes}


def manifest_digest(manifest: dict) -> bytes:
    """The digest that names a state: sha256 of its encoded manifest."""
    return digest(encode(manifest))


def needed_votes(answers: int, confirmations: int) -> int:
    """How many equal answers make a digest trusted, out of `answers` peers that answered."""
    if answers >= 1 + confirmations:
        return 1 + confirmations
    return answers // 2 + 1


@dataclass(frozen=True)
class Offer:
    """What one peer says it holds: the step it trains now, state digests by step, update digests by step."""

    latest: int
    snapshots: dict[int, bytes]
    updates: dict[int, bytes]


@dataclass(frozen=True)
class Agreed:
    """A digest the answers agree on for `step`, and the peers that reported it (who can serve it)."""

    step: int
    digest: bytes
    holders: tuple[str, ...]


def agreed(reports: dict[str, bytes], answers: int, confirmations: int) -> tuple[bytes, tuple[str, ...]] | None:
    """The trusted digest among `reports` (peer -> digest for one step), or None."""
    if not reports:
        return None
    counts = Counter(reports.values())
    best, votes = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if votes < needed_votes(answers, confirmations) or 2 * votes <= len(reports):
        return None
    return best, tuple(sorted(p for p, d in reports.items() if d == best))


def choose_snapshot(offers: dict[str, Offer], confirmations: int, at_step: int | None = None) -> Agreed | None:
    """The latest state snapshot the offers agree on (or the one at `at_step`), or None."""
    steps = sorted({s for o in offers.values() for s in o.snapshots}, reverse=True)
    for step in steps:
        if at_step is not None and step != at_step:
            continue
        found = agreed({p: o.snapshots[step] for p, o in offers.items() if step in o.snapshots}, len(offers), confirmations)
        if found is not None:
            return Agreed(step, *found)
    return None


def agreed_updates(offers: dict[str, Offer], start: int, confirmations: int) -> list[Agreed]:
    """Trusted update digests for consecutive steps start, start+1, ... up to the first step without agreement."""
    out = []
    step = start
    while True:
        found = agreed({p: o.updates[step] for p, o in offers.items() if step in o.updates}, len(offers), confirmations)
        if found is None:
            return out
        out.append(Agreed(step, *found))
        step += 1


def swarm_step(offers: dict[str, Offer]) -> int | None:
    """The step the swarm trains now: the median of the answers' `latest` (robust to a few liars)."""
    if not offers:
        return None
    latest = sorted(o.latest for o in offers.values())
    return latest[(len(latest) - 1) // 2]
