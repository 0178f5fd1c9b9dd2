"""Aspis / Aspis+ pure parts: designs, agreement graph, detection, aggregation, attacks."""

import itertools
import math
import random

import numpy as np
import pytest
import torch

from phalanx.algorithms.aspis.attacks import (
    Orchestration,
    detox_optimal_byzantine,
    distortion_fraction,
    symbolic_copies,
    theorem1_distorted,
)
from phalanx.algorithms.aspis.designs import (
    design_assignment,
    group_assignment,
    iteration_permutation,
    permuted,
    steiner_triple_system,
    subset_assignment,
    verify_design,
)
from phalanx.algorithms.aspis.detection import (
    Detection,
    WindowDetector,
    aggregate,
    agree,
    agreement_graph,
    detect_clique,
    disagreements,
    file_labels,
    shared_counts,
)
from phalanx.algorithms.robust.aggregators import coordinate_median
from phalanx.core.errors import ConfigError


@pytest.mark.parametrize("v", [3, 7, 9, 13, 15, 19, 21, 25, 27, 31, 63])
def test_steiner_triple_systems_are_designs(v):
    blocks = steiner_triple_system(v)
    assert len(blocks) == v * (v - 1) // 6
    verify_design(blocks, v, 3, 1)
    assert all(shared == 1 for a, row in enumerate(design_assignment(blocks, v).shared) for b, shared in enumerate(row) if a != b)


@pytest.mark.parametrize("v", [5, 8, 11, 2])
def test_inadmissible_orders_are_refused(v):
    with pytest.raises(ConfigError, match="1 or 3 mod 6"):
        steiner_triple_system(v)


def test_verify_design_names_the_bad_pair():
    fano = [(0, 1, 2), (0, 3, 6), (1, 3, 5), (2, 3, 4), (1, 4, 6), (0, 4, 5), (2, 5, 6)]
    verify_design(fano, 7, 3, 1)
    broken = fano[:-1] + [(2, 5, 4)]
    with pytest.raises(ConfigError, match=r"points \(2, 4\) lie together in 2 blocks"):
        verify_design(broken, 7, 3, 1)
    with pytest.raises(ConfigError, match="distinct"):
        verify_design([(0, 0, 1)], 3, 3, 1)


def test_permutation_keeps_the_design_and_changes_the_blocks():
    base = design_assignment(steiner_triple_system(15), 15)
    perm = iteration_permutation(random.Random(3), 15)
    moved = permuted(base, perm)
    verify_design(moved.files, 15, 3, 1)
    assert set(moved.files) != set(base.files)
    assert perm != iteration_permutation(random.Random(4), 15)


@pytest.mark.parametrize(("k", "r"), [(7, 3), (9, 3), (8, 4), (6, 2)])
def test_subset_assignment_pair_sharing(k, r):
    assignment = subset_assignment(k, r)
    assert len(assignment.files) == math.comb(k, r)
    expected = math.comb(k - 2, r - 2)
    assert all(assignment.shared[a][b] == expected for a, b in itertools.combinations(range(k), 2))
    assert np.array_equal(shared_counts(assignment), np.array(assignment.shared))
    assert all(len(files) == math.comb(k - 1, r - 1) for files in assignment.files_of)


def test_agreement_exact_and_tolerant():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a + 1e-7
    assert agree(a, a.clone()) and not agree(a, b)
    assert agree(a, b, tolerance=1e-5) and not agree(a, a * 1.01, tolerance=1e-5)
    assert not agree(a, None) and not agree(None, None)
    assert file_labels([a, None, a.clone(), b, None]) == [0, 1, 0, 2, 3]


def _graph(k, missing_edges):
    graph = agreement_graph(np.ones((k, k), dtype=int) - np.eye(k, dtype=int), np.zeros((k, k), dtype=int))
    graph.remove_edges_from(missing_edges)
    return graph


