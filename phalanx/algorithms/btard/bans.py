"""Ban ledger: bans every honest peer agrees on, with no leader (BTARD App. D.3).

Accusations and eliminations of one step are applied in one canonical order;
any item that involves a peer already banned earlier in that order is ignored.
Same inputs, same bans on every honest peer, whatever order they arrived in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class BanRecord:
    step: int
    peer: str
    reason: str
    accuser: str = ""  # empty when every honest peer saw the fault itself


class BanLedger:
    def __init__(self) -> None:
        self._banned: dict[str, BanRecord] = {}

    def is_banned(self, peer: str) -> bool:
        return peer in self._banned

    @property
    def banned(self) -> list[str]:
        """Banned peer ids in the order they were banned."""
        return list(self._banned)

    @property
    def records(self) -> list[BanRecord]:
        return list(self._banned.values())

    def apply(self, records: list[BanRecord]) -> list[BanRecord]:
        """Apply one step's ban records in canonical order; returns those that took effect.

        A record whose accused or accuser is already banned is ignored. An
        accuser (when given) is banned along with the accused only by a later
        rule of the protocol that issued it, not here.
        """
        applied = []
        for record in sorted(set(records)):
            if record.peer in self._banned or (record.accuser and record.accuser in self._banned):
                continue
            self._banned[record.peer] = record
            applied.append(record)
        return applied

    def restore(self, records: list[BanRecord]) -> None:
        """Replace the ledger by `records`, in their order (a state fetched by catch-up)."""
        self._banned = {r.peer: r for r in records}

    def extend(self, records: list[BanRecord]) -> None:
        """Add bans that took effect elsewhere, in their order (a joiner replaying agreed updates)."""
        for record in records:
            self._banned.setdefault(record.peer, record)

    def filter(self, peers: list[str]) -> list[str]:
        """The peers that are not banned, in the given order."""
        return [p for p in peers if p not in self._banned]
