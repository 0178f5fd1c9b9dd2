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
degree pre-filter), enumerate maximal cliques (networkx) among the core
workers that do not agree with the whole core, and declare the unique maximum
clique honest; two or more maximum cliques, or one smaller than
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

from .designs import Assignment

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


def _pair_counts(assignment: Assignment, keep: Callable[[int, int], np.ndarray] | None) -> np.ndarray:
    """K x K symmetric counts over files of worker pairs (i-th, j-th member) where keep(i, j) holds."""
    k = assignment.workers
    counts = np.zeros(k * k, dtype=np.int64)
    if not assignment.files:
        return counts.reshape(k, k)
    size = len(assignment.files[0])
    if any(len(f) != size for f in assignment.files):
        raise ValueError("pair counts need files of equal size")
    members = np.asarray(assignment.files, dtype=np.int64)
    for i in range(size):
        for j in range(i + 1, size):
            index = members[:, i] * k + members[:, j]
            if keep is not None:
                index = index[keep(i, j)]
            counts += np.bincount(index, minlength=k * k)
    counts = counts.reshape(k, k)
    return counts + counts.T


def disagreements(assignment: Assignment, labels: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """K x K counts of shared files on which two workers' copies fall in different classes."""
    classes = np.asarray(labels, dtype=np.int64).reshape(len(assignment.files), -1) if assignment.files else None
    return _pair_counts(assignment, lambda i, j: classes[:, i] != classes[:, j])


def shared_counts(assignment: Assignment) -> np.ndarray:
    """K x K counts of files two workers share (vectorised `Assignment.shared`)."""
    return _pair_counts(assignment, None)


def agreement_matrix(shared: np.ndarray, disagree: np.ndarray) -> np.ndarray:
    """Boolean adjacency: two workers share at least one file and never disagree."""
    adjacency = (shared > 0) & (disagree == 0)
    np.fill_diagonal(adjacency, False)
    return adjacency


def agreement_graph(shared: np.ndarray, disagree: np.ndarray) -> nx.Graph:
    """The agreement matrix as a networkx graph on workers 0..K-1."""
    return _graph_of(agreement_matrix(shared, disagree), list(range(shared.shape[0])))


def _graph_of(adjacency: np.ndarray, names: list[int]) -> nx.Graph:
    graph = nx.Graph()
    graph.add_nodes_from(names)
    rows, cols = np.nonzero(np.triu(adjacency, 1))
    graph.add_edges_from((names[a], names[b]) for a, b in zip(rows.tolist(), cols.tolist()))
    return graph


@dataclass(frozen=True)
class Detection:
    """Outcome of one detection: `honest` is None when detection failed; `flagged` workers lose their votes."""

    honest: frozenset[int] | None
    flagged: frozenset[int]
    max_cliques: int = 0
    clique_size: int = 0

    @property
    def success(self) -> bool:
        return self.honest is not None


def degree_core(adjacency: np.ndarray, min_degree: int) -> np.ndarray:
    """Indices of the min_degree-core: repeatedly drop workers with fewer agreeing neighbours left."""
    alive = np.ones(adjacency.shape[0], dtype=bool)
    while True:
        degrees = (adjacency & alive[None, :]).sum(axis=1)
        drop = alive & (degrees < min_degree)
        if not drop.any():
            return np.nonzero(alive)[0]
        alive &= ~drop


def detect_clique(graph: nx.Graph | np.ndarray, q: int) -> Detection:
    """Alg. 1 with the degree pre-filter: a unique maximum clique of >= K-q workers is the honest set.

    Only the (K-q-1)-core can hold a clique of K-q workers. A core worker that
    agrees with the whole core lies in every maximal clique of it, so networkx
    enumerates maximal cliques only among the disputed core workers (none
    under ATT-1; A u D under ATT-2).
    """
    if isinstance(graph, nx.Graph):
        graph = nx.to_numpy_array(graph, nodelist=range(graph.number_of_nodes()), dtype=bool)
    k = graph.shape[0]
    core = degree_core(graph, max(k - q - 1, 0))
    sub = graph[np.ix_(core, core)]
    universal = sub.sum(axis=1) == len(core) - 1  # agree with the whole core: in every maximal clique of it
    common = frozenset(core[universal].tolist())
    disputed = core[~universal].tolist()
    best: list[frozenset[int]] = []
    size = 0
    if not disputed:
        best, size = [common], len(common)
    else:
        for clique in nx.find_cliques(_graph_of(graph[np.ix_(disputed, disputed)], disputed)):
            if len(clique) + len(common) > size:
                size, best = len(clique) + len(common), [common | frozenset(clique)]
            elif len(clique) + len(common) == size:
                best.append(common | frozenset(clique))
    if len(best) == 1 and size >= k - q:
        honest = best[0]
        return Detection(honest, frozenset(range(k)) - honest, 1, size)
    # Failed: Alg. 2 votes over every copy. (Peeling the core can cascade when more than q workers
    # misbehave, e.g. q Byzantines plus a silent worker, so its leftovers are no verdict.)
    return Detection(None, frozenset(), len(best), size)


@dataclass
class WindowDetector:
    """Alg. 3 (Aspis+): degree counting over detection windows of `window` iterations.

    A worker's detection time is the first iteration of the current window at
    which its degree fell below K-q-1 (its edges stay removed for the rest of
    the window, so it would otherwise be "re-detected" every iteration and an
    old Byzantine could hold a slot against a newly detected one). When more
    than q workers are flagged, the q most recently detected are kept (ties:
    the lower degree at detection, then the lower index).
    """

    workers: int
    q: int
    window: int
    edges: np.ndarray = field(init=False, repr=False)
    detected: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)  # flagged: worker -> (iteration, -degree)
    first_seen: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)  # this window's detections

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 <= self.q < self.workers:
            raise ValueError(f"need window >= 1 and 0 <= q < workers, got window={self.window}, q={self.q}")
        self.edges = ~np.eye(self.workers, dtype=bool)

    def observe(self, iteration: int, shared: np.ndarray, disagree: np.ndarray) -> Detection:
        """Fold one iteration's disagreements into the window's graph; return the flagged set."""
        if iteration % self.window == 0:
            self.edges = ~np.eye(self.workers, dtype=bool)
            self.first_seen = {}
        self.edges &= agreement_matrix(shared, disagree)
        degrees = self.edges.sum(axis=1)
        for worker in np.nonzero(degrees < self.workers - self.q - 1)[0].tolist():
            self.detected[worker] = self.first_seen.setdefault(worker, (iteration, -int(degrees[worker])))
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
