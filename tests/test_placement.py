"""GWTF joiner placement (V-B): leader, flooded utilization, bottleneck placement, brute-force optimum."""

from __future__ import annotations

import pytest

from phalanx.algorithms.gwtf.flowgraph import FlowGraph, node_flows, optimal
from phalanx.algorithms.gwtf.placement import (
    UtilQuery,
    flood_step,
    leader,
    merge_entries,
    place_capacity_first,
    place_joiners,
    place_optimal,
    place_random,
    stage_utilization,
)
from phalanx.core.errors import LocalError
from phalanx.core.rng import py_stream


def test_leader_is_deterministic_and_survives_its_death() -> None:
    live = ["d7", "d2", "d5"]
    assert leader(live) == leader(reversed(live)) == "d2"
    live.remove("d2")  # the leader died: everyone picks the next one from the same live set
    assert leader(live) == "d5"
    with pytest.raises(LocalError):
        leader([])


def _chain(caps: list[list[int]]) -> FlowGraph:
    stages = tuple(tuple(f"r{k}.{i}" for i in range(len(c))) for k, c in enumerate(caps))
    capacity = {r: c for s, cs in zip(stages, caps) for r, c in zip(s, cs)}
    layers = [("d",), *stages, ("d",)]
    cost = {(a, b): 1.0 for la, lb in zip(layers, layers[1:]) for a in la for b in lb}
    return FlowGraph(("d",), stages, capacity, {"d": 100}, cost)


def _flooded_utilization(g: FlowGraph) -> dict[int, float]:
    flows = node_flows(g)
    entries: tuple = ()
    copies: list[UtilQuery] = []
    for k, members in enumerate(g.stages):
        targets = g.stages[k + 1] if k + 1 < len(g.stages) else g.data
        copies = []
        for r in members:
            copies += flood_step(UtilQuery("x", r, "d", 1, entries), r, k, g.capacity[r], flows[r], targets)
        entries = tuple(sorted((p, *v) for p, v in merge_entries(copies).items()))
    assert all(q.dst == "d" for q in copies)
    return stage_utilization(merge_entries(copies), len(g.stages))


def test_joiner_goes_to_the_bottleneck_stage() -> None:
    g = _chain([[3, 3], [1, 1], [4, 2]])  # stage 1 (capacity 2) limits the flow to 2
    util = _flooded_utilization(g)
    assert util == {0: pytest.approx(2 / 6), 1: pytest.approx(1.0), 2: pytest.approx(2 / 6)}
    placed = place_joiners({"small": 1, "big": 5, "mid": 3}, util)
    assert placed["big"] == 1  # highest capacity -> most utilized stage
    assert placed["mid"] == 0 and placed["small"] == 2  # ties broken by stage number
    # and it is the right call: the flow grows only when the bottleneck grows
    g2 = _chain([[3, 3], [1, 1, 5], [4, 2]])
    assert optimal(g2)[0] == 6 > optimal(g)[0]


def test_utilization_follows_the_flow_not_the_node_count() -> None:
    g = _chain([[1, 1, 1, 1], [5], [2, 2]])  # stage 1 has one node but the most capacity
    util = _flooded_utilization(g)
    assert max(util, key=util.get) == 0


def test_brute_force_optimum_on_a_tiny_case() -> None:
    base = [[2], [1], [2]]

    def cost(assignment: dict[str, int]) -> float:
        caps = [list(c) for c in base]
        for peer, stage in assignment.items():
            caps[stage].append({"a": 1, "b": 2, "c": 3}[peer])
        value, total = optimal(_chain(caps))
        return total / value * (10 / value)

    best = place_optimal({"a": 1, "b": 2, "c": 3}, 3, cost)
    brute = min(
        ({"a": x, "b": y, "c": z} for x in range(3) for y in range(3) for z in range(3) if len({x, y, z}) == 3),
        key=cost,
    )
    assert cost(best) == cost(brute)
    stage1 = [p for p, k in best.items() if k == 1]
    assert stage1 and stage1[0] in ("b", "c")  # the bottleneck gets one of the big joiners
    assert cost(best) < cost({"a": 1, "b": 0, "c": 2})


def test_baselines_assign_everyone() -> None:
    cands = {f"j{i}": i + 1 for i in range(5)}
    first = place_capacity_first(cands, 3)
    assert first["j4"] == 0 and first["j3"] == 1 and first["j2"] == 2 and first["j1"] == 0
    rnd = place_random(cands, 3, py_stream(1, "place"))
    assert set(rnd) == set(cands) and set(rnd.values()) <= {0, 1, 2}
    assert rnd == place_random(cands, 3, py_stream(1, "place"))
