"""Aspis / Aspis+ detection and aggregation (Alg. 1-3 of the Aspis paper), pure.

Copies. For every file the coordinator holds one copy per assigned worker: a
flat gradient (the sum over the file's samples) or None when the worker sent
nothing usable. `file_labels` sorts the copies of one file into agreement
classes: two copies agree when they are equal (tolerance 0, right for
deterministic CPU compute, where honest copies are bit-identical) or when
||a - b||_2 <= tolerance * max(||a||_2, ||b||_2) (the paper's Sec. X-B check
for GPU drift, with 1e-5 there). A missing copy agrees with nothing.

Graph. `disagreements` counts, per pair of workers, the shared files on which
they fell in different classes; the agreement graph joins two workers that
share files and never disagree (Alg. 1, lines 1-6).

Detection. Aspis (`detect_clique`): keep the (K-q-1)-core of the graph (a
worker of degree < K-q-1 is in no clique of K-q workers, so this is the
degree pre-filter), enumerate its maximal cliques (networkx), and declare the
unique maximum clique honest; two or more maximum cliques, or one smaller than
K-q, is a failed detection. Aspis+ (`WindowDetector`, Alg. 3): the graph is
complete at the start of each window of T_d iterations and edges are only
removed inside it; a worker of degree < K-q-1 is (re)detected, and when more
than q are flagged the q most recently detected are kept.

Aggregation (Alg. 2). After a successful Aspis detection: one copy per file
from a worker in the honest set (files without one are dropped), averaged.
Otherwise: per file the copy that a strict majority of the non-flagged copies
agree on (r' = (r+1)/2 of r when none is flagged; a file without one is
dropped), then a robust rule over the winners (coordinate median by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import torch
from torch import Tensor

from .aspis_designs import Assignment

Copy = Tensor | None


def agree(a: Copy, b: Copy, tolerance: float = 0.0) -> bool:
    """Whether two copies of one file agree (exactly, or within a relative l2 tolerance)."""
    if a is None or b is None or a.shape != b.shape:
        return False
    if tolerance == 0.0:
        return bool(torch.equal(a, b))
    scale = max(float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b)))
    return float(torch.linalg.vector_norm(a - b)) <= tolerance * scale


def file_labels(copies: Sequence[Copy], tolerance: float = 0.0) -> list[int]:
    """Agreement class of each copy: a copy joins the first earlier class whose first member it agrees with."""
    labels: list[int] = []
    leaders: list[int] = []
    for index, copy in enumerate(copies):
        for label, leader in enumerate(leaders):
            if agree(copies[leader], copy, tolerance):
                labels.append(label)
                break
        else:
            labels.append(len(leaders))
            leaders.append(index)
    return labels


def disagreements(assignment: Assignment, labels: Sequence[Sequence[int]]) -> np.ndarray:
    """K x K counts of shared files on which two workers' copies fall in different classes."""
    k = assignment.workers
    counts = np.zeros((k, k), dtype=np.int64)
    if not assignment.files:
        return counts
    size = len(assignment.files[0])
    if any(len(f) != size for f in assignment.files):
        raise ValueError("disagreements needs files of equal size")
    members = np.asarray(assignment.files, dtype=np.int64)
    classes = np.asarray(labels, dtype=np.int64).reshape(len(assignment.files), size)
    for i in range(size):
        for j in range(i + 1, size):
            differ = classes[:, i] != classes[:, j]
            np.add.at(counts, (members[differ, i], members[differ, j]), 1)
    return counts + counts.T


def shared_counts(assignment: Assignment) -> np.ndarray:
    """K x K counts of files two workers share (vectorised `Assignment.shared`)."""
    k = assignment.workers
    counts = np.zeros((k, k), dtype=np.int64)
    if not assignment.files:
        return counts
    members = np.asarray(assignment.files, dtype=np.int64)
    size = members.shape[1]
    for i in range(size):
        for j in range(i + 1, size):
            np.add.at(counts, (members[:, i], members[:, j]), 1)
    return counts + counts.T


def agreement_graph(shared: np.ndarray, disagree: np.ndarray) -> nx.Graph:
    """Workers joined when they share at least one file and never disagree."""
    graph = nx.Graph()
    k = shared.shape[0]
    graph.add_nodes_from(range(k))
    rows, cols = np.nonzero(np.triu((shared > 0) & (disagree == 0), 1))
    graph.add_edges_from(zip(rows.tolist(), cols.tolist()))
    return graph


