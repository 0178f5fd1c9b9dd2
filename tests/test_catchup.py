"""State catch-up: agreement rules, a joiner and a restarted peer in the simulator, a diverged replica re-syncing."""

import asyncio
import json

import pytest
import torch

from phalanx.algorithms.catchup import (
    Offer,
    agreed,
    agreed_updates,
    choose_snapshot,
    manifest_digest,
    manifest_of,
    needed_votes,
)
from phalanx.core.errors import RemoteError
from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.dp.swarm import build_peer, peer_identity, run_peer
from phalanx.runs.presets import get_preset
from phalanx.runtime.dp.catchup import CatchupConfig, CatchupService
from phalanx.runtime.dp.roster import DEMOTE_AFTER, READY
from phalanx.runtime.dp.state import load_state, state_bytes
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

D1, D2 = b"\x01" * 32, b"\x02" * 32


def test_votes_needed_and_majority():
    assert needed_votes(10, 2) == 3
    assert needed_votes(2, 2) == 2 and needed_votes(1, 2) == 1
    assert agreed({"a": D1, "b": D1, "c": D2}, 3, 2) is None  # 2 of 3: fewer than 1 + 2 confirmations
    assert agreed({"a": D1, "b": D1, "c": D1, "d": D2}, 4, 2) == (D1, ("a", "b", "c"))
    # three liars agreeing cannot outvote four honest replicas, nor tie them
    assert agreed({**{p: D1 for p in "abcd"}, **{p: D2 for p in "xyz"}}, 7, 2)[0] == D1
    assert agreed({**{p: D1 for p in "abc"}, **{p: D2 for p in "xyz"}}, 6, 2) is None


def test_choose_latest_agreed_snapshot_and_consecutive_updates():
    offers = {
        "a": Offer(25, {10: D1, 20: D1}, {20: D1, 21: D1, 22: D2}),
        "b": Offer(25, {10: D1, 20: D1}, {20: D1, 21: D1, 22: D2}),
        "c": Offer(25, {10: D1, 20: D2}, {20: D1, 21: D1}),
        "d": Offer(24, {10: D1}, {20: D1, 21: D1, 22: D2}),
    }
    choice = choose_snapshot(offers, 2)
    assert (choice.step, choice.digest) == (10, D1)  # step 20 has only 2 agreeing of 4 answers
    offers["d"] = Offer(25, {10: D1, 20: D1}, offers["d"].updates)
    assert choose_snapshot(offers, 2).step == 20
    assert [a.step for a in agreed_updates(offers, 20, 2)] == [20, 21, 22]
    assert agreed_updates(offers, 23, 2) == []


def test_manifest_names_the_chunks():
    data = bytes(range(256)) * 40
    m = manifest_of(data, 1000)
    assert m["size"] == len(data) and len(m["hashes"]) == 11
    assert manifest_digest(m) != manifest_digest(manifest_of(data[:-1] + b"x", 1000))


def test_joiner_and_restarted_peer_end_with_the_swarms_state(tmp_path):
    config = override(
        get_preset("digits-dp"),
        [
            "peers=5", "steps=40", "train.eval_every=40",
            "faults.join=1", "faults.join_after_step=20",
            "faults.crash=1", "faults.crash_after_step=6", "faults.restart_after=4",
        ],
    )
    summary = simulate(config, tmp_path, progress=False)
    assert summary["joins"] == 2  # the restarted peer and the new one
    digests = summary["final_digests"]
    assert len(digests) == 6 and len(set(digests.values())) == 1
    crashed = list(summary["crashed"])
    assert len(crashed) == 1 and crashed[0] in digests
    timeline = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    joiner_steps = sorted(r["step"] for r in timeline if r["peer"] == 5)
    assert joiner_steps[0] > 20 and joiner_steps[-1] == 39
    assert joiner_steps == list(range(joiner_steps[0], 40))
    assert summary["final_accuracy"] > 0.8


def test_diverged_replica_resyncs_at_the_next_sync_point():
    config = override(get_preset("digits-dp"), ["peers=4", "steps=26", "train.eval_every=100"])
    ids = [peer_identity(config.seed, i) for i in range(4)]
    services: list[CatchupService] = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = [network.add_peer(identity) for identity in ids]
        peers = [build_peer(config, t, i) for i, t in enumerate(transports)]
        services.extend(CatchupService(p, CatchupConfig(sync_every=10), [i.peer_id for i in ids]) for p in peers)

        def on_step(record):
            if record["peer"] == ids[3].peer_id and record["step"] == 12:
                with torch.no_grad():  # as if it had missed a gather: its replica drifts
                    next(peers[3].model.parameters()).add_(0.01)

        tasks = [network.spawn(t.peer_id, lambda i=i: run_peer(config, peers[i], i, True, on_step, services[i])) for i, t in enumerate(transports)]
        for task in tasks:
            await task

    run_simulation(main)
    assert [s.resyncs for s in services] == [0, 0, 0, 1]
    assert len({s.state_digest() for s in services}) == 1


