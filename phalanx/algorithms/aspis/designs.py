"""Aspis / Aspis+ task assignments: which workers compute which file of a batch.

An `Assignment` lists, for every file, the sorted indices of the workers that
compute it. Aspis (Sec. III-A1) puts the K workers and the C(K, r) files in
one-to-one correspondence with the r-subsets of {0..K-1}, so every pair of
workers shares C(K-2, r-2) files. Aspis+ (Sec. III-A2) uses the blocks of a
2-(v, k, lambda) design as files (every pair of points lies in exactly lambda
blocks), with the points permuted afresh every iteration. Steiner triple
systems 2-(v, 3, 1) are built for every admissible v (v = 1 or 3 mod 6) by the
Bose (3 mod 6) and Skolem (1 mod 6) constructions; any other design can be
given as blocks and is checked by `verify_design`. Pure, no I/O.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from ...core.errors import ConfigError

Block = tuple[int, ...]


@dataclass(frozen=True)
class Assignment:
    """Files as sorted tuples of worker indices in [0, workers)."""

    workers: int
    files: tuple[Block, ...]

    def __post_init__(self) -> None:
        for file in self.files:
            if not file or list(file) != sorted(set(file)) or file[0] < 0 or file[-1] >= self.workers:
                raise ValueError(f"file {file} must be a non-empty sorted tuple of distinct workers in [0, {self.workers})")

    @cached_property
    def files_of(self) -> tuple[tuple[int, ...], ...]:
        """For each worker, the indices of the files it computes (ascending)."""
        table: list[list[int]] = [[] for _ in range(self.workers)]
        for index, file in enumerate(self.files):
            for worker in file:
                table[worker].append(index)
        return tuple(tuple(row) for row in table)

    @cached_property
    def shared(self) -> list[list[int]]:
        """shared[a][b]: how many files workers a and b both compute."""
        counts = [[0] * self.workers for _ in range(self.workers)]
        for file in self.files:
            for a, b in itertools.combinations(file, 2):
                counts[a][b] += 1
                counts[b][a] += 1
        return counts

    @property
    def redundancy(self) -> int:
        """Copies per file when all files have the same size (else the largest)."""
        return max(len(f) for f in self.files)


def subset_assignment(workers: int, r: int) -> Assignment:
    """Aspis: one file per r-subset of the workers, in lexicographic order."""
    if not 1 <= r <= workers:
        raise ConfigError(f"aspis needs 1 <= r <= K, got r={r}, K={workers}")
    return Assignment(workers, tuple(itertools.combinations(range(workers), r)))


def group_assignment(workers: int, r: int) -> Assignment:
    """DETOX: K/r disjoint groups of r consecutive workers, one file per group."""
    if r < 1 or workers % r:
        raise ConfigError(f"detox needs K divisible by r, got K={workers}, r={r}")
    return Assignment(workers, tuple(tuple(range(g, g + r)) for g in range(0, workers, r)))


def single_assignment(workers: int) -> Assignment:
    """No redundancy: worker i alone computes file i."""
    return Assignment(workers, tuple((i,) for i in range(workers)))


def steiner_triple_system(v: int) -> tuple[Block, ...]:
    """Blocks of a 2-(v, 3, 1) design on points 0..v-1 (v = 1 or 3 mod 6, v >= 3)."""
    if v < 3 or v % 6 not in (1, 3):
        raise ConfigError(f"a Steiner triple system exists only for v = 1 or 3 mod 6 (v >= 3), got v={v}; try 7, 9, 13, 15, 19, 21, 25")
    blocks = _bose(v // 3) if v % 6 == 3 else _skolem((v - 1) // 6)
    return tuple(sorted(tuple(sorted(b)) for b in blocks))


def _bose(m: int) -> list[Block]:
    """Bose: points (x, i) of Z_m x Z_3 as 3x + i, with the idempotent commutative quasigroup x o y = (x + y)(m + 1)/2."""
    half = (m + 1) // 2

    def point(x: int, i: int) -> int:
        return 3 * x + i % 3

    blocks = [(point(x, 0), point(x, 1), point(x, 2)) for x in range(m)]
    for i in range(3):
        for x, y in itertools.combinations(range(m), 2):
            blocks.append((point(x, i), point(y, i), point((x + y) * half % m, i + 1)))
    return blocks


def _skolem(n: int) -> list[Block]:
    """Skolem: points (x, i) of Z_2n x Z_3 as 3x + i and infinity = 6n, with the half-idempotent
    commutative quasigroup x o y = s((x + y) mod 2n), s(2j) = j, s(2j + 1) = n + j."""
    infinity = 6 * n

    def point(x: int, i: int) -> int:
        return 3 * x + i % 3

    def op(x: int, y: int) -> int:
        total = (x + y) % (2 * n)
        return total // 2 if total % 2 == 0 else n + total // 2

    blocks = [(point(x, 0), point(x, 1), point(x, 2)) for x in range(n)]
    for i in range(3):
        for x in range(n):
            blocks.append((infinity, point(n + x, i), point(x, i + 1)))
        for x, y in itertools.combinations(range(2 * n), 2):
            blocks.append((point(x, i), point(y, i), point(op(x, y), i + 1)))
    return blocks


def verify_design(blocks: Iterable[Sequence[int]], v: int, k: int, lam: int = 1) -> None:
    """Raise ConfigError unless `blocks` form a 2-(v, k, lam) design on points 0..v-1."""
    counts: dict[tuple[int, int], int] = {}
    for block in blocks:
        points = sorted(block)
        if len(points) != k or len(set(points)) != k:
            raise ConfigError(f"block {tuple(block)} must hold {k} distinct points")
        if points[0] < 0 or points[-1] >= v:
            raise ConfigError(f"block {tuple(block)} has a point outside 0..{v - 1}")
        for pair in itertools.combinations(points, 2):
            counts[pair] = counts.get(pair, 0) + 1
    for pair in itertools.combinations(range(v), 2):
        if counts.get(pair, 0) != lam:
            raise ConfigError(f"points {pair} lie together in {counts.get(pair, 0)} blocks, not {lam}: not a 2-({v},{k},{lam}) design")


def design_assignment(blocks: Iterable[Sequence[int]], v: int, lam: int = 1) -> Assignment:
    """An Aspis+ assignment from any verified 2-(v, k, lam) design."""
    blocks = [tuple(sorted(b)) for b in blocks]
    if not blocks:
        raise ConfigError("a design needs at least one block")
    verify_design(blocks, v, len(blocks[0]), lam)
    return Assignment(v, tuple(blocks))


def permuted(assignment: Assignment, permutation: Sequence[int]) -> Assignment:
    """Relabel point p as permutation[p] (Aspis+ re-maps the design's points to workers every iteration)."""
    if sorted(permutation) != list(range(assignment.workers)):
        raise ValueError(f"not a permutation of 0..{assignment.workers - 1}: {list(permutation)}")
    return Assignment(assignment.workers, tuple(tuple(sorted(permutation[p] for p in f)) for f in assignment.files))


def iteration_permutation(stream: random.Random, workers: int) -> list[int]:
    """A uniformly random permutation of 0..workers-1 from a seeded stream."""
    order = list(range(workers))
    stream.shuffle(order)
    return order


def aspis_pair_share(workers: int, r: int) -> int:
    """C(K-2, r-2): files every pair of workers shares under the subset assignment."""
    return math.comb(workers - 2, r - 2)