def test_unique_clique_detects_the_liars():
    # K = 7, q = 3: U0..U2 disagree with everybody (ATT-1, Fig. 2a).
    missing = [(a, b) for a in range(3) for b in range(7) if a != b]
    detection = detect_clique(_graph(7, missing), q=3)
    assert detection.success and detection.honest == frozenset({3, 4, 5, 6})
    assert detection.flagged == frozenset({0, 1, 2})


def test_two_maximum_cliques_fail_detection():
    # Fig. 2b: A = {0,1,2} disagree exactly with D = {3,4,5}; {0,1,2,6} and {3,4,5,6} tie.
    missing = [(a, d) for a in range(3) for d in range(3, 6)]
    detection = detect_clique(_graph(7, missing), q=3)
    assert not detection.success and detection.max_cliques == 2 and detection.clique_size == 4


def test_clique_smaller_than_k_minus_q_fails():
    missing = [(a, b) for a, b in itertools.combinations(range(7), 2) if (a + b) % 2]
    detection = detect_clique(_graph(7, missing), q=2)
    assert not detection.success


def test_degree_rule_across_a_window():
    k, q = 7, 2
    shared = np.ones((k, k), dtype=int) - np.eye(k, dtype=int)
    detector = WindowDetector(k, q, window=3)

    def disagree(pairs):
        d = np.zeros((k, k), dtype=int)
        for a, b in pairs:
            d[a, b] = d[b, a] = 1
        return d

    # Iteration 0: U0 disagrees with 3 and 4 only: degree 4 = K-q-1, not flagged yet.
    assert detector.observe(0, shared, disagree([(0, 3), (0, 4)])).flagged == frozenset()
    # Iteration 1: one more disagreement (0, 5); the removed edges stay removed: degree 3 -> flagged.
    assert detector.observe(1, shared, disagree([(0, 5)])).flagged == frozenset({0})
    # Iteration 2: U1 disagrees with three workers at once.
    assert detector.observe(2, shared, disagree([(1, 4), (1, 5), (1, 6)])).flagged == frozenset({0, 1})
    # Iteration 3: a new window starts from the complete graph; old flags persist (Alg. 3).
    assert detector.observe(3, shared, disagree([])).flagged == frozenset({0, 1})
    # Iteration 4: U2 is detected; more than q flagged, so the q most recently detected stay: U2 (4) and U1 (2).
    assert detector.observe(4, shared, disagree([(2, 3), (2, 4), (2, 5)])).flagged == frozenset({1, 2})
    # Iteration 6 (new window): U0 (detected again, with a fresh time) and U3 are the most recent: {0, 3}.
    flagged = detector.observe(6, shared, disagree([(0, 1), (0, 2), (0, 4), (0, 5), (3, 1), (3, 2), (3, 4)]))
    assert flagged.flagged == frozenset({0, 3})


def test_a_newly_detected_worker_displaces_an_old_one_inside_a_window():
    # q = 1: U0 (flagged at 0) keeps a low degree for the rest of the window; U1, detected at 1, is the most recent.
    k = 7
    shared = np.ones((k, k), dtype=int) - np.eye(k, dtype=int)
    detector = WindowDetector(k, q=1, window=10)
    first = np.zeros((k, k), dtype=int)
    for b in (2, 3, 4, 5):
        first[0, b] = first[b, 0] = 1
    assert detector.observe(0, shared, first).flagged == frozenset({0})
    second = np.zeros((k, k), dtype=int)
    for b in (4, 5):
        second[1, b] = second[b, 1] = 1
    assert detector.observe(1, shared, second).flagged == frozenset({1})