@dataclass(frozen=True)
class Detection:
    """Outcome of one detection: `honest` is None when detection failed."""

    honest: frozenset[int] | None
    flagged: frozenset[int]
    max_cliques: int = 0
    clique_size: int = 0

    @property
    def success(self) -> bool:
        return self.honest is not None


def detect_clique(graph: nx.Graph, q: int) -> Detection:
    """Alg. 1 with the degree pre-filter: a unique maximum clique of >= K-q workers is the honest set."""
    k = graph.number_of_nodes()
    core = nx.k_core(graph, max(k - q - 1, 0))
    flagged = frozenset(set(graph.nodes) - set(core.nodes))
    best: list[frozenset[int]] = []
    size = 0
    for clique in nx.find_cliques(core):
        if len(clique) > size:
            size, best = len(clique), [frozenset(clique)]
        elif len(clique) == size:
            best.append(frozenset(clique))
    if len(best) == 1 and size >= k - q:
        honest = best[0]
        return Detection(honest, frozenset(range(k)) - honest, 1, size)
    return Detection(None, flagged, len(best), size)


@dataclass
class WindowDetector:
    """Alg. 3 (Aspis+): degree counting over detection windows of `window` iterations."""

    workers: int
    q: int
    window: int
    edges: np.ndarray = field(init=False, repr=False)
    detected: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)  # worker -> (iteration, -degree)

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 <= self.q < self.workers:
            raise ValueError(f"need window >= 1 and 0 <= q < workers, got window={self.window}, q={self.q}")
        self.edges = ~np.eye(self.workers, dtype=bool)

    def observe(self, iteration: int, shared: np.ndarray, disagree: np.ndarray) -> Detection:
        """Fold one iteration's disagreements into the window's graph; return the flagged set."""
        if iteration % self.window == 0:
            self.edges = ~np.eye(self.workers, dtype=bool)
        self.edges &= (shared > 0) & (disagree == 0) | np.eye(self.workers, dtype=bool)
        np.fill_diagonal(self.edges, False)
        degrees = self.edges.sum(axis=1)
        for worker in np.nonzero(degrees < self.workers - self.q - 1)[0].tolist():
            self.detected[worker] = (iteration, -int(degrees[worker]))
        if len(self.detected) > self.q:
            keep = sorted(self.detected, key=lambda w: (self.detected[w], -w), reverse=True)[: self.q]
            self.detected = {w: self.detected[w] for w in keep}
        return Detection(None, frozenset(self.detected))


def majority_copy(file: Sequence[int], copies: Sequence[Copy], labels: Sequence[int], excluded: frozenset[int]) -> int | None:
    """Position of a copy that a strict majority of the non-excluded, present copies' workers agree on."""
    voters = [p for p, w in enumerate(file) if w not in excluded]
    tally: dict[int, list[int]] = {}
    for p in voters:
        tally.setdefault(labels[p], []).append(p)
    for positions in tally.values():
        if 2 * len(positions) > len(voters) and copies[positions[0]] is not None:
            return positions[0]
    return None


@dataclass(frozen=True)
class Aggregate:
    """The aggregated gradient (None when no file survived) and, per file, the worker whose copy was used."""

    vector: Tensor | None
    chosen: tuple[int | None, ...]
    robust: bool


def aggregate(
    assignment: Assignment,
    copies: Sequence[Sequence[Copy]],
    labels: Sequence[Sequence[int]],
    detection: Detection,
    robust: Callable[[Tensor], Tensor],
    samples_per_file: int = 1,
) -> Aggregate:
    """Alg. 2: honest copies after a successful detection, else majority per file then `robust`.

    Copies are per-file gradient sums; the result is on the per-sample scale
    (divided by `samples_per_file`).
    """
    chosen: list[int | None] = []
    if detection.success:
        honest = detection.honest
        for file, file_copies in zip(assignment.files, copies):
            pick = next((p for p, w in enumerate(file) if w in honest and file_copies[p] is not None), None)
            chosen.append(None if pick is None else file[pick])
    else:
        for file, file_copies, file_labels_ in zip(assignment.files, copies, labels):
            pick = majority_copy(file, file_copies, file_labels_, detection.flagged)
            chosen.append(None if pick is None else file[pick])
    rows = [
        file_copies[file.index(worker)]
        for file, file_copies, worker in zip(assignment.files, copies, chosen)
        if worker is not None
    ]
    if not rows:
        return Aggregate(None, tuple(chosen), not detection.success)
    stack = torch.stack(rows) / samples_per_file
    vector = stack.mean(dim=0) if detection.success else robust(stack)
    return Aggregate(vector, tuple(chosen), not detection.success)