def test_malformed_state_is_evidence():
    config = override(get_preset("digits-dp"), ["peers=2"])

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        t = network.add_peer(peer_identity(0, 0))
        peer = build_peer(config, t, 0)
        good = state_bytes(peer, 7)
        assert load_state(peer, good, "x") == 7 and peer.step == 7
        other = build_peer(override(config, ["train.task=digits-cnn"]), network.add_peer(peer_identity(0, 1)), 1)
        with pytest.raises(RemoteError) as info:
            load_state(peer, state_bytes(other, 3), "liar")
        assert info.value.evidence.peer == "liar" and info.value.evidence.kind == "bad_state"

    run_simulation(main)


def test_admitted_joiner_that_never_shows_up_is_demoted():
    """A peer announces `ready` for step 5 and then sends nothing: the others wait for it DEMOTE_AFTER steps, not every step."""
    config = override(get_preset("digits-dp"), ["peers=4", "steps=12", "train.eval_every=100"])
    ids = [peer_identity(config.seed, i) for i in range(5)]
    records: list[dict] = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = [network.add_peer(identity) for identity in ids]
        peers = [build_peer(config, t, i) for i, t in enumerate(transports[:4])]
        services = [CatchupService(p, CatchupConfig(sync_every=10), [i.peer_id for i in ids[:4]]) for p in peers]

        async def ghost():  # stays in the view, announces it trains from step 5, never does
            await transports[4].broadcast("catchup.ready", 5, b"")

        network.spawn(ids[4].peer_id, ghost)
        tasks = [
            network.spawn(t.peer_id, lambda i=i: run_peer(config, peers[i], i, True, records.append, services[i]))
            for i, t in enumerate(transports[:4])
        ]
        for task in tasks:
            await task

    run_simulation(main)
    groups = {(r["step"], r["group"], r["dropped"]) for r in records}
    assert {(s, g) for s, g, _ in groups if s < 5} == {(s, 4) for s in range(5)}
    waited = {(s, 5, 1) for s in range(5, 5 + DEMOTE_AFTER)}
    assert {(s, g, d) for s, g, d in groups if 5 <= s < 5 + DEMOTE_AFTER} == waited  # waited for DEMOTE_AFTER steps
    assert {(s, g, d) for s, g, d in groups if s >= 5 + DEMOTE_AFTER} == {(s, 4, 0) for s in range(5 + DEMOTE_AFTER, 12)}


def test_joiner_gets_past_updates_that_stop_agreeing_after_it_announced_its_step():
    """The replicas' updates disagree on the steps a joiner replays after its `ready` (as after a crash mid-gather).

    One of three replicas serves a different update digest for every step from the joiner's
    announcement to its entry step, so no update there is agreed. The joiner loads the next
    agreed snapshot, announces a later step, trains to the end and ends with the swarm's state.
    """
    config = override(get_preset("digits-dp"), ["peers=3", "steps=60", "train.eval_every=100"])
    ids = [peer_identity(config.seed, i) for i in range(4)]
    records: list[dict] = []
    services: list[CatchupService] = []
    corrupted: list[int] = []
    entries: list[int] = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = [network.add_peer(identity) for identity in ids]
        peers = [build_peer(config, t, i) for i, t in enumerate(transports)]
        services.extend(CatchupService(p, CatchupConfig(sync_every=10), [i.peer_id for i in ids[:3]]) for p in peers)
        reached = asyncio.Event()

        def on_step(record):
            records.append(record)
            if record["step"] == 13:
                reached.set()
            board = transports[2].board
            entries.extend(s for s in range(config.steps) if s not in entries and ids[3].peer_id in board.get(READY, s))
            if record["peer"] == ids[2].peer_id and entries and record["step"] < entries[0]:
                vector, bans, _ = services[2]._updates[record["step"]]
                services[2]._updates[record["step"]] = (vector, bans, b"\xee" * 32)  # it serves a diverged update
                corrupted.append(record["step"])

        async def joiner():
            await reached.wait()
            await services[3].join(end=config.steps)
            await run_peer(config, peers[3], 3, True, on_step, services[3])

        tasks = [network.spawn(t.peer_id, lambda i=i: run_peer(config, peers[i], i, True, on_step, services[i])) for i, t in enumerate(transports[:3])]
        tasks.append(network.spawn(ids[3].peer_id, joiner))
        for task in tasks:
            await task

    run_simulation(main)
    assert corrupted and corrupted[-1] == entries[0] - 1 and len(entries) == 2 and entries[1] > entries[0]
    joined = sorted(r["step"] for r in records if r["peer"] == ids[3].peer_id)
    assert joined == list(range(entries[1], config.steps))
    assert len({s.state_digest() for s in services}) == 1