@pytest.mark.parametrize(("k", "q"), [(7, 2), (7, 3), (9, 3), (11, 4), (15, 5)])
def test_att2_distortion_equals_theorem1(k, q):
    r = 3
    assignment = subset_assignment(k, r)
    byzantine = frozenset(random.Random(k * q).sample(range(k), q))
    targets = frozenset(sorted(set(range(k)) - byzantine)[:q])
    plan = Orchestration("att2", k, q, byzantine, targets)
    copies = symbolic_copies(assignment, plan, 0)
    labels = [file_labels(c) for c in copies]
    graph = agreement_graph(shared_counts(assignment), disagreements(assignment, labels))
    detection = detect_clique(graph, q)
    assert not detection.success and detection.max_cliques == 2
    result = aggregate(assignment, copies, labels, detection, coordinate_median)
    assert distortion_fraction(assignment, copies, result.chosen) == theorem1_distorted(k, r, q) / math.comb(k, r)


def test_att1_detected_and_only_all_byzantine_files_lost():
    k, r, q = 9, 3, 3
    assignment = subset_assignment(k, r)
    plan = Orchestration("att1", k, q, frozenset({1, 4, 7}))
    copies = symbolic_copies(assignment, plan, 0)
    labels = [file_labels(c) for c in copies]
    detection = detect_clique(agreement_graph(shared_counts(assignment), disagreements(assignment, labels)), q)
    assert detection.success and detection.flagged == frozenset({1, 4, 7})
    result = aggregate(assignment, copies, labels, detection, coordinate_median)
    assert result.chosen.count(None) == 1  # the file {1, 4, 7}
    assert distortion_fraction(assignment, copies, result.chosen) == 1 / math.comb(k, r)


def test_majority_vote_and_robust_rule_when_detection_fails():
    assignment = group_assignment(6, 3)
    g = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 3.0])]
    lie = torch.tensor([-50.0, -50.0])
    copies = [[g[0], lie, g[0]], [lie, lie, g[1]]]
    labels = [file_labels(c) for c in copies]
    result = aggregate(assignment, copies, labels, Detection(None, frozenset()), coordinate_median, samples_per_file=2)
    assert result.chosen == (0, 3)
    assert torch.equal(result.vector, coordinate_median(torch.stack([g[0], lie]).div(2)))
    # Flagged workers lose their vote: the second file is decided by worker 5 alone.
    flagged = aggregate(assignment, copies, labels, Detection(None, frozenset({1, 3, 4})), coordinate_median)
    assert flagged.chosen == (0, 5)


def test_att3_redraws_and_distorts_only_majority_files():
    base = design_assignment(steiner_triple_system(15), 15)
    plan = Orchestration("att3", 15, 4, redraw_every=50, seed=1)
    assert plan.byzantine_at(0) == plan.byzantine_at(49) != plan.byzantine_at(50)
    bad = plan.byzantine_at(0)
    files = plan.distorted_files(0, base)
    assert files and all(sum(w in bad for w in base.files[i]) >= 2 for i in files)
    assert all(sum(w in bad for w in f) < 2 for i, f in enumerate(base.files) if i not in files)


def test_detox_optimal_byzantine_fills_groups_with_majorities():
    assert detox_optimal_byzantine(15, 3, 5) == frozenset({0, 1, 3, 4, 6})
    plan = Orchestration("majority", 15, 5, detox_optimal_byzantine(15, 3, 5))
    assert plan.distorted_files(0, group_assignment(15, 3)) == frozenset({0, 1})


def test_distortion_table_matches_the_papers_table_iii():
    from phalanx.benchmarks.aspis import PAPER_TABLE_III, distortion_table

    rows = distortion_table(15, 3, list(range(2, 8)))
    for key, paper in PAPER_TABLE_III.items():
        assert [round(row[key], 3) for row in rows] == pytest.approx(paper, abs=1e-3), key


def test_failed_detection_flags_nobody_even_when_the_core_collapses():
    # q = 2 ATT-2 liars {0, 1} against D = {2, 3}, plus a silent worker 4: more than q misbehave,
    # peeling the (K-q-1)-core removes everyone, yet the vote must still count every copy.
    k, q = 15, 2
    missing = [(a, d) for a in (0, 1) for d in (2, 3)] + [(4, w) for w in range(k) if w != 4]
    detection = detect_clique(_graph(k, missing), q)
    assert not detection.success and detection.flagged == frozenset()
