"""Churn decisions of `phalanx launch` (which workers leave and come back): seeded, bounded, never the evaluators."""

from phalanx.runs.config import override
from phalanx.runs.dp.launch_churn import LaunchChurn
from phalanx.runs.presets import get_preset


def _play(config, chunks):
    churn = LaunchChurn(config)
    running = set(range(config.peers))
    for progress in chunks:
        for event in churn.advance(progress, sorted(running)):
            if event.event == "left":
                assert event.index in running
                running.discard(event.index)
            else:
                assert event.index not in running
                running.add(event.index)
                churn.trained(event.index)
            assert len(running) >= churn.min_alive
    return churn.events


def test_churn_keeps_enough_peers_spares_evaluators_and_is_seeded():
    config = override(get_preset("digits-dp-churn"), ["peers=6", "steps=200", "faults.leave_rate=0.3", "faults.join_rate=0.3"])
    events = _play(config, range(0, 200, 7))
    assert {e.event for e in events} == {"left", "joined"}
    assert all(e.index >= config.eval_peers for e in events)
    assert max(e.step for e in events) < config.steps - 2 * config.catchup.margin
    assert _play(config, range(0, 200, 7)) == events  # seeded
    # a worker started again cannot leave before it has trained: the swarm keeps min_alive trainers
    assert all(not (a.index == b.index and a.event == "joined" and b.event == "left" and a.step == b.step)
               for a, b in zip(events, events[1:]))
    assert _play(override(config, ["seed=1"]), range(0, 200, 7)) != events


def test_no_churn_without_rates():
    config = override(get_preset("digits-dp"), ["peers=4"])
    assert not LaunchChurn.wanted(config)
    assert _play(config, [50, 149]) == []
