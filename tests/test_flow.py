"""GWTF flow state machine on small graphs: optimum, capacity, crash, join, bad input, wire format."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from phalanx.algorithms.gwtf.config import FlowConfig
from phalanx.algorithms.gwtf.costs import edge_cost
from phalanx.algorithms.gwtf.flow import FlowNode
from phalanx.algorithms.gwtf.flowgraph import (
    FlowGraph,
    build_nodes,
    max_flow,
    optimal,
    random_graph,
    swarm_greedy,
)
from phalanx.algorithms.gwtf.messages import (
    MESSAGE_TYPES,
    Approve,
    FlowQuery,
    FlowReport,
    Offer,
    ReportedUnit,
    RequestFlow,
    from_wire,
    to_wire,
)
from phalanx.algorithms.gwtf.sync import SyncDriver
from phalanx.benchmarks.gwtf import split_demand
from phalanx.core.errors import ConfigError, RemoteError
from phalanx.core.rng import py_stream
from phalanx.core.serialization import decode, encode


def _graph(seed: int, sources: int = 1, relays: int = 9, stages: int = 3) -> FlowGraph:
    g = random_graph(py_stream(seed, "test-flow"), sources, relays, stages, (1, 4), (1, 20), demand=100)
    return replace(g, demand=split_demand(max_flow(g), sorted(g.data)))


def _converge(g: FlowGraph, seed: int, rounds: int = 60) -> SyncDriver:
    drv = SyncDriver(build_nodes(g, FlowConfig(), seed))
    drv.run(rounds)
    drv.settle(10)
    return drv


def test_edge_cost_is_eq1() -> None:
    # (c_i + c_j)/2 + (lat_ij + lat_ji)/2 + 2 size / (bw_ij + bw_ji)
    assert edge_cost(1.0, 3.0, 0.1, 0.3, 100.0, 300.0, 400.0) == pytest.approx(2.0 + 0.2 + 2.0)
    with pytest.raises(ConfigError):
        edge_cost(1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 10.0)
    with pytest.raises(ConfigError):
        edge_cost(math.nan, 1.0, 0.1, 0.1, 1.0, 1.0, 10.0)


def test_config_is_validated() -> None:
    assert FlowConfig().temperature == 1.7 and FlowConfig().cooling == 0.95
    with pytest.raises(ConfigError, match="cooling"):
        FlowConfig(cooling=1.5)
    with pytest.raises(ConfigError, match="objective"):
        FlowConfig(objective="min")


@pytest.mark.parametrize("seed", [0, 3, 5, 12])
def test_reaches_max_flow_near_the_networkx_optimum(seed: int) -> None:
    g = _graph(seed)
    value, best = optimal(g)
    drv = _converge(g, seed)
    assert drv.flow_value() == value
    assert drv.total_cost() <= 1.10 * best + 1e-9
    assert drv.total_cost() >= best - 1e-9  # never better than the optimum: the measure is honest
    for data, relays, cost in drv.paths():
        assert cost == pytest.approx(g.path_cost(data, relays))
        assert [g.stage_of(r) for r in relays] == [0, 1, 2]


def test_beats_swarm_greedy_where_greedy_is_trapped() -> None:
    # d -> a (1) -> x (1) -> d (100) vs d -> b (2) -> y (2) -> d (2): greedy takes the cheap first hop.
    g = FlowGraph(
        data=("d",), stages=(("a", "b"), ("x", "y")), capacity={"a": 1, "b": 1, "x": 1, "y": 1}, demand={"d": 1},
        cost={("d", "a"): 1.0, ("d", "b"): 2.0, ("a", "x"): 1.0, ("a", "y"): 50.0, ("b", "x"): 50.0,
              ("b", "y"): 2.0, ("x", "d"): 100.0, ("y", "d"): 2.0},
    )
    greedy = swarm_greedy(g)
    assert [c for _, _, c in greedy] == [102.0]
    drv = _converge(g, 1, rounds=40)
    assert drv.paths() == [("d", ["b", "y"], 6.0)]
    assert optimal(g) == (1, 6.0)


def test_capacity_is_never_exceeded() -> None:
    g = _graph(7, relays=12)
    drv = SyncDriver(build_nodes(g, FlowConfig(), 7))
    for _ in range(60):
        drv.round()
        for node in drv.nodes.values():
            if not node.is_data:
                assert len(node.units) <= node.capacity
        for data in g.data:
            node = drv.nodes[data]
            assert sum(u.kind == "source" for u in node.units) <= node.demand
            assert sum(u.kind == "sink" for u in node.units) <= node.demand


def test_each_data_node_gets_its_own_microbatches_back() -> None:
    g = _graph(4, sources=2, relays=12)
    drv = _converge(g, 4, rounds=80)
    paths = drv.paths()
    for data in g.data:
        assert sum(1 for d, _, _ in paths if d == data) == g.demand[data]
        assert drv.nodes[data].flows() == g.demand[data]
    assert drv.total_cost() >= optimal(g, len(paths))[1] - 1e-9


def test_crash_reroutes_flow_around_the_dead_relay() -> None:
    g = _graph(3, relays=12)
    drv = _converge(g, 3)
    assert drv.flow_value() == max_flow(g)
    used = sorted({r for _, relays, _ in drv.paths() for r in relays})
    victim = used[len(used) // 2]
    drv.remove(victim)
    drv.run(40)
    drv.settle(10)
    survivors = replace(
        g,
        stages=tuple(tuple(r for r in s if r != victim) for s in g.stages),
        capacity={r: c for r, c in g.capacity.items() if r != victim},
    )
    assert all(victim not in relays for _, relays, _ in drv.paths())
    assert drv.flow_value() == min(g.demand["d0"], max_flow(survivors))
    assert drv.total_cost() <= 1.10 * optimal(survivors, drv.flow_value())[1]


def test_a_cheap_joiner_takes_flow() -> None:
    g = _graph(5, relays=9)
    drv = _converge(g, 5)
    before = drv.total_cost()
    stage = 1
    joiner = FlowNode("new", stage, 4, len(g.stages), FlowConfig(), py_stream(5, "new"))
    drv.add(joiner)
    for other in g.stages[stage - 1] + g.stages[stage + 1]:
        drv.queue += joiner.add_peer(other, stage - 1 if other in g.stages[stage - 1] else stage + 1, 1.0)
        drv.queue += drv.nodes[other].add_peer("new", stage, 1.0)
    for other in g.stages[stage]:
        joiner.add_peer(other, stage, 0.0)
        drv.nodes[other].add_peer("new", stage, 0.0)
    drv.run(50)
    drv.settle(10)
    assert any("new" in relays for _, relays, _ in drv.paths())
    assert drv.flow_value() == g.demand["d0"]
    assert drv.total_cost() < before


def test_lost_messages_heal() -> None:
    g = _graph(8, relays=9)
    lose = py_stream(8, "lose")
    drv = SyncDriver(build_nodes(g, FlowConfig(), 8), drop=lambda m: lose.random() < 0.1)
    drv.run(80)
    drv.drop = None
    drv.run(20)
    drv.settle(10)
    assert drv.flow_value() == g.demand["d0"]
    for node in drv.nodes.values():  # no leaked capacity: every relay unit is on a complete path
        if not node.is_data:
            on_paths = sum(relays.count(node.peer) for _, relays, _ in drv.paths())
            assert sum(1 for u in node.units if u.upstream is not None) == on_paths


def test_same_seed_same_result() -> None:
    g = _graph(2)
    a, b = _converge(g, 2), _converge(g, 2)
    assert a.paths() == b.paths() and a.messages == b.messages


def test_bad_messages_are_evidence() -> None:
    node = FlowNode("r", 0, 2, 2, FlowConfig(), py_stream(0, "r"))
    node.add_peer("d", None, 1.0)
    node.add_peer("s", 1, 1.0)
    with pytest.raises(RemoteError) as bad:
        node.handle(Offer("s", "r", 1, (("d", math.nan, 1),)))
    assert bad.value.evidence.peer == "s" and bad.value.evidence.kind == "malformed"
    with pytest.raises(RemoteError) as wrong:
        node.handle(Offer("s", "r", 0, (("d", 1.0, 1),)))  # s serves stage 1, claims 0
    assert wrong.value.evidence.kind == "wrong_stage"
    with pytest.raises(RemoteError):
        node.handle(RequestFlow("d", "r", 1, "d", -3.0))
    # a stale reference (an approval for a request never made) is not evidence: the link is released
    out = node.handle(Approve("s", "r", 99, "d", "s/x/1", 2.0))
    assert [(type(m).__name__, m.dst, m.link) for m in out if not isinstance(m, Offer)] == [("Release", "s", "s/x/1")]
    assert node.units == ()


def test_wire_round_trip_and_garbage() -> None:
    msgs = [
        Offer("a", "b", 2, (("d", 1.5, 2),)),
        RequestFlow("a", "b", 3, "d", 4.0, "l1"),
        FlowQuery("a", "b"),
        FlowReport("a", "b", 1, 0, (ReportedUnit("d", "u", "l1", "v", "l2", 3.0, 1.0, 2.0),), (("v", 2.0),)),
    ]
    for msg in msgs:
        assert from_wire(to_wire(msg), "a", "b") == msg
        assert from_wire(decode(encode(to_wire(msg)), "a"), "a", "b") == msg  # through the canonical encoding
    assert set(MESSAGE_TYPES) >= {"Offer", "RequestFlow", "ChangeRequest", "RedirectRequest", "Deny"}
    for garbage in (None, {"type": "Nope", "body": {}}, {"type": "Offer", "body": {"stage": "x", "entries": []}},
                    {"type": "Offer", "body": {"stage": 1, "entries": [], "extra": 1}},
                    {"type": "Offer", "body": {"stage": 1, "entries": 5}},
                    {"type": "Audit", "body": {"sending": "l1", "receiving": []}},
                    {"type": "FlowReport", "body": {"stage": 1, "free": 0, "units": [{"sink": 1}], "next_costs": []}}):
        with pytest.raises(RemoteError):
            from_wire(garbage, "a", "b")


def test_routing_views_follow_the_paths() -> None:
    g = _graph(0, sources=2, relays=12)
    drv = _converge(g, 0, rounds=80)
    for data, relays, _ in drv.paths():
        hops = [data, *relays, data]
        assert hops[1] in drv.nodes[data].next_hops(data)
        for prev, here, nxt in zip(hops, hops[1:], hops[2:]):
            assert nxt in drv.nodes[here].routes(data, prev)
            assert drv.nodes[here].route(data, prev) in drv.nodes[here].routes(data, prev)


def test_mirror_change_requests_do_not_livelock() -> None:
    # a and b (stage 0) each hold one unit to d; after the costs flip, each wants the other's next
    # hop. Their queries fall in the same rounds (same phase parity), so each proposes the mirror
    # swap at once, locks its unit and refused the other's, every 4 rounds, forever. The smaller
    # id's request now goes first.
    cfg = FlowConfig(temperature=0.0)
    stage = {"d": None, "a": 0, "b": 0, "x": 1, "y": 1}
    nodes = [FlowNode("d", None, 2, 2, cfg, random.Random(1), demand=2),
             FlowNode("a", 0, 1, 2, cfg, random.Random(0)), FlowNode("b", 0, 1, 2, cfg, random.Random(0)),
             FlowNode("x", 1, 1, 2, cfg, random.Random(4)), FlowNode("y", 1, 1, 2, cfg, random.Random(5))]
    cost = {("a", "x"): 1.0, ("a", "y"): 5.0, ("b", "x"): 5.0, ("b", "y"): 1.0}
    for n in nodes:
        for other in nodes:
            if n is not other:
                n.add_peer(other.peer, stage[other.peer], cost.get((n.peer, other.peer), 1.0))
    drv = SyncDriver(nodes)
    a, b = nodes[1], nodes[2]
    assert a._phase % 2 == b._phase % 2  # they query in the same rounds
    drv.run(40)
    drv.settle(20)
    assert sorted(tuple(p) for _, p, _ in drv.paths()) == [("a", "x"), ("b", "y")]
    drv.queue += a.set_cost("x", 5.0) + a.set_cost("y", 1.0) + b.set_cost("x", 1.0) + b.set_cost("y", 5.0)
    drv.run(30)
    assert sorted(tuple(p) for _, p, _ in drv.paths()) == [("a", "y"), ("b", "x")]
    assert a.accepted_moves + b.accepted_moves == 1


def test_bench_demand_adds_up_to_the_max_flow() -> None:
    # max_flow // sources per source never asked for the remainder's units
    assert split_demand(13, ["a", "b"]) == {"a": 7, "b": 6}
    assert split_demand(1, ["a", "b", "c"]) == {"a": 1, "b": 1, "c": 1}


def _brute_force_home(g: FlowGraph, units: int) -> float:
    """Every way to send `units` microbatches, each along one path back to its own data node."""
    import itertools

    paths = [(d, hops) for d in g.data for hops in itertools.product(*g.stages)]
    best = math.inf
    for chosen in itertools.combinations_with_replacement(paths, units):
        load: dict[str, int] = {}
        for _, hops in chosen:
            for r in hops:
                load[r] = load.get(r, 0) + 1
        sent = {d: sum(1 for dd, _ in chosen if dd == d) for d in g.data}
        if all(load[r] <= g.capacity[r] for r in load) and all(sent[d] <= g.demand[d] for d in g.data):
            best = min(best, sum(g.path_cost(d, list(hops)) for d, hops in chosen))
    return best


def test_multi_commodity_optimum_returns_each_microbatch_home():
    # Crossing paths a -> p -> r -> b and b -> q -> t -> a are cheap: the single-commodity flow (the old
    # reference for several data nodes) takes them and is only a lower bound. The integer program sends
    # each microbatch home and equals an exhaustive search.
    from phalanx.algorithms.gwtf.flowgraph import multi_commodity_optimal

    cheap = {("a", "p"), ("b", "q"), ("p", "r"), ("q", "t"), ("r", "b"), ("t", "a")}
    layers = [("a", "b"), ("p", "q"), ("r", "t"), ("a", "b")]
    cost = {(x, y): 1.0 if (x, y) in cheap else 4.0 + len(x + y)
            for xs, ys in zip(layers, layers[1:]) for x in xs for y in ys}
    g = FlowGraph(("a", "b"), (("p", "q"), ("r", "t")), {"p": 1, "q": 1, "r": 1, "t": 1}, {"a": 1, "b": 1}, cost)
    per, home = multi_commodity_optimal(g)
    assert per == {"a": 1, "b": 1} and home == pytest.approx(_brute_force_home(g, 2))
    assert optimal(g, 2)[1] == pytest.approx(6.0) and home > 6.0 + 1
    g = replace(g, demand={"a": 2, "b": 2})  # capacity for 2: who gets it follows the costs
    per, home = multi_commodity_optimal(g)
    assert sum(per.values()) == 2 and home == pytest.approx(_brute_force_home(g, 2))
    assert multi_commodity_optimal(g, 1)[1] == pytest.approx(_brute_force_home(g, 1))


def _bottleneck() -> FlowGraph:
    cost = {("d0", "a"): 10.0, ("d1", "a"): 1.0, ("d0", "c"): 12.0, ("d1", "c"): 12.0,
            ("a", "b"): 1.0, ("c", "b"): 1.0, ("b", "d0"): 10.0, ("b", "d1"): 1.0}
    return FlowGraph(("d0", "d1"), (("a", "c"), ("b",)), {"a": 1, "c": 1, "b": 1}, {"d0": 1, "d1": 1}, cost)


def test_a_shared_bottleneck_goes_to_the_data_node_it_costs_least():
    # d0 and d1 both want the one chain through the bottleneck b; d0's Offer reaches b first (ids tick in
    # order), so b builds the chain towards d0, though it costs 21 there and 3 for d1. The chain must be
    # handed to d1 (the multi-commodity optimum), keeping its relays.
    from phalanx.algorithms.gwtf.flowgraph import multi_commodity_optimal

    g = _bottleneck()
    assert multi_commodity_optimal(g) == ({"d0": 0, "d1": 1}, 3.0)
    for seed in range(3):
        drv = _converge(g, seed, rounds=60)
        assert drv.paths() == [("d1", ["a", "b"], 3.0)]
        assert sum(n.handovers for n in drv.nodes.values()) == 1  # handed over once, not rebuilt
        assert all(not n._pending for n in drv.nodes.values())  # every lock released
    # with room for both, each data node keeps the chain it asked for: nobody is short, nothing is handed over
    g = replace(g, capacity={"a": 1, "c": 1, "b": 2})
    drv = _converge(g, 0, rounds=60)
    assert sorted(d for d, _, _ in drv.paths()) == ["d0", "d1"]
    assert sum(n.handovers for n in drv.nodes.values()) == 0


def _units_of(drv: SyncDriver, peer: str, sink: str):
    return [u for u in drv.nodes[peer]._units.values() if u.kind == "relay" and u.sink == sink]


def _deliver(drv: SyncDriver, msgs) -> list:
    return [reply for m in msgs if m.dst in drv.nodes for reply in drv.nodes[m.dst].handle(m)]


def test_a_forged_handover_answer_is_ignored():
    # b (stage 1) tells its stage-0 upstream a that the chain is now "ghost"'s, or d1's, though nobody asked
    # it; a must keep the chain d0's (before the fix a DENYed d0 and kept a unit labelled "ghost" for good)
    from phalanx.algorithms.gwtf.messages import Handover, HandoverQuery

    cost = {("d0", "a"): 1.0, ("d1", "a"): 5.0, ("d0", "c"): 1.0, ("d1", "c"): 5.0,
            ("a", "b"): 1.0, ("c", "b"): 1.0, ("a", "e"): 1.0, ("c", "e"): 1.0,
            ("b", "d0"): 1.0, ("b", "d1"): 5.0, ("e", "d0"): 1.0, ("e", "d1"): 5.0}
    g = FlowGraph(("d0", "d1"), (("a", "c"), ("b", "e")), {"a": 2, "c": 2, "b": 2, "e": 2}, {"d0": 1, "d1": 1}, cost)
    drv = _converge(g, 0, rounds=80)
    before = drv.paths()
    assert before == [("d0", ["a", "b"], 3.0), ("d1", ["a", "b"], 11.0)]
    u = next(u for u in _units_of(drv, "a", "d0") if u.downstream == "b")
    for sink in ("ghost", "d1"):  # a name that is no data node, and one that is
        drv.queue += drv.nodes["a"].handle(Handover("b", "a", u.out_link, sink, 0.0, True))
    drv.run(40)
    assert drv.paths() == before
    assert not any(x.sink == "ghost" for n in drv.nodes.values() for x in n.units)
    # asked about d1, b may answer for d1 only: a done naming another data node is a no, and unlocks a
    a = drv.nodes["a"]
    a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -1.0))  # the query is not delivered
    assert u.locked
    assert a.handle(Handover("b", "a", u.out_link, "ghost", 0.0, True)) == []
    assert (u.sink, u.upstream, u.locked) == ("d0", "d0", 0)


def _chain3() -> SyncDriver:
    # one chain d0 -> a -> m -> z -> d0; d1 is short of chains but costs more
    cost = {("d0", "a"): 1.0, ("d1", "a"): 1.0, ("a", "m"): 1.0, ("m", "z"): 1.0, ("z", "d0"): 1.0, ("z", "d1"): 50.0}
    g = FlowGraph(("d0", "d1"), (("a",), ("m",), ("z",)), {"a": 1, "m": 1, "z": 1}, {"d0": 1, "d1": 1}, cost)
    drv = _converge(g, 0, rounds=60)
    assert drv.paths() == [("d0", ["a", "m", "z"], 4.0)]
    return drv


def test_a_relay_leaving_mid_handover_unlocks_the_relays_above_at_once():
    from phalanx.algorithms.gwtf.messages import Handover, HandoverQuery

    drv = _chain3()
    a, m = drv.nodes["a"], drv.nodes["m"]
    (u,) = _units_of(drv, "a", "d0")
    to_z = _deliver(drv, a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -100.0)))
    assert [type(x) for x in to_z] == [HandoverQuery] and u.locked and m._pending  # a and m hold locks
    drv.nodes.pop("z")
    replies = m.peer_left("z")
    assert [(type(x), x.dst, x.done) for x in replies if isinstance(x, Handover)] == [(Handover, "a", False)]
    _deliver(drv, replies)
    assert not u.locked and not a._pending and not m._pending


def test_a_handover_query_is_refused_while_paused_and_ignored_when_off():
    from phalanx.algorithms.gwtf.messages import HandoverQuery

    drv = _chain3()
    a, m = drv.nodes["a"], drv.nodes["m"]
    (u,) = _units_of(drv, "a", "d0")
    m.optimising = False  # an iteration's microbatches are running: routes stay put
    (reply,) = _deliver(drv, a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -100.0)))
    assert (reply.dst, reply.done) == ("a", False) and not m._pending
    _deliver(drv, [reply])
    assert not u.locked and not a._pending
    m.optimising, m.config = True, replace(m.config, handover=False)  # handover off: queries are ignored
    assert _deliver(drv, a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -100.0))) == []
    assert not m._pending


def test_a_lost_handover_answer_heals():
    # b hands the chain to d1 but its Handover(done) to a is lost: a still says d0, b says d1. a never
    # acknowledges, so b breaks the link and the chain is rebuilt for d1 (before, d1 got no chain for good)
    from phalanx.algorithms.gwtf.messages import Handover

    lost: list = []

    def drop(msg) -> bool:
        if isinstance(msg, Handover) and msg.done and not lost:
            lost.append(msg)
            return True
        return False

    drv = SyncDriver(build_nodes(_bottleneck(), FlowConfig(), 0), drop=drop)
    drv.run(100)
    drv.settle(10)
    assert lost and drv.paths() == [("d1", ["a", "b"], 3.0)]


def _runtime_driver(node: FlowNode, in_iterations: bool):
    """The runtime's FlowDriver around a SyncDriver's node (pause() is what the pipeline calls)."""
    from types import SimpleNamespace

    from phalanx.runtime.pipeline.gwtf import FlowDriver

    transport = SimpleNamespace(peer_id=node.peer, add_message_handler=lambda topic, handler: None)
    driver = FlowDriver(transport, 2, 3, 1, 0, FlowConfig(), random.Random(0), 1.0, handover_in_iterations=in_iterations)
    driver.node = node
    return driver


def test_in_the_runtime_handover_ends_when_the_first_iteration_starts():
    # Table II in the paper's regime (session 20): a handover's round trip takes ~2 x (stages + 1) flow periods
    # (minutes), the runtime's quiet window between iterations is its aggregation (a second), so handovers
    # relabelled chains 2-9 s into an iteration. Under pipeline.flow_handover=warmup the runtime's FlowDriver
    # ends them at its first pause (a query is answered "no"); with `always` a query passes once the iteration
    # is over.
    from phalanx.algorithms.gwtf.messages import Handover, HandoverQuery

    for in_iterations in (False, True):
        drv = _chain3()
        a, m = drv.nodes["a"], drv.nodes["m"]
        (u,) = _units_of(drv, "a", "d0")
        driver = _runtime_driver(m, in_iterations)
        driver.pause(True)  # the iteration's first forward
        driver.pause(False)  # its aggregation: the flow may optimise again
        passed = _deliver(drv, a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -100.0)))
        assert bool(m._pending) == in_iterations
        assert [type(x) for x in passed] == [HandoverQuery if in_iterations else Handover]
        assert in_iterations or not passed[0].done  # a "no": a unlocks at once (before: dropped, a's lock expired)


def test_a_handover_answer_in_flight_is_taken_after_handovers_end():
    # Session 20 review (M2): m passed a handover query on to z, then m's first iteration began (warmup ends
    # its handovers) while z relabelled the chain to d1. Ending handovers used to drop every handover message
    # at m: z's Handover(done) was ignored, never acknowledged, and z DENYed its link to m, breaking the chain
    # mid-iteration. Only new probes and queries end; the answer in flight is taken and acknowledged.
    from phalanx.algorithms.gwtf.messages import Deny, Handover, HandoverQuery

    drv = _chain3()
    a, m, z = drv.nodes["a"], drv.nodes["m"], drv.nodes["z"]
    (u,) = _units_of(drv, "a", "d0")
    to_z = _deliver(drv, a._pass_query(u, HandoverQuery("d0", "a", u.in_link, "d0", "d1", -100.0)))
    _runtime_driver(m, False).pause(True)  # m's first iteration starts while the query is at z
    seen: list = []
    handle = m.handle
    m.handle = lambda msg: seen.append(msg) or handle(msg)
    drv.queue += to_z
    drv.run(60)
    assert z.handovers == 1 and any(isinstance(x, Handover) and x.done for x in seen)
    assert not any(isinstance(x, Deny) for x in seen)  # before: z broke its link to m
    assert {x.sink for p in "amz" for x in drv.nodes[p]._units.values() if x.kind == "relay"} == {"d1"}
