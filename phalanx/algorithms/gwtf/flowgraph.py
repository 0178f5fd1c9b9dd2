"""Static staged graphs for GWTF's flow tests, their optimum and SWARM's greedy baseline.

A `FlowGraph` is the global picture a benchmark knows and no peer does: data
nodes, relays per stage, capacities, and the edge cost d(i, j) of every link
between consecutive stages (data -> stage 0, stage k -> stage k+1, last stage
-> data). `optimal` solves the single-commodity min-cost flow with networkx
(node capacities by node splitting); with several data nodes it is a lower
bound, because GWTF must return each microbatch to its own data node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import networkx as nx

from ...core.errors import LocalError
from ...core.rng import py_stream
from .config import FlowConfig
from .flow import FlowNode

_SCALE = 1000  # network_simplex wants integer weights: costs are rounded to 1/1000


@dataclass(frozen=True)
class FlowGraph:
    data: tuple[str, ...]
    stages: tuple[tuple[str, ...], ...]
    capacity: dict[str, int]
    demand: dict[str, int]
    cost: dict[tuple[str, str], float]

    def next_of(self, node: str) -> tuple[str, ...]:
        """Peers of the following stage (data nodes follow the last stage)."""
        if node in self.data:
            return self.stages[0]
        k = self.stage_of(node)
        return self.stages[k + 1] if k + 1 < len(self.stages) else self.data

    def stage_of(self, node: str) -> int:
        for k, members in enumerate(self.stages):
            if node in members:
                return k
        raise KeyError(node)

    def d(self, i: str, j: str) -> float:
        return self.cost[(i, j)] if (i, j) in self.cost else self.cost[(j, i)]

    def path_cost(self, data: str, relays: list[str]) -> float:
        hops = [data, *relays, data]
        return sum(self.d(a, b) for a, b in zip(hops, hops[1:]))


def random_graph(
    rng: random.Random,
    sources: int,
    relays: int,
    stages: int,
    capacity: tuple[int, int],
    link_cost: tuple[int, int],
    demand: int,
) -> FlowGraph:
    """GWTF Table V style: floor(U(a, b)) capacities and link costs, relays spread over stages."""
    data = tuple(f"d{i}" for i in range(sources))
    per = [relays // stages + (1 if k < relays % stages else 0) for k in range(stages)]
    members = tuple(tuple(f"r{k}.{i}" for i in range(per[k])) for k in range(stages))
    caps = {r: int(rng.uniform(*capacity)) for stage in members for r in stage}
    layers = [data, *members, data]
    cost: dict[tuple[str, str], float] = {}
    for a_layer, b_layer in zip(layers, layers[1:]):
        for a in a_layer:
            for b in b_layer:
                key = (a, b)
                if key not in cost and (b, a) not in cost:
                    cost[key] = float(int(rng.uniform(*link_cost)))
    return FlowGraph(data, members, caps, {d: demand for d in data}, cost)


def build_nodes(graph: FlowGraph, config: FlowConfig, seed: int) -> list[FlowNode]:
    """One FlowNode per peer, each knowing only its neighbours and its own edge costs."""
    S = len(graph.stages)
    nodes: list[FlowNode] = []
    for d in graph.data:
        nodes.append(FlowNode(d, None, 0, S, config, py_stream(seed, d, "gwtf-flow"), demand=graph.demand[d]))
    for k, members in enumerate(graph.stages):
        for r in members:
            nodes.append(FlowNode(r, k, graph.capacity[r], S, config, py_stream(seed, r, "gwtf-flow")))
    by = {n.peer: n for n in nodes}
    for n in nodes:
        for other in neighbours(graph, n.peer):
            stage = None if other in graph.data else graph.stage_of(other)
            cost = graph.d(n.peer, other) if ((n.peer, other) in graph.cost or (other, n.peer) in graph.cost) else 0.0
            n.add_peer(other, stage, cost)
    assert set(by) == {n.peer for n in nodes}
    return nodes


def neighbours(graph: FlowGraph, peer: str) -> list[str]:
    """Previous, same and next stage peers (a data node: stage 0 and the last stage)."""
    if peer in graph.data:
        return sorted(set(graph.stages[0]) | set(graph.stages[-1]))
    k = graph.stage_of(peer)
    prev = graph.stages[k - 1] if k > 0 else graph.data
    nxt = graph.stages[k + 1] if k + 1 < len(graph.stages) else graph.data
    return sorted((set(prev) | set(graph.stages[k]) | set(nxt)) - {peer})


def _network(graph: FlowGraph) -> nx.DiGraph:
    g = nx.DiGraph()
    for d in graph.data:
        g.add_edge("SRC", ("out", d), capacity=graph.demand[d], weight=0)
        g.add_edge(("in", d), "SNK", capacity=graph.demand[d], weight=0)
    for members in graph.stages:
        for r in members:
            g.add_edge(("in", r), ("out", r), capacity=graph.capacity[r], weight=0)
    layers = [graph.data, *graph.stages, graph.data]
    for a_layer, b_layer in zip(layers, layers[1:]):
        for a in a_layer:
            for b in b_layer:
                g.add_edge(("out", a), ("in", b), weight=round(graph.d(a, b) * _SCALE))
    return g


def optimal(graph: FlowGraph, value: int | None = None) -> tuple[int, float]:
    """(flow value, min total cost): max flow when `value` is None, else exactly `value` units."""
    g = _network(graph)
    if value is None:
        flow = nx.max_flow_min_cost(g, "SRC", "SNK")
        value = sum(flow["SRC"].values())
    else:
        g.nodes["SRC"]["demand"] = -value
        g.nodes["SNK"]["demand"] = value
        _, flow = nx.network_simplex(g)
    total = sum(g[a][b]["weight"] * f for a, row in flow.items() for b, f in row.items())
    return value, total / _SCALE


def node_flows(graph: FlowGraph) -> dict[str, int]:
    """Microbatches through each relay in a min-cost max flow."""
    flow = nx.max_flow_min_cost(_network(graph), "SRC", "SNK")
    return {r: flow[("in", r)][("out", r)] for members in graph.stages for r in members}


def max_flow(graph: FlowGraph) -> int:
    return int(nx.maximum_flow_value(_network(graph), "SRC", "SNK"))


def swarm_greedy(graph: FlowGraph) -> list[tuple[str, list[str], float]]:
    """SWARM's choice as GWTF's flow tests model it: each hop goes to the closest next-stage peer with room.

    Data nodes take turns sending one microbatch until their demand is met or no
    path with free capacity is left.
    """
    free = dict(graph.capacity)
    left = dict(graph.demand)
    paths: list[tuple[str, list[str], float]] = []
    active = list(graph.data)
    while active:
        for d in list(active):
            hops: list[str] = []
            here = d
            for members in graph.stages:
                room = [r for r in members if free[r] > 0]
                if not room:
                    break
                here = min(room, key=lambda r, h=here: (graph.d(h, r), r))
                hops.append(here)
            if len(hops) < len(graph.stages) or left[d] <= 0:
                active.remove(d)
                continue
            for r in hops:
                free[r] -= 1
            left[d] -= 1
            paths.append((d, hops, graph.path_cost(d, hops)))
    return paths


def multi_commodity_optimal(graph: FlowGraph, value: int | None = None) -> tuple[dict[str, int], float]:
    """The multi-commodity optimum, in which each microbatch returns to its own data node, as an
    integer program (scipy's HiGHS): (units per data node, min total cost). With `value` None it
    first finds the most units the graph carries home (each data node at most its demand), then the
    cheapest way to carry that many; otherwise exactly `value` units. One integer variable per data
    node and link: small graphs (Table V's settings take well under a second)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    layers = [graph.data, *graph.stages, graph.data]
    links = [(a, b) for a_layer, b_layer in zip(layers, layers[1:]) for a in a_layer for b in b_layer]
    relays = [r for members in graph.stages for r in members]
    # variable (k, a, b): units of data node k's microbatches on link a -> b; only k's own data links
    var = [(k, a, b) for k in graph.data for a, b in links
           if not (a in graph.data and a != k) and not (b in graph.data and b != k)]
    cons = {(k, r): i for i, (k, r) in enumerate((k, r) for k in graph.data for r in relays)}  # conservation
    sent = {k: len(cons) + i for i, k in enumerate(graph.data)}  # units data node k sends
    cap = {r: len(cons) + len(sent) + i for i, r in enumerate(relays)}  # shared relay capacity
    total = len(cons) + len(sent) + len(cap)  # all units sent
    rows, cols, vals = [], [], []
    for j, (k, a, b) in enumerate(var):
        entries = [(total, 1.0), (sent[k], 1.0)] if a == k else [(cons[(k, a)], -1.0), (cap[a], 1.0)]
        if b != k:
            entries.append((cons[(k, b)], 1.0))
        for i, v in entries:
            rows.append(i)
            cols.append(j)
            vals.append(v)
    matrix = coo_matrix((vals, (rows, cols)), shape=(total + 1, len(var))).tocsr()
    lower = np.zeros(total + 1)
    upper = np.array([0.0] * len(cons) + [graph.demand[k] for k in graph.data] + [graph.capacity[r] for r in relays]
                     + [np.inf])
    cost = np.array([graph.d(a, b) for _, a, b in var])
    integral = np.ones(len(var))
    bounds = Bounds(np.zeros(len(var)), np.full(len(var), np.inf))
    if value is None:
        most = milp(-matrix[total].toarray().ravel(), integrality=integral, bounds=bounds,
                    constraints=LinearConstraint(matrix, lower, upper))
        if not most.success:
            raise LocalError(f"multi-commodity max flow: {most.message}")
        value = int(round(-most.fun))
    lower[total] = upper[total] = value
    best = milp(cost, integrality=integral, bounds=bounds, constraints=LinearConstraint(matrix, lower, upper))
    if not best.success:
        raise LocalError(f"no multi-commodity flow of {value} units: {best.message}")
    x = np.round(best.x)
    per = {k: int(sum(x[j] for j, (kk, a, _) in enumerate(var) if kk == k and a == k)) for k in graph.data}
    return per, float(cost @ x)
