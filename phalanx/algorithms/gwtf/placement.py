"""GWTF V-B: the leader among data nodes and where joining relays go.

Leader: the smallest live data-node id. Every data node computes it from its
own live set, so no election round is needed; when the leader dies (its peers
see it leave), the next smallest id is the leader from the next placement
period on, and a joiner that asked the dead leader asks again after its
timeout. (GWTF says a robust election [17, 18] can be used; a deterministic
choice over the live ids is the simplest one that every honest node agrees on
once membership agrees.)

Utilization: the leader floods a `UtilQuery` to stage 0; each relay appends
its (stage, capacity, flow) and forwards it to its known next-stage peers; the
last stage returns it to the leader, which merges the copies. A stage's
utilization is the flow through it over its capacity.

Placement: candidates report their capacity; the leader gives the highest
capacity candidate the most utilized stage, the second the second, and so on
(cycling when there are more candidates than stages). Baselines: highest
capacity first over the stages in order, random, and brute force over all
assignments with a caller-given evaluation.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ...core.errors import LocalError


def leader(data_nodes: Iterable[str]) -> str:
    """The smallest live data-node id."""
    live = sorted(data_nodes)
    if not live:
        raise LocalError("no live data node to lead")
    return live[0]


@dataclass(frozen=True)
class UtilQuery:
    """A flooded utilization query: entries of (peer, stage, capacity, flow) gathered so far."""

    src: str
    dst: str
    leader: str
    period: int
    entries: tuple[tuple[str, int, int, int], ...]


def flood_step(query: UtilQuery, me: str, stage: int, capacity: int, flow: int,
               next_peers: Iterable[str]) -> list[UtilQuery]:
    """A relay adds its own entry (once) and forwards the query to its next-stage peers.

    The last stage passes the leader as its only next peer.
    """
    entries = query.entries
    if all(e[0] != me for e in entries):
        entries = tuple(sorted(entries + ((me, stage, capacity, flow),)))
    return [UtilQuery(me, p, query.leader, query.period, entries) for p in sorted(next_peers)]


def merge_entries(queries: Iterable[UtilQuery]) -> dict[str, tuple[int, int, int]]:
    """The leader's view: peer -> (stage, capacity, flow) from every copy that came back."""
    seen: dict[str, tuple[int, int, int]] = {}
    for q in queries:
        for peer, stage, capacity, flow in q.entries:
            seen[peer] = (stage, capacity, flow)
    return seen


def stage_utilization(entries: Mapping[str, tuple[int, int, int]], stages: int) -> dict[int, float]:
    """Flow over capacity per stage (a stage with no capacity is fully utilized)."""
    cap = [0] * stages
    flow = [0] * stages
    for stage, capacity, used in entries.values():
        if 0 <= stage < stages:
            cap[stage] += capacity
            flow[stage] += used
    return {k: (flow[k] / cap[k] if cap[k] else float("inf")) for k in range(stages)}


def place_joiners(candidates: Mapping[str, int], utilization: Mapping[int, float]) -> dict[str, int]:
    """GWTF: highest capacity -> most utilized stage, second -> second, ... (cycling)."""
    order = sorted(utilization, key=lambda k: (-utilization[k], k))
    ranked = sorted(candidates, key=lambda p: (-candidates[p], p))
    return {p: order[i % len(order)] for i, p in enumerate(ranked)}


def place_capacity_first(candidates: Mapping[str, int], stages: int) -> dict[str, int]:
    """Baseline: highest capacity first, to stages 0, 1, ... in order (ignores utilization)."""
    ranked = sorted(candidates, key=lambda p: (-candidates[p], p))
    return {p: i % stages for i, p in enumerate(ranked)}


def place_random(candidates: Mapping[str, int], stages: int, rng: random.Random) -> dict[str, int]:
    """Baseline: candidates in random order to a random permutation of the stages (cycling)."""
    peers = sorted(candidates)
    rng.shuffle(peers)
    order = list(range(stages))
    rng.shuffle(order)
    return {p: order[i % stages] for i, p in enumerate(peers)}


def place_optimal(candidates: Mapping[str, int], stages: int,
                  evaluate: Callable[[dict[str, int]], float]) -> dict[str, int]:
    """Brute force: every assignment of the candidates to distinct stages (cycling beyond S); lowest cost wins."""
    peers = sorted(candidates)
    best: tuple[float, dict[str, int]] | None = None
    for perm in itertools.permutations(range(stages), min(len(peers), stages)):
        assignment = {p: perm[i % len(perm)] for i, p in enumerate(peers)}
        cost = evaluate(assignment)
        if best is None or cost < best[0]:
            best = (cost, assignment)
    if best is None:
        return {}
    return best[1]
