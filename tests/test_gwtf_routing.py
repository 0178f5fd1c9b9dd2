"""GWTF's runtime router (`FlowRouter`): which next peer a microbatch takes, given the node's flow units."""

from __future__ import annotations

import dataclasses

from phalanx.benchmarks.secure_pipeline import SecurePipelineConfig, run_config
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline.gwtf import FlowRouter
from phalanx.runtime.pipeline.routing import RepairRouter


class Units:
    """A flow node's routing queries (`FlowState.route`, `routes`, `next_hops`) over fixed units (upstream, downstream)
    towards sink D."""

    def __init__(self, units: list[tuple[str, str]]) -> None:
        self.units = units

    def routes(self, sink: str, upstream: str) -> dict[str, int]:
        hops: dict[str, int] = {}
        for up, down in self.units:
            if sink == "D" and up == upstream:
                hops[down] = hops.get(down, 0) + 1
        return dict(sorted(hops.items()))

    def route(self, sink: str, upstream: str) -> str | None:
        hops = self.routes(sink, upstream)
        return next(iter(hops), None)

    def next_hops(self, sink: str) -> dict[str, int]:
        hops: dict[str, int] = {}
        for _, down in self.units:
            hops[down] = hops.get(down, 0) + 1
        return dict(sorted(hops.items()))


def test_a_stage_one_relay_spreads_its_data_nodes_microbatches_over_its_units():
    """A stage-1 relay's three units all come from its data node and go to three stage-2 relays (session 22's clean
    seed-0 run: relay 0's units to 7, 1 and 10). Three microbatches in flight go one to each, as the units say,
    not all to the first (which left relay 10 idle and doubled relay 7's load)."""
    router = FlowRouter(Units([("D", "r7"), ("D", "r1"), ("D", "r10")]), RepairRouter(0.3, 20.0))
    load: dict[str, int] = {}
    for _ in range(3):
        peer = router.choose(2, ["r1", "r10", "r4", "r7"], "D", "D", load)
        assert router.last_branch == "paired"
        load[peer] = load.get(peer, 0) + 1
    assert load == {"r1": 1, "r10": 1, "r7": 1}


def test_units_from_distinct_upstreams_keep_their_pairing():
    """A stage-2 relay's units each come from another stage-1 relay: a microbatch goes where its upstream's unit goes,
    whatever the load elsewhere."""
    router = FlowRouter(Units([("r0", "r5"), ("r3", "r8"), ("r6", "r11")]), RepairRouter(0.3, 20.0))
    assert router.choose(3, ["r11", "r2", "r5", "r8"], "D", "r3", {"r8": 2}) == "r8"
    assert router.choose(3, ["r11", "r2", "r5", "r8"], "D", "r0", {}) == "r5"


def test_in_the_bench_preset_every_relay_of_a_stage_serves_its_share():
    """secure-gpt-pipeline (4 relays of capacity 3 per stage, 12 microbatches), plain side, 6 iterations: once the
    flows are formed each relay forwards 3 microbatches per iteration and no forward is refused. Before, each stage-1
    relay sent all its microbatches to its first unit's peer and counted none still waiting for an answer as load:
    two stage-2 relays forwarded 6, others none, and the data node's sends were refused by full relays."""
    config = dataclasses.replace(run_config(SecurePipelineConfig(), "clean", "plain", 0), steps=6)
    summary = simulate_pipeline(config, progress=False)
    relays = summary["peer_ids"][config.data_nodes:config.peers]
    late = [e for e in summary["events"] if e["it"] >= 3]
    served = {(p, it): sum(1 for e in late if e["kind"] == "fwd" and e["peer"] == p and e["it"] == it)
              for p in relays for it in range(3, 6)}
    assert set(served.values()) == {3}
    assert not [e for e in late if e["kind"] == "send" and e["answer"] != "ok"]
