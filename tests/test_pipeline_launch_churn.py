"""Churn decisions for a launched pipeline: seeded, per relay and iteration, never the last relay of a stage,
joiners are new identities, nothing in the last two iterations."""

import dataclasses

from phalanx.runs.pipeline.config import ChurnConfig
from phalanx.runs.pipeline.launch_churn import PipelineChurn
from phalanx.runs.presets import get_preset


def _run(leave: float, join: float, seed: int = 0, steps: int = 60) -> tuple[PipelineChurn, list[dict[str, int]]]:
    config = get_preset("chars-gpt-pipeline")
    config = dataclasses.replace(config, seed=seed, steps=steps, faults=ChurnConfig(leave_rate=leave, join_rate=join))
    churn = PipelineChurn(config, first_index=config.peers)
    live = {str(i): config.stage_of(i) for i in range(config.data_nodes, config.peers)}
    views = []
    for finished in range(1, steps + 1):
        for event in churn.advance(finished, live):
            if event.event == "left":
                del live[event.name]
            else:  # placed at once here; the launcher waits for its join event
                live[event.name] = 1 + int(event.name) % config.pipeline.stages
        views.append(dict(live))
    return churn, views


def test_relays_leave_and_new_ones_join_but_no_stage_is_wiped_out():
    churn, views = _run(0.2, 0.5)
    left = [e for e in churn.events if e.event == "left"]
    joined = [e for e in churn.events if e.event == "joined"]
    assert len(left) >= 10 and len(joined) >= 5  # 6 relays x 58 iterations at 20%
    assert [e.name for e in joined] == [str(7 + i) for i in range(len(joined))]  # fresh identities, in order
    assert all(sorted(set(view.values())) == [1, 2] for view in views)  # every stage keeps a live relay
    assert max(e.it for e in churn.events) <= 57  # none in the last two iterations
    assert len(left) - len(joined) == churn.down


def test_decisions_are_seeded_and_none_without_rates():
    assert _run(0.1, 0.3, seed=4)[0].events == _run(0.1, 0.3, seed=4)[0].events
    assert _run(0.1, 0.3, seed=4)[0].events != _run(0.1, 0.3, seed=5)[0].events
    assert _run(0.0, 0.0)[0].events == []
