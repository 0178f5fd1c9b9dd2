"""Mechanisms of GWTF's Table II in the paper's regime: per-iteration capacity slots, SWARM as its paper specifies."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from phalanx.benchmarks.gwtf_table2_paper import bootstrap_median, ratios
from phalanx.core.errors import ConfigError
from phalanx.runs.pipeline.config import ChurnConfig, PipelineRunConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline.config import PipelineConfig


def _slots_config(mode: str) -> PipelineRunConfig:
    # 1 data node x 3 microbatches, 1 stage of 2 relays with room for 1 microbatch each
    return PipelineRunConfig(
        peers=3, data_nodes=1, steps=2, capacity_min=1, capacity_max=1,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=1, microbatches=3, capacity_mode=mode),
    )


def test_per_iteration_slots_defer_exactly_what_does_not_fit():
    summary = simulate_pipeline(_slots_config("iteration"), progress=False)
    assert [(m["completed"], m["deferred"]) for m in summary["metrics"]] == [(2, 1), (2, 1)]
    forwards = Counter((e["peer"], e["it"]) for e in summary["events"] if e["kind"] == "fwd" and e["stage"] == 1)
    assert sorted(forwards.values()) == [1, 1, 1, 1]  # each relay admitted one microbatch per iteration
    second = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    assert any(mb["first_it"] == 0 for mb in second)  # the deferred one is pushed again, first
    # the same pipeline counting capacity as memory held at once fits all three: a slot frees at the backward
    held = simulate_pipeline(_slots_config("held"), progress=False)
    assert [(m["completed"], m["deferred"]) for m in held["metrics"]] == [(3, 0), (3, 0)]


def _crash_config(routing: str) -> PipelineRunConfig:
    # as tests/test_pipeline.py: the first stage-2 relay to finish a forward in iteration 1 dies 0.1 s later
    return PipelineRunConfig(
        peers=7, data_nodes=1, steps=3,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=3, microbatches=4, capacity=4, routing=routing, flops_scale=2e5, complete_timeout=4.0),
        faults=ChurnConfig(crash_stage=2, crash_iteration=1, crash_at=0.1),
    )


def test_swarm_paper_gives_the_broken_stage_a_new_peer_instead_of_restarting():
    summary = simulate_pipeline(_crash_config("swarm-paper"), progress=False)
    it1 = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    assert [mb["outcome"] for mb in it1] == ["ok"] * 4
    assert all(mb["restarts"] == 0 for mb in it1)
    repaired = [mb for mb in it1 if mb["repairs"]]
    assert len(repaired) == 1 and repaired[0]["recomputed"] == [2]
    mb = repaired[0]
    forwards: dict[int, list[str]] = defaultdict(list)
    for e in summary["events"]:
        if e["kind"] == "fwd" and (e["src"], e["seq"], e["att"]) == (mb["src"], mb["seq"], mb["att"]):
            forwards[e["stage"]].append(e["peer"])
    # stage 2 ran on two peers (the victim, then a new one); every other stage exactly once
    assert {s: len(p) for s, p in forwards.items()} == {0: 1, 1: 1, 2: 2, 3: 1}
    assert len(set(forwards[2])) == 2 and mb["path"][2] == forwards[2][1]


def test_swarm_paper_sender_does_not_remember_a_refusal():
    # 1 stage of 2 relays with room for 1 microbatch each per iteration, 3 microbatches: the third is
    # refused by both. The runtime's SWARM asks each relay once; SWARM-paper draws again (within a bound).
    def refusals(routing: str) -> int:
        config = replace(_slots_config("iteration"), steps=1,
                         pipeline=replace(_slots_config("iteration").pipeline, routing=routing))
        summary = simulate_pipeline(config, progress=False)
        assert [(m["completed"], m["deferred"]) for m in summary["metrics"]] == [(2, 1)]
        return sum(1 for e in summary["events"] if e["kind"] == "send" and e["answer"] == "deny")

    assert refusals("swarm") == 2
    assert refusals("swarm-paper") == 4  # 2 x the candidates, then it gives up


def test_ratios_are_paired_by_seed_and_bootstrapped():
    rows = [{"setting": "heterogeneous", "churn": 0.1, "policy": p, "seed": s, "time_per_microbatch": t}
            for p, s, t in [("gwtf", 0, 1.0), ("swarm", 0, 2.0), ("gwtf", 1, 3.0), ("swarm", 1, 3.0), ("gwtf", 2, 5.0)]]
    assert ratios(rows, "heterogeneous", 0.1, "swarm") == [0.5, 1.0]  # seed 2 has no swarm run: left out
    median, low, high = bootstrap_median([0.5, 0.6, 0.7], 2000)
    assert median == 0.6 and 0.5 <= low <= median <= high <= 0.7


def test_capacity_mode_and_routing_are_checked():
    with pytest.raises(ConfigError, match="capacity_mode"):
        PipelineConfig(capacity_mode="per-hour")
    with pytest.raises(ConfigError, match="activation_bytes"):
        PipelineConfig(activation_bytes=-1)
    PipelineConfig(routing="swarm-paper")
