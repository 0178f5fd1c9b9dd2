"""Who lies on which file under Aspis's attack models (Sec. IV), pure.

An `Orchestration` is the coalition's plan; every Byzantine worker holds the
same one (they collude) and reads only public values from it: the iteration,
the public assignment and its own index. The defence never sees it.

- ATT-1 (`att1`): a fixed Byzantine set; each Byzantine distorts every file it
  computes, independently.
- ATT-2 (`att2`, Theorem 1): the Byzantines fix a set D of q honest workers and
  distort exactly the files whose members all lie in A u D, so they disagree
  with D and with nobody else: A u (H - D) and H are two cliques of K-q.
- ATT-3 (`att3`): the Byzantine set is redrawn at random every T_b iterations
  and distorts only the files where it holds a strict majority.
- `majority`: a fixed set that distorts where it holds a strict majority (the
  colluding attack on DETOX's groups).

Colluders in one file send the same vector, so a majority of them wins a vote.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.rng import derive_seed
from .designs import Assignment

# The coalition plans (redundancy axis), each with the one line `phalanx attacks` shows.
ORCHESTRATIONS: dict[str, str] = {
    "att1": "ATT-1: a fixed Byzantine set; each Byzantine distorts every file it computes.",
    "att2": "ATT-2 (Theorem 1): a fixed set distorts the files lying wholly in it plus q chosen honest targets.",
    "att3": "ATT-3: a random Byzantine set, redrawn every T_b iterations, distorts where it holds a majority.",
    "majority": "A fixed set distorts the files where it holds a strict majority (against DETOX's groups).",
}
# The gradient attacks an Aspis Byzantine may send on a file it distorts (attack.distortion).
DISTORTIONS = ("alie", "ipm", "reversed", "constant", "sign_flip", "random_direction")


def theorem1_distorted(workers: int, r: int, q: int) -> float:
    """Theorem 1: at most (1/2) C(2q, r) of the C(K, r) files can be distorted (r odd)."""
    return math.comb(2 * q, r) / 2


def detox_optimal_byzantine(workers: int, r: int, q: int) -> frozenset[int]:
    """ByzShield's optimal choice against DETOX: r' Byzantines in as many groups of r as possible."""
    majority = (r + 1) // 2
    chosen: list[int] = []
    for group in range(0, workers, r):
        take = min(majority, q - len(chosen))
        chosen.extend(range(group, group + take))
    spare = [w for w in range(workers) if w not in chosen]
    chosen.extend(spare[: q - len(chosen)])
    return frozenset(chosen)


@dataclass(frozen=True)
class Orchestration:
    """The coalition's plan. `byzantine` is the fixed set (unused by att3), `targets` is ATT-2's D."""

    kind: str
    workers: int
    q: int
    byzantine: frozenset[int] = frozenset()
    targets: frozenset[int] = frozenset()
    redraw_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ORCHESTRATIONS:
            raise ValueError(f"unknown orchestration {self.kind!r}; allowed: {', '.join(ORCHESTRATIONS)}")
        if self.kind == "att2" and (len(self.targets) != self.q or self.targets & self.byzantine):
            raise ValueError("att2 needs q honest targets disjoint from the Byzantine set")
        if self.redraw_every < 1:
            raise ValueError(f"redraw_every must be >= 1, got {self.redraw_every}")

    def byzantine_at(self, iteration: int) -> frozenset[int]:
        """The Byzantine set in force at `iteration`."""
        if self.kind != "att3":
            return self.byzantine
        window = iteration // self.redraw_every
        stream = random.Random(derive_seed(self.seed, "aspis-att3", window))
        return frozenset(stream.sample(range(self.workers), self.q))

    def distorted_files(self, iteration: int, assignment: Assignment) -> frozenset[int]:
        """Indices of the files the coalition distorts at `iteration` under `assignment`."""
        bad = self.byzantine_at(iteration)
        out = []
        for index, file in enumerate(assignment.files):
            inside = sum(1 for w in file if w in bad)
            if not inside:
                continue
            if self.kind == "att1":
                out.append(index)
            elif self.kind == "att2":
                if all(w in bad or w in self.targets for w in file):
                    out.append(index)
            elif 2 * inside > len(file):
                out.append(index)
        return frozenset(out)

    def lies_on(self, iteration: int, assignment: Assignment, worker: int) -> frozenset[int]:
        """The files this worker distorts at `iteration` (empty when it is honest then)."""
        if worker not in self.byzantine_at(iteration):
            return frozenset()
        return frozenset(i for i in self.distorted_files(iteration, assignment) if worker in assignment.files[i])


def symbolic_copies(assignment: Assignment, plan: Orchestration, iteration: int) -> list[list[Tensor]]:
    """Stand-in copies for counting: file i's honest copy is [i, 0]; a colluding lie is [i, -1]; an ATT-1 lie is [i, 1 + w]."""
    lies = plan.distorted_files(iteration, assignment)
    bad = plan.byzantine_at(iteration)
    out = []
    for index, file in enumerate(assignment.files):
        row = []
        for w in file:
            if index in lies and w in bad:
                mark = float(1 + w) if plan.kind == "att1" else -1.0
            else:
                mark = 0.0
            row.append(torch.tensor([float(index), mark]))
        out.append(row)
    return out


def distortion_fraction(assignment: Assignment, copies: list[list[Tensor]], chosen: tuple[int | None, ...]) -> float:
    """Fraction of files whose aggregated copy is missing or distorted (second entry of a symbolic copy != 0)."""
    bad = 0
    for file, file_copies, worker in zip(assignment.files, copies, chosen):
        if worker is None or float(file_copies[file.index(worker)][1]) != 0.0:
            bad += 1
    return bad / len(assignment.files)
