"""A randomized multi-point Byzantine strategy for BTARD's red-team harness (pure; no I/O).

`RedTeam` answers every question the secure round asks a `ProtocolPolicy`
and, at each decision point of each step, deviates with probability `rate`,
picking one of the lies the catalogue knows there: what it commits, which
parts go to whom, which parts it aggregates and what aggregate it commits
and sends (and to whom: an aggregate and its commitment withheld from one
honest member), what it declares (and to whom), its norms and inner products,
its validation verdicts, its accusations, whether it serves its gradient or
the parts it aggregated, and when its commitment and its report are delivered
(signed at the others' deadline, early to half of them, late to the rest). Every choice is a pure function of
(seed, step, decision point), shared by all colluders: they are one
adversary and lie alike. `moves` lists what it did, so a violating run is
reproduced by its seed alone and reported with its schedule.

Delivery timing is played for the commitment and the report; aggregate
commitments and metadata are withheld or omitted, not timed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from torch import Tensor

from .attacks import ProtocolPolicy, _unit


@dataclass(kw_only=True)
class RedTeam(ProtocolPolicy):
    rate: float = 0.3  # probability of deviating at each decision point of each step
    points: frozenset[str] = frozenset()  # the decision points it may deviate at (empty: all of them)
    moves: list[tuple[int, str, str]] = field(default_factory=list)  # (step, point, choice) actually played

    def _pick(self, step: int, point: str, choices: tuple[str, ...], weight: float = 1.0) -> str | None:
        """The deviation at (step, point), or None (honest); recorded when played.

        `weight` scales the rate at points whose lie ends every other one (an equivocation is
        proven and banned at once, hiding what the rest of the strategy would have done)."""
        if self.points and point.split("/")[0] not in self.points:
            return None
        key = hashlib.sha256(f"{self.seed}/{step}/{point}".encode()).digest()
        rng = random.Random(int.from_bytes(key[:8], "little"))
        if rng.random() >= self.rate * weight:
            return None
        choice = rng.choice(choices)
        self.moves.append((step, point, choice))
        return choice

    def committed_gradient(self, step: int, gradient: Tensor) -> Tensor:
        choice = self._pick(step, "commit", ("sign_flip", "scale_10", "noise", "tiny_shift"))
        if choice == "sign_flip":
            return -gradient
        if choice == "scale_10":
            return gradient * 10.0
        if choice == "noise":
            return gradient + gradient.norm().clamp_min(1e-3) * _unit(self.seed, step, gradient.numel())
        if choice == "tiny_shift":  # under the validators' tolerance: must be harmless, not caught
            return gradient + 1e-6 * gradient.norm() * _unit(self.seed + 1, step, gradient.numel())
        return gradient

    def equivocate(self, step: int) -> bool:
        return self._pick(step, "equivocate", ("split_commit",), weight=0.2) is not None

    def deadline_edge(self, step: int) -> bool:
        return self._pick(step, "deadline_edge", ("commit",), weight=0.5) is not None

    def report_edge(self, step: int) -> bool:
        return self._pick(step, "report_edge", ("report",), weight=0.5) is not None

    def part_for(self, step: int, owner: str, part: Tensor, group: list[str]) -> Tensor | None:
        if owner in self.colluders:
            return part
        choice = self._pick(step, f"part/{owner}", ("withhold", "wrong_hash", "nan"))
        if choice == "withhold":
            return None
        if choice == "wrong_hash":
            return -part
        if choice == "nan":
            return part * float("nan")
        return part

    def aggregated(self, step: int, used: list[str]) -> list[str]:
        if self._pick(step, "aggregated", ("colluders_only",)):
            return [p for p in used if p in self.colluders]
        return used

    def aggregate(self, step: int, aggregate: Tensor) -> tuple[Tensor, Tensor]:
        choice = self._pick(step, "aggregate", ("scale_-10", "shift_consistent", "shift_sent_only", "tiny_shift"))
        shift = aggregate.norm().clamp_min(1e-3) * _unit(self.seed + 2, step, aggregate.numel())
        if choice == "scale_-10":
            return aggregate * -10.0, aggregate * -10.0
        if choice == "shift_consistent":
            return aggregate + shift, aggregate + shift
        if choice == "shift_sent_only":
            return aggregate, aggregate + shift
        if choice == "tiny_shift":
            return aggregate + 1e-3 * shift, aggregate + 1e-3 * shift
        return aggregate, aggregate

    def withhold_from(self, step: int, group: list[str]) -> str | None:
        honest = [p for p in group if p not in self.colluders]
        choice = self._pick(step, "withhold_aggregate", ("first_honest", "last_honest"))
        if choice and honest:
            return honest[0] if choice == "first_honest" else honest[-1]
        return None

    def declare(self, step: int, used: list[str], dropped: dict[str, str], owners: list[str]) -> tuple[list[str], dict[str, str]]:
        choice = self._pick(step, "declare", ("nobody", "colluders_only", "drop_honest", "used_and_dropped", "others"))
        honest = [p for p in used if p not in self.colluders]
        if choice == "nobody":
            return [], dropped
        if choice == "colluders_only":
            return [p for p in used if p in self.colluders], dropped
        if choice == "drop_honest":
            return [p for p in used if p in self.colluders], {**dropped, **{p: "missing_part" for p in honest}}
        if choice == "used_and_dropped" and honest:
            return used, {**dropped, honest[0]: "part_hash"}
        if choice == "others":
            return [p for p in owners if p in self.colluders or p not in used], dropped
        return used, dropped

    def other_declaration(self, step: int, used: list[str], dropped: dict[str, str], owners: list[str]) -> tuple[list[str], dict[str, str]] | None:
        if self._pick(step, "other_declaration", ("split",), weight=0.2):
            return [p for p in used if p in self.colluders], dropped
        return None

    def report(self, step: int, norms: dict[str, float], s: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        choice = self._pick(step, "report", ("norms_x1.5", "s_shift", "omit_one", "omit_all"))
        if choice == "norms_x1.5":
            return {k: v * 1.5 for k, v in norms.items()}, s
        if choice == "s_shift":
            return norms, {k: v + 0.5 * (abs(v) + 1.0) for k, v in s.items()}
        if choice == "omit_one" and s:
            first = sorted(s)[0]
            return {k: v for k, v in norms.items() if k != first}, {k: v for k, v in s.items() if k != first}
        if choice == "omit_all":
            return {}, {}
        return norms, s

    def validate(self, step: int, target: str) -> str:
        choice = self._pick(step, f"validate/{target}", ("approve", "skip"))
        return choice or "check"

    def slander(self, step: int, group: list[str]) -> list[str]:
        if self._pick(step, "slander", ("first_honest",)):
            return [p for p in group if p not in self.colluders][:1]
        return []

    def serve_gradient(self, step: int) -> bool:
        return self._pick(step, "serve_gradient", ("refuse",)) is None

    def serve_parts(self, step: int) -> bool:
        return self._pick(step, "serve_parts", ("refuse",)) is None
