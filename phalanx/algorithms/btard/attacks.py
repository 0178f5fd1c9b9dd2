"""Protocol-level Byzantine policies for BTARD (App. C), as pure decisions.

The secure round asks its `ProtocolPolicy` at each point where a peer could
lie: what to commit, what to send to each owner, what aggregate to commit and
send, which norms and inner products to report, how to validate, whom to
accuse. The honest policy answers truthfully; each attack overrides one or
two answers and is active on the steps of its `AttackSchedule`. Attackers
know who their colluders are (they are one adversary); the defence never does.

Gradient attacks (`phalanx.algorithms.robust.attacks`) are not here: they rewrite the
gradient before it is committed, and their commitments are consistent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..robust.attacks import AttackSchedule


def _unit(seed: int, step: int, size: int) -> Tensor:
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{step}/shift".encode()).digest()[:8], "little") >> 1)
    v = torch.randn(size, generator=generator)
    return v / v.norm().clamp_min(1e-12)


@dataclass(kw_only=True)
class ProtocolPolicy:
    """The honest answers; attacks override some of them."""

    schedule: AttackSchedule = field(default_factory=AttackSchedule)
    seed: int = 0
    colluders: frozenset[str] = frozenset()

    def active(self, step: int) -> bool:
        return self.schedule.is_active(step)

    def committed_gradient(self, step: int, gradient: Tensor) -> Tensor:
        """The vector whose part hashes and whole hash are committed."""
        return gradient

    def equivocate(self, step: int) -> bool:
        """Sign a second, different commitment and send it to half of the peers."""
        return False

    def deadline_edge(self, step: int) -> bool:
        """Sign the commitment just before the others' deadline: half get it in time, half just after."""
        return False

    def report_edge(self, step: int) -> bool:
        """Time the report (claims, verdicts) at the others' deadline: early to half of them, late to the rest."""
        return False

    def part_for(self, step: int, owner: str, part: Tensor, group: list[str]) -> Tensor | None:
        """What to send to `owner` of `group` (None: nothing)."""
        return part

    def aggregate(self, step: int, aggregate: Tensor) -> tuple[Tensor, Tensor]:
        """(committed aggregate, sent aggregate) of the partition this peer owns."""
        return aggregate, aggregate

    def aggregated(self, step: int, used: list[str]) -> list[str]:
        """Which of the parts this owner received intact it really aggregates."""
        return used

    def withhold_from(self, step: int, group: list[str]) -> str | None:
        """A member this owner sends neither its aggregate commitment nor its aggregate (None: nobody)."""
        return None

    def declare(self, step: int, used: list[str], dropped: dict[str, str], owners: list[str]) -> tuple[list[str], dict[str, str]]:
        """What this owner's aggregate commitment names: the parts it used and the owners it dropped (why)."""
        return used, dropped

    def other_declaration(self, step: int, used: list[str], dropped: dict[str, str], owners: list[str]) -> tuple[list[str], dict[str, str]] | None:
        """A second declaration, signed too and sent to half of the peers (None: one declaration)."""
        return None

    def report(self, step: int, norms: dict[str, float], s: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """The norms and inner products this peer broadcasts."""
        return norms, s

    def serve_gradient(self, step: int) -> bool:
        """Whether to answer a validator's request for this peer's committed gradient."""
        return True

    def serve_parts(self, step: int) -> bool:
        """Whether to answer a validator's request for a part this owner aggregated."""
        return True

    def validate(self, step: int, target: str) -> str:
        """'check' (really validate), 'approve' (without checking) or 'skip' (send no verdict)."""
        return "check"

    def slander(self, step: int, group: list[str]) -> list[str]:
        """Honest peers to accuse falsely this step."""
        return []


@dataclass(kw_only=True)
class AggregateShift(ProtocolPolicy):
    """Owner adds scale * ||a|| * u (u a shared random unit vector) to its aggregate.

    consistent=True commits the shifted aggregate (caught by Verification 2's
    sum); False commits the honest one and sends the shifted one (ELIMINATE).
    """

    scale: float = 1.0
    consistent: bool = True

    def aggregate(self, step: int, aggregate: Tensor) -> tuple[Tensor, Tensor]:
        if not self.active(step):
            return aggregate, aggregate
        shifted = aggregate + self.scale * aggregate.norm().clamp_min(1e-3) * _unit(self.seed, step, aggregate.numel())
        return (shifted, shifted) if self.consistent else (aggregate, shifted)


@dataclass(kw_only=True)
class Slander(ProtocolPolicy):
    """Accuse `count` honest peers of forging their gradient (they are innocent)."""

    count: int = 1

    def slander(self, step: int, group: list[str]) -> list[str]:
        if not self.active(step):
            return []
        return [p for p in group if p not in self.colluders][: self.count]


@dataclass(kw_only=True)
class LateReport(Slander):
    """Slander, in a report timed at the others' deadline (early to half of them, late to the rest).

    The honest peers that hold it ban the slanderer, and those it reached too late would not, unless they
    decide on the same reports."""

    def report_edge(self, step: int) -> bool:
        return self.active(step)


@dataclass(kw_only=True)
class ApproveAll(ProtocolPolicy):
    """Sign flip by `scale`, and as validator approve every target without checking it.

    A gradient attack that relies on lazy validators."""

    scale: float = 1000.0
    only_colluders: ClassVar[bool] = False

    def committed_gradient(self, step: int, gradient: Tensor) -> Tensor:
        return gradient * -self.scale if self.active(step) else gradient

    def validate(self, step: int, target: str) -> str:
        if self.only_colluders and target not in self.colluders:
            return "check"
        return "approve"


@dataclass(kw_only=True)
class Cover(ApproveAll):
    """Sign flip, and as validator of a colluder approve it; honest targets are really checked."""

    only_colluders: ClassVar[bool] = True


@dataclass(kw_only=True)
class WithholdGradient(ApproveAll):
    """Sign flip by `scale`, and never send the committed gradient to a validator.

    The forged parts must be fetched from the owners that aggregated them."""

    only_colluders: ClassVar[bool] = True

    def serve_gradient(self, step: int) -> bool:
        return False


@dataclass(kw_only=True)
class WrongHash(ProtocolPolicy):
    """Commit the honest gradient's hashes, then send parts scaled by -scale."""

    scale: float = 1000.0

    def part_for(self, step: int, owner: str, part: Tensor, group: list[str]) -> Tensor | None:
        return part * -self.scale if self.active(step) and owner not in self.colluders else part


@dataclass(kw_only=True)
class SilentToOne(ProtocolPolicy):
    """Commit, then send nothing to the first honest owner."""

    def part_for(self, step: int, owner: str, part: Tensor, group: list[str]) -> Tensor | None:
        victim = next((p for p in group if p not in self.colluders), None)
        return None if self.active(step) and owner == victim else part


@dataclass(kw_only=True)
class WithholdAggregate(ProtocolPolicy):
    """Owner: send the aggregate commitment and the aggregate to every member but the first honest one.

    That member then owes no metadata for the partition; the owner claims `no_meta` against it all the same."""

    def withhold_from(self, step: int, group: list[str]) -> str | None:
        return next((p for p in group if p not in self.colluders), None) if self.active(step) else None


@dataclass(kw_only=True)
class Equivocate(ProtocolPolicy):
    """Sign two different commitments for one step and split them between peers."""

    def equivocate(self, step: int) -> bool:
        return self.active(step)


@dataclass(kw_only=True)
class DeadlineEdge(ProtocolPolicy):
    """Time the commitment at the deadline: early to half of the peers, late to the rest."""

    def deadline_edge(self, step: int) -> bool:
        return self.active(step)


@dataclass(kw_only=True)
class LieNorms(ProtocolPolicy):
    """Report every norm multiplied by (1 + scale)."""

    scale: float = 0.5

    def report(self, step, norms, s):
        if not self.active(step):
            return norms, s
        return {k: v * (1 + self.scale) for k, v in norms.items()}, s


@dataclass(kw_only=True)
class LieInnerProducts(ProtocolPolicy):
    """Report every s shifted by scale * (|s| + 1)."""

    scale: float = 0.5

    def report(self, step, norms, s):
        if not self.active(step):
            return norms, s
        return norms, {k: v + self.scale * (abs(v) + 1.0) for k, v in s.items()}


@dataclass(kw_only=True)
class NoValidate(ProtocolPolicy):
    """Send no verdict when chosen as validator."""

    def validate(self, step: int, target: str) -> str:
        return "skip" if self.active(step) else "check"


# --- the owner's declaration differs from the agreed set (issue 14) ---------------
# An owner's aggregate commitment names the parts it used and the owners it dropped. What it must
# aggregate follows from the agreed commitments less its drops (each an ELIMINATE), so every lie
# below is a claim that honest peers derive from broadcasts they share.


@dataclass(kw_only=True)
class ScaledAggregate(ProtocolPolicy):
    """Owner commits and sends `scale` x its honest aggregate and names nobody as a contributor.

    The attack that was never banned when checks trusted the owner's list)."""

    scale: float = -10.0

    def aggregate(self, step, aggregate):
        return (aggregate * self.scale,) * 2 if self.active(step) else (aggregate, aggregate)

    def declare(self, step, used, dropped, owners):
        return ([], {}) if self.active(step) else (used, dropped)


@dataclass(kw_only=True)
class HideContributors(ProtocolPolicy):
    """Owner aggregates only its colluders' parts, scaled by `scale`, and declares every part as used."""

    scale: float = 1.0

    def aggregated(self, step, used):
        return [p for p in used if p in self.colluders] if self.active(step) else used

    def aggregate(self, step, aggregate):
        return (aggregate * self.scale,) * 2 if self.active(step) else (aggregate, aggregate)


@dataclass(kw_only=True)
class TrimmedDeclaration(HideContributors):
    """Owner aggregates its colluders' parts only, scaled by `scale` (-10), and declares only them.

    Honest contributors vanish from the declaration."""

    scale: float = -10.0

    def declare(self, step, used, dropped, owners):
        return ([p for p in used if p in self.colluders], dropped) if self.active(step) else (used, dropped)


@dataclass(kw_only=True)
class ListNobody(ProtocolPolicy):
    """Owner aggregates honestly but declares that it used no part."""

    def declare(self, step, used, dropped, owners):
        return ([], dropped) if self.active(step) else (used, dropped)


@dataclass(kw_only=True)
class ListOther(ProtocolPolicy):
    """Owner aggregates honestly but declares its colluders in place of its honest contributors.

    A non-contributor is listed and a contributor hidden."""

    def declare(self, step, used, dropped, owners):
        if not self.active(step):
            return used, dropped
        return [p for p in owners if p in self.colluders or p not in used], dropped


@dataclass(kw_only=True)
class ListExtra(ProtocolPolicy):
    """Owner declares an honest contributor both used and dropped (a declaration no honest owner signs)."""

    def declare(self, step, used, dropped, owners):
        victim = next((p for p in used if p not in self.colluders), None)
        if not self.active(step) or victim is None:
            return used, dropped
        return used, {**dropped, victim: "missing_part"}


@dataclass(kw_only=True)
class SplitDeclaration(ProtocolPolicy):
    """Owner signs two declarations of one aggregate and splits them between the peers.

    The true one goes to half of the peers, and to the other half one that no honest owner signs (an honest contributor both used and dropped), hoping
    that only the peers holding the true one apply its aggregate."""

    def other_declaration(self, step, used, dropped, owners):
        victim = next((p for p in used if p not in self.colluders), None)
        if not self.active(step) or victim is None:
            return None
        return used, {**dropped, victim: "part_hash"}


@dataclass(kw_only=True)
class DropHonest(HideContributors):
    """Owner leaves its honest contributors out and declares them dropped (missing part).

    The one lie the protocol cannot disprove, paid for as an ELIMINATE (the owner goes with one victim)."""

    def declare(self, step, used, dropped, owners):
        if not self.active(step):
            return used, dropped
        return [p for p in used if p in self.colluders], {**dropped, **{p: "missing_part" for p in used if p not in self.colluders}}


PROTOCOL_ATTACKS: dict[str, type[ProtocolPolicy]] = {
    "agg_shift": AggregateShift,
    "slander": Slander,
    "late_report": LateReport,
    "approve_all": ApproveAll,
    "cover": Cover,
    "withhold_gradient": WithholdGradient,
    "wrong_hash": WrongHash,
    "silent_to_one": SilentToOne,
    "withhold_aggregate": WithholdAggregate,
    "equivocate": Equivocate,
    "deadline_edge": DeadlineEdge,
    "lie_norms": LieNorms,
    "lie_inner_products": LieInnerProducts,
    "no_validate": NoValidate,
    "scaled_aggregate": ScaledAggregate,
    "hide_contributors": HideContributors,
    "trimmed_declaration": TrimmedDeclaration,
    "list_nobody": ListNobody,
    "list_other": ListOther,
    "list_extra": ListExtra,
    "split_declaration": SplitDeclaration,
    "drop_honest": DropHonest,
}


def make_policy(name: str, schedule: AttackSchedule, seed: int, colluders: frozenset[str], **params: Any) -> ProtocolPolicy:
    """The protocol attack registered as `name`, or the honest policy for 'none'."""
    cls = ProtocolPolicy if name == "none" else PROTOCOL_ATTACKS.get(name)
    if cls is None:
        raise ValueError(f"unknown protocol attack {name!r}; choose one of {sorted(PROTOCOL_ATTACKS)}")
    try:
        return cls(schedule=schedule, seed=seed, colluders=colluders, **params)
    except TypeError as error:
        raise ValueError(f"bad parameters for attack {name!r}: {error}") from error
