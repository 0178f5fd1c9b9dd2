"""Pipeline runtime in the simulator: equality with single-process training, aggregation, crash handling."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from phalanx.core.errors import PhalanxError
from phalanx.core.serialization import decode, encode
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import (
    ChurnConfig,
    LinkAttackConfig,
    PipelineRunConfig,
)
from phalanx.runs.pipeline.run import reference_losses, simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline import messages as m
from phalanx.runtime.pipeline.backward import Backward
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.data_node import expected_slots
from phalanx.runtime.pipeline.links import Links
from phalanx.runtime.pipeline.relay import Relay
from phalanx.runtime.pipeline.repair import Repair
from phalanx.runtime.pipeline.verifier import VerifierConfig
from phalanx.runtime.rounds.btard import BTARDConfig
from phalanx.runtime.rounds.butterfly import AllReduceConfig
from phalanx.transport.sim import SimNetwork


def _mlp_config(**kw) -> PipelineRunConfig:
    base = dict(
        peers=6, data_nodes=2, steps=3,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=1, microbatches=3, capacity=4),
    )
    base.update(kw)
    return PipelineRunConfig(**base)


def _replicas_agree(summary: dict) -> dict[int, set[str]]:
    by_stage = defaultdict(set)
    for stage, _version, digest in summary["replicas"].values():
        by_stage[stage].add(digest)
    return by_stage


# Float tolerance: the pipeline sums per-stage microbatch gradients in another order than
# one backward over the whole model, so float32 rounding differs in the last bits; SGD keeps
# the difference near 1e-7 relative, Adam (which divides by a running RMS) near 1e-6.
def test_mlp_pipeline_equals_single_process_training():
    config = _mlp_config()
    summary = simulate_pipeline(config, progress=False)
    losses = [m["loss"] for m in summary["metrics"]]
    assert all(m["completed"] == 6 and m["deferred"] == 0 for m in summary["metrics"])
    assert losses == pytest.approx(reference_losses(config), rel=1e-5)
    assert losses[-1] < losses[0]
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


def _gpt_config(steps: int, capacity: int) -> PipelineRunConfig:
    """chars-gpt in 2 stages of 2 relays, one data node, 4 microbatches of 4."""
    return PipelineRunConfig(
        peers=5, data_nodes=1, steps=steps,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=4),
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=capacity),
    )


def test_gpt_pipeline_equals_single_process_training():
    config = _gpt_config(steps=3, capacity=2)
    summary = simulate_pipeline(config, progress=False)
    losses = [m["loss"] for m in summary["metrics"]]
    assert losses == pytest.approx(reference_losses(config), rel=1e-4)
    by_stage = _replicas_agree(summary)
    assert sorted(by_stage) == [0, 1, 2] and all(len(d) == 1 for d in by_stage.values())
    paths = {tuple(mb["path"]) for mb in summary["microbatches"]}
    assert len(paths) > 1  # microbatches went through more than one pipeline


def test_each_stage_clips_its_gradient_as_single_process_training_clipped_per_stage():
    # a bound below every stage's gradient norm, so that each step is clipped
    config = _gpt_config(steps=3, capacity=2)
    clipped = replace(config, pipeline=replace(config.pipeline, grad_clip=0.01))
    losses = [m["loss"] for m in simulate_pipeline(clipped, progress=False)["metrics"]]
    assert losses == pytest.approx(reference_losses(clipped), rel=1e-4)
    assert losses != pytest.approx(reference_losses(config), rel=1e-3)  # the clip changed training


def _crash_config(routing: str) -> PipelineRunConfig:
    # 1 data node + 3 stages x 2 relays (forward 0.27 s per stage and microbatch); the first
    # stage-2 relay to finish a forward in iteration 1 dies 0.1 s later: the backward of that
    # microbatch breaks, and the next one it was sent is lost mid-forward.
    return PipelineRunConfig(
        peers=7, data_nodes=1, steps=3,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=3, microbatches=4, capacity=4, routing=routing, flops_scale=2e5, complete_timeout=4.0),
        faults=ChurnConfig(crash_stage=2, crash_iteration=1, crash_at=0.1),
    )


def _forward_counts(summary: dict, src: str, seq: int, att: int) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for e in summary["events"]:
        if e["kind"] == "fwd" and (e["src"], e["seq"], e["att"]) == (src, seq, att):
            counts[e["stage"]] += 1
    return dict(counts)


def test_gwtf_backward_crash_is_repaired_recomputing_only_the_lost_stage():
    config = _crash_config("gwtf")
    summary = simulate_pipeline(config, progress=False)
    victim = next(e["peer"] for e in summary["events"] if e["kind"] == "fwd" and e["stage"] == 2 and e["it"] == 1)
    it1 = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    assert [mb["outcome"] for mb in it1] == ["ok"] * 4
    assert all(victim not in mb["path"] and mb["restarts"] == 0 for mb in it1)
    repaired = [mb for mb in it1 if mb["repairs"]]
    assert len(repaired) == 1 and repaired[0]["recomputed"] == [2]
    mb = repaired[0]
    # stage 2 ran twice (the victim, then the repair peer); every other stage exactly once
    assert _forward_counts(summary, mb["src"], mb["seq"], mb["att"]) == {0: 1, 1: 1, 2: 2, 3: 1}
    # no microbatch was lost, so training is exactly the crash-free one
    assert [m["loss"] for m in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)
    assert victim not in summary["replicas"]
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


def _left_after_its_backward(routing: str) -> PipelineRunConfig:
    # the first stage-2 relay to finish a backward in iteration 1 leaves 15 ms later: its COMPLETE has reached the
    # stage-3 relay (5 ms), its own gradient (padded to 5 MB: 40 ms on the wire) has not reached stage 1. Nobody can
    # report that backward broken; the stage-1 relay sees its next peer leave (watch_period) and reports it lost
    config = replace(_crash_config(routing), faults=ChurnConfig(crash_stage=2, crash_iteration=1, crash_at=0.015,
                                                                crash_after="bwd"))
    return replace(config, pipeline=replace(config.pipeline, activation_bytes=5_000_000, watch_period=1.0))


def test_gwtf_repairs_a_stage_that_left_after_taking_the_backward():
    # the stage-3 relay keeps the gradient it delivered: the stage is rebuilt and resumed from it, as a broken
    # backward is, instead of the microbatch restarting after a COMPLETE timeout (issue 18, all/1's seq 55)
    config = _left_after_its_backward("gwtf")
    summary = simulate_pipeline(config, progress=False)
    first = next(e for e in summary["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
    victim = next(mb for mb in summary["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
    assert (victim["outcome"], victim["att"], victim["restarts"], victim["repairs"]) == ("ok", 0, 0, 1)
    assert victim["recomputed"] == [2] and first["peer"] not in victim["path"]
    assert _forward_counts(summary, victim["src"], victim["seq"], 0) == {0: 1, 1: 1, 2: 2, 3: 1}
    assert all(mb["outcome"] == "ok" and mb["restarts"] == 0 for mb in summary["microbatches"])
    assert [m["loss"] for m in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)


def test_a_backward_lost_with_a_relay_that_left_is_repaired_when_nothing_reaches_its_upstream():
    # as above, but no node watches its next peers (watch_period 0, the presets'): the stage-1 relay that passed the
    # victim to the relay that left gets no traffic after the departure, so nobody reports it lost. The data node
    # sees a node of the path leave after the loss, asks the node before it whether it still waits for the backward,
    # and repairs the stage (issue 18's all/1, seq 65: it waited out the microbatch timeout, 60 s here)
    config = _left_after_its_backward("gwtf")
    config = replace(config, pipeline=replace(config.pipeline, watch_period=0.0))
    summary = simulate_pipeline(config, progress=False)
    first = next(e for e in summary["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
    victim = next(mb for mb in summary["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
    assert (victim["outcome"], victim["att"], victim["restarts"], victim["repairs"], victim["recomputed"]) == ("ok", 0, 0, 1, [2])
    assert summary["metrics"][1]["duration"] < 2 * config.pipeline.complete_timeout
    assert [m["loss"] for m in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)


def _stage_ids(config: PipelineRunConfig, stage: int) -> set[str]:
    return {peer_identity(config.seed, i).peer_id for i in range(config.peers) if config.stage_of(i) == stage}


def test_a_stage_repair_resumes_while_the_holder_still_sees_the_peer_that_left(monkeypatch):
    # the stage-3 relays (the holders) see the crash 3 s after everyone else, as views differ over hivemind: the data
    # node's confirmation releases the delivered gradient, and the repair resumes it (RP finding 3: the holder refused
    # the RESUME while it still saw the receiver, and the microbatch waited out the microbatch timeout)
    config = _left_after_its_backward("gwtf")
    late, view = _stage_ids(config, 3), SimNetwork._view

    def lagging(self, me):
        seen = view(self, me)
        if me.id not in late:
            return seen
        now = self._running_loop().time()
        return sorted({*seen, *(pid for pid, p in self._peers.items()
                                if not p.alive and now - p.crashed_at < self.config.detection_delay + 3.0)})

    monkeypatch.setattr(SimNetwork, "_view", lagging)
    summary = simulate_pipeline(config, progress=False)
    first = next(e for e in summary["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
    victim = next(mb for mb in summary["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
    assert (victim["outcome"], victim["restarts"], victim["repairs"], victim["recomputed"]) == ("ok", 0, 1, [2])
    assert summary["metrics"][1]["duration"] < 2 * config.pipeline.complete_timeout


def test_a_repair_whose_resume_is_refused_restarts_after_a_complete_timeout(monkeypatch):
    # every holder refuses RESUME (a thief took the gradient first, RP finding 2): the repair dead-ends, and the data
    # node restarts the microbatch a COMPLETE timeout after its REFORWARD, not after the microbatch timeout (60 s)
    async def refuse(self, sender, payload):
        return m.answer(m.UNKNOWN)

    monkeypatch.setattr(Repair, "_on_resume", refuse)
    config = _left_after_its_backward("gwtf")
    summary = simulate_pipeline(config, progress=False)
    first = next(e for e in summary["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
    victim = next(mb for mb in summary["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
    assert (victim["outcome"], victim["restarts"], victim["repairs"]) == ("ok", 1, 1)
    assert all(r["completed"] == 4 for r in summary["metrics"])
    assert summary["metrics"][1]["duration"] < 4 * config.pipeline.complete_timeout < config.pipeline.microbatch_timeout


@pytest.mark.parametrize("named", ["stage-1 relay", "itself", "colluder"])
def test_a_relay_of_the_repaired_stage_cannot_take_the_gradient_before_the_repair_node(monkeypatch, named):
    # 3 relays per stage; the last stage-2 relay (the thief, honest otherwise) asks every stage-3 relay, every 50 ms, to
    # RESUME each key it does not hold, under a path it writes itself, and drops what comes. Its path names as the node
    # that fed it the first stage-1 relay, or itself or the last stage-1 relay (a colluder), either of which answers
    # every holder that asks that it handed the thief the repair. RP finding 2b: it took the delivered gradient once its data node
    # released it, the repair dead-ended and the victim restarted; RP s25 1: a check of the node the thief names only
    config = replace(_left_after_its_backward("gwtf"), peers=10)
    ids = [peer_identity(config.seed, i).peer_id for i in range(config.peers)]
    thief = [p for i, p in enumerate(ids) if config.stage_of(i) == 2][-1]
    stage_1 = [p for i, p in enumerate(ids) if config.stage_of(i) == 1]
    feeder = {"stage-1 relay": stage_1[0], "itself": thief, "colluder": stage_1[-1]}[named]
    stolen: list[tuple[int, str]] = []
    serve, on_backward, on_ping = Relay.serve, Relay._on_backward, Repair._on_ping

    async def steal(relay: Relay) -> None:
        while True:
            await asyncio.sleep(0.05)
            src = next(p for p, s in relay.directory.items() if s == 0)
            for seq in range(4 * (relay.version + 1)):
                if (src, seq, 0) not in relay.held:
                    body = encode({"src": src, "seq": seq, "att": 0, "path": [src, feeder, relay.me], "rec": []})
                    for holder in relay.live(3):
                        if await relay._ask(holder, m.RESUME, body, timeout=0.5) == m.OK:
                            stolen.append((seq, holder))

    async def thief_serve(self) -> None:
        if self.me == thief:
            self.spawn(steal(self))
        await serve(self)

    async def thief_backward(self, sender: str, payload: bytes) -> bytes:
        c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
        if self.me == thief and c.key not in self.held:
            return m.answer(m.OK)  # a stolen gradient: taken, dropped
        return await on_backward(self, sender, payload)

    async def lying_ping(self, sender: str, payload: bytes) -> bytes:
        asked = m.parse_mapping(payload, sender, self.transport.limits, "ping").get("handed_to")
        if named != "stage-1 relay" and self.me == feeder and asked == thief:
            return m.answer(m.OK)  # "I handed it the repair"
        return await on_ping(self, sender, payload)

    monkeypatch.setattr(Relay, "serve", thief_serve)
    monkeypatch.setattr(Relay, "_on_backward", thief_backward)
    monkeypatch.setattr(Repair, "_on_ping", lying_ping)
    summary = simulate_pipeline(config, progress=False)
    assert stolen == []
    iteration_1 = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    assert [mb["outcome"] for mb in iteration_1] == ["ok"] * 4 and sum(mb["restarts"] for mb in iteration_1) == 0
    assert sum(mb["repairs"] for mb in iteration_1) >= 1


def test_a_repair_that_rebuilds_two_stages_resumes_along_the_chain_from_the_data_node(monkeypatch):
    # 3 stages x 3 relays; as the stage-3 relay of a path sends its first backward of iteration 1, the path's stage-1
    # and stage-2 relays crash: the data node resends its own output, stages 1 and 2 are rebuilt, and the holder walks
    # the chain (data node -> new stage 1 -> new stage 2) before it resumes. A guard of the chain walk (RP s25's
    # check): it passes before 070331b too
    config = replace(_crash_config("gwtf"), peers=10, faults=ChurnConfig())
    networks: list[SimNetwork] = []
    victims: list[m.Key] = []
    send_backward = Backward.send_backward

    async def crash_then_send(self, carry: m.Carry) -> None:
        if self.stage == 3 and carry.it == 1 and not victims:
            victims.append(carry.key)
            networks[0].crash(carry.path[1])
            networks[0].crash(carry.path[2])
        await send_backward(self, carry)

    monkeypatch.setattr(Backward, "send_backward", crash_then_send)
    summary = simulate_pipeline(config, progress=False, adversary=lambda network, directory: networks.append(network))
    victim = next(mb for mb in summary["microbatches"] if mb["it"] == 1 and mb["seq"] == victims[0][1])
    assert (victim["outcome"], victim["att"], victim["restarts"], victim["repairs"], victim["recomputed"]) == ("ok", 0, 0, 1, [1, 2])
    assert [m["loss"] for m in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)


def test_a_microbatch_repaired_twice_in_one_backward_is_aggregated_on_the_tensors_that_crossed(monkeypatch):
    # verifiers off the path; stage 2 is rebuilt (its relay left after its backward), and when the stage-3 holder
    # takes the repair node's RESUME the stage-1 relay of the path leaves too: the repair node's gradient breaks at
    # stage 1, which is rebuilt from the data node. RP finding 4: the repair node was not on the path the data node
    # knew (its broken report was not heard: a restart), and the path wanted a verdict on new stage-1 node -> repair
    # node, a tensor that never crossed link 1 (deferred); the repair node computed from the old stage-1 relay's output
    config = replace(_left_after_its_backward("gwtf"), sentinel=VerifierConfig(enabled=True, placement="boundary",
                                                                               hop="off_path"))
    networks: list[SimNetwork] = []
    crashed: list[str] = []
    on_resume = Repair._on_resume

    async def resume_then_crash(self, sender: str, payload: bytes) -> bytes:
        answer = await on_resume(self, sender, payload)
        path = m.parse_mapping(payload, sender, self.transport.limits, "resume")["path"]
        if not crashed and m.parse_answer(answer, sender, self.transport.limits) == m.OK:
            crashed.append(path[1])  # the stage-1 relay the repair node sends its gradient to
            networks[0].crash(path[1])
        return answer

    monkeypatch.setattr(Repair, "_on_resume", resume_then_crash)
    summary = simulate_pipeline(config, progress=False, adversary=lambda network, directory: networks.append(network))
    repaired = [mb for mb in summary["microbatches"] if mb["repairs"]]
    assert [(mb["it"], mb["outcome"], mb["att"], mb["repairs"], mb["recomputed"]) for mb in repaired] == [(1, "ok", 0, 2, [1, 2])]
    assert crashed and crashed[0] not in repaired[0]["path"]
    assert not [e for e in summary["events"] if e["kind"] == "unverified"]
    assert [r["completed"] for r in summary["metrics"]] == [4, 4, 4]
    assert [r["loss"] for r in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)


def test_a_node_rebuilt_before_its_sender_was_rebuilt_wants_the_verdict_of_what_it_computed_from():
    # path D a b c home; b left after its backward and n rebuilt stage 2 from a's output; then a's backward broke and
    # n1 rebuilt stage 1 from the data node (n resumed it): the final path is D n1 n c, and n computed from a's output
    # (as its holders told), never from n1's, which never crossed link 1 (RP finding 4)
    fed = {(1, "n"): "a", (0, "n1"): "D"}
    slots = expected_slots(("D", "a", "b", "c"), ("D", "n1", "n", "c"), 3, "D", fed)
    assert [s for s in slots if s[0] == "forward"] == [("forward", 1, "a", "b"), ("forward", 1, "a", "n"),
                                                       ("forward", 2, "b", "c"), ("forward", 3, "c", "D")]
    # the same node picked again at its stage by a deeper rebuild: judged by what fed it last (the holder told)
    again = expected_slots(("D", "a", "b", "c"), ("D", "n1", "b", "c"), 3, "D", {(1, "b"): "n1", (0, "n1"): "D"})
    assert ("forward", 1, "n1", "b") in again and ("forward", 1, "a", "b") in again


def _flood_reports(monkeypatch, liar: str, period: float, bodies) -> None:
    """`liar`, a relay honest otherwise, sends its data node every `period` seconds a BROKEN report for each body that
    `bodies(relay, data_node, seq)` gives, for every seq it can name."""
    serve = Relay.serve

    async def flood(self) -> None:
        data_node = next(p for p, s in self.directory.items() if s == 0)
        while True:
            await asyncio.sleep(period)
            for seq in range(4 * (self.version + 2)):
                for body in bodies(self, data_node, seq):
                    await self.transport.send(data_node, m.BROKEN, encode(body))

    async def lying_serve(self) -> None:
        if self.me == liar:
            self.spawn(flood(self))
        await serve(self)

    monkeypatch.setattr(Relay, "serve", lying_serve)


def test_lost_reports_about_peers_still_there_restart_nothing(monkeypatch):
    # stage-1 relay 0 (honest otherwise) tells the data node, every 0.2 s, that each microbatch it can name (every seq
    # and attempt) was lost: at stage 2 by a live stage-2 relay or by nobody, and at stage 3. RP finding 1: each
    # restarted a microbatch whose output had not come home, and no iteration finished anything
    config = replace(_crash_config("gwtf"), faults=ChurnConfig())
    liar = peer_identity(config.seed, 1).peer_id
    named = sorted(_stage_ids(config, 2))[0]
    _flood_reports(monkeypatch, liar, 0.2, lambda relay, data_node, seq: [
        {"src": data_node, "seq": seq, "att": att, "stage": stage, "lost": True, "to": to}
        for att in range(4) for stage, to in ((2, named), (2, ""), (3, named))])
    summary = simulate_pipeline(config, progress=False)
    assert [r["completed"] for r in summary["metrics"]] == [4, 4, 4]
    assert sum(mb["restarts"] for mb in summary["microbatches"]) == 0


def test_broken_reports_from_a_relay_that_holds_nothing_repair_and_restart_nothing(monkeypatch):
    # a stage-3 relay (honest otherwise) reports, every 0.2 s, the stage-2 backward of every microbatch it can name
    # broken at itself (RP finding 1b: before the loss each restarted the microbatch, after it each started a repair
    # whose REFORWARD excluded the honest next peer; no iteration finished anything)
    config = replace(_crash_config("gwtf"), faults=ChurnConfig())
    liar = sorted(_stage_ids(config, 3))[0]
    _flood_reports(monkeypatch, liar, 0.2, lambda relay, data_node, seq: [
        {"src": data_node, "seq": seq, "att": att, "stage": 2} for att in range(4)])
    summary = simulate_pipeline(config, progress=False)
    assert [r["completed"] for r in summary["metrics"]] == [4, 4, 4]
    assert sum(mb["restarts"] for mb in summary["microbatches"]) == 0
    assert sum(mb["repairs"] for mb in summary["microbatches"]) <= 12  # at most one per microbatch that went through it


def test_lost_reports_about_keys_no_microbatch_has_keep_nothing_from_the_honest_one(monkeypatch):
    # a stage-1 relay reports, every 0.25 s, each live stage-2 peer lost for every seq under an attempt no microbatch
    # has; the honest report after the real departure still repairs the victim (RP finding 6: the liar's reports
    # filled the once-per-departure memory first, and the victim waited out the microbatch timeout)
    config = _left_after_its_backward("gwtf")
    liar = sorted(_stage_ids(config, 1))[0]
    _flood_reports(monkeypatch, liar, 0.25, lambda relay, data_node, seq: [
        {"src": data_node, "seq": seq, "att": 99, "stage": 2, "lost": True, "to": peer} for peer in relay.live(2)])
    summary = simulate_pipeline(config, progress=False)
    first = next(e for e in summary["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
    victim = next(mb for mb in summary["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
    assert (victim["outcome"], victim["restarts"], victim["repairs"]) == ("ok", 0, 1)
    assert summary["metrics"][1]["duration"] < 2 * config.pipeline.complete_timeout


def test_a_repair_node_that_resumes_without_its_seal_gets_nobody_banned(monkeypatch):
    # BTARD per stage with validators: the stage-3 holder commits its forward input sealed by the relay that left; a
    # repair node that asks it to RESUME without sealing its recomputed output would leave that commitment naming a
    # peer off the final path, and validators convicted the honest holder (RP finding 8). It is refused: the repair
    # dead-ends, the microbatch restarts, nobody is banned
    ask = Links._ask

    async def unsealed(self, peer, topic, payload, timeout=None, watch=()):
        if topic == m.RESUME:
            obj = decode(payload, self.me, self.transport.limits)
            obj.pop("seal", None)
            payload = encode(obj)
        return await ask(self, peer, topic, payload, timeout, watch)

    monkeypatch.setattr(Links, "_ask", unsealed)
    config = replace(_left_after_its_backward("gwtf"), seed=1, peers=10, steps=4,
                     allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
                     btard=BTARDConfig(enabled=True, validators=2, timeout=2.5))
    summary = simulate_pipeline(config, progress=False)
    assert summary["banned"] == []
    assert [r["completed"] for r in summary["metrics"]] == [4, 4, 4, 4]
    assert any(mb["repairs"] for mb in summary["microbatches"])


def test_swarm_backward_crash_restarts_from_the_data_node():
    summary = simulate_pipeline(_crash_config("swarm"), progress=False)
    it1 = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    assert [mb["outcome"] for mb in it1] == ["ok"] * 4
    restarted = [mb for mb in it1 if mb["restarts"]]
    assert restarted and all(mb["repairs"] == 0 and mb["att"] >= 1 for mb in restarted)
    assert summary["wasted_compute_seconds"] > 0
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


@pytest.mark.parametrize("verifiers", [False, True])
def test_forward_crash_resends_to_another_next_stage_peer(verifiers):
    # relay 1 (stage 2) is dead from the start of iteration 1, before the membership view drops it. With
    # boundary verifiers the sender gives up on it once it leaves the view too, not after the hop's own
    # COMPLETE timeout (it answered DENIED after 4 s, so nothing counted as failed here).
    config = replace(_crash_config("swarm"), faults=ChurnConfig(crash_relay=1, crash_iteration=1, crash_at=0.0))
    if verifiers:
        config = replace(config, sentinel=VerifierConfig(enabled=True, placement="boundary"))
    summary = simulate_pipeline(config, progress=False)
    victim = summary["peer_ids"][config.data_nodes + 1]
    sends = [e for e in summary["events"] if e["kind"] == "send" and e["to"] == victim and e["it"] == 1]
    failed = {(e["src"], e["seq"], e["att"]) for e in sends if e["answer"] is None}
    assert all(e["t1"] - e["t0"] < config.pipeline.complete_timeout for e in sends if e["answer"] is None)
    it1 = [mb for mb in summary["microbatches"] if mb["it"] == 1]
    resent = [mb for mb in it1 if (mb["src"], mb["seq"], mb["att"]) in failed]
    assert resent, "no microbatch was sent to the dead relay"
    assert all(mb["outcome"] == "ok" and mb["restarts"] == 0 and mb["recomputed"] == [] for mb in resent)
    assert all(victim not in mb["path"] for mb in it1)
    assert [m["loss"] for m in summary["metrics"]] == pytest.approx(reference_losses(config), rel=1e-5)


def _liar(attacker_index: int, seed: int):
    """An attack policy on an extra peer: claims stage 1, takes activations and passes on a wrong-shape
    tensor; later sends garbage, a gradient for a microbatch nobody sent it, and a false stage claim."""
    identity = peer_identity(seed, attacker_index)

    def adversary(network, directory) -> None:
        transport = network.add_peer(identity)
        me = transport.peer_id
        stage1 = sorted(p for p, s in directory.items() if s == 1)
        stage2 = sorted(p for p, s in directory.items() if s == 2)

        async def on_forward(sender: str, payload: bytes) -> bytes:
            c = m.parse_carry(payload, sender, transport.limits, 3)
            bad = m.Carry(c.key, c.it, 2, c.path + (me,), torch.zeros(3))
            asyncio.get_running_loop().create_task(lie(stage2[0], m.FORWARD, bad.to_bytes()))
            if not started:
                started.append(asyncio.get_running_loop().create_task(more_lies()))
            return m.answer(m.OK)

        async def lie(peer: str, topic: str, payload: bytes) -> None:
            with contextlib.suppress(PhalanxError):
                await transport.request(peer, topic, payload, 1.0)

        started: list = []

        async def main() -> None:
            transport.add_request_handler(m.FORWARD, on_forward)
            for peer in directory:
                await transport.send(peer, m.HELLO, encode({"stage": 1, "version": 0, "capacity": 4}))

        async def more_lies() -> None:
            lies = [
                (stage1[0], m.FORWARD, b"not a message"),
                (stage1[0], m.BACKWARD, m.Carry(("x" * 32, 0, 0), 99, 1, ("x" * 32, stage1[0], me), torch.zeros(1)).to_bytes()),
                (stage1[1], m.FORWARD, m.Carry(("x" * 32, 0, 0), 99, 1, (me,), torch.zeros(1)).to_bytes()),
            ]
            for peer, topic, payload in lies:
                await lie(peer, topic, payload)

        network.spawn(me, main)

    return adversary, identity.peer_id


def test_bad_input_is_evidence_and_the_microbatch_is_rerouted():
    config = _mlp_config(
        peers=5, data_nodes=1, steps=4,
        pipeline=PipelineConfig(stages=2, microbatches=3, capacity=4, complete_timeout=0.5, microbatch_timeout=1.0),
    )
    adversary, liar = _liar(99, config.seed)
    summary = simulate_pipeline(config, progress=False, adversary=adversary)
    kinds = {kind for _, against, kind in summary["evidence"] if against == liar}
    assert {"wrong_shape", "malformed", "unknown_microbatch", "false_stage"} <= kinds
    assert not [e for e in summary["evidence"] if e[1] != liar]  # nobody honest is accused
    mbs = summary["microbatches"]
    assert all(mb["outcome"] == "ok" and liar not in mb["path"] for mb in mbs)
    assert any(mb["restarts"] for mb in mbs)  # the one the liar swallowed went again, around it
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())
    # (losses are not compared with the reference: until it is banned the liar sits in stage 1's
    # all-reduce group and stays silent there, so its slice of that gradient is zero for everyone)


def test_joiner_goes_to_the_bottleneck_stage_and_downloads_its_weights():
    # relay 1 (stage 2 of 3, two relays each) crashes in iteration 0; churn brings it back at the
    # start of iteration 1 as a joiner: stage 2, down to one relay, is the most utilized stage
    config = _mlp_config(
        peers=7, data_nodes=1, steps=4,
        pipeline=PipelineConfig(stages=3, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=4.0),
        faults=ChurnConfig(crash_relay=1, crash_iteration=0, crash_at=0.001, join_rate=1.0),
    )
    summary = simulate_pipeline(config, progress=False)
    joiner = summary["peer_ids"][config.data_nodes + 1]
    joins = [e for e in summary["events"] if e["kind"] == "join"]
    assert [(e["peer"], e["stage"]) for e in joins] == [(joiner, 2)]
    stage, version, digest = summary["replicas"][joiner]
    assert (stage, version) == (2, config.steps)
    assert [d for s, _, d in summary["replicas"].values() if s == 2] == [digest, digest]
    later = [mb for mb in summary["microbatches"] if mb["it"] == config.steps - 1]
    assert any(mb["path"][2] == joiner for mb in later)



def test_a_joiner_downloads_from_a_replica_that_serves_only_from_a_later_iteration():
    # Over hivemind (session 18, 20% churn): a joiner tried only its stage's two dead replicas (still in its
    # membership view) for its whole patience, never the one live replica, itself a joiner serving from a later
    # iteration than the newcomer's own version (0 before its download); it exited without serving.
    from types import SimpleNamespace

    from phalanx.runtime.pipeline.membership import Membership
    from phalanx.runtime.pipeline.node import PipelineNode

    class Joiner(Membership):
        replicas, live, ready_event = PipelineNode.replicas, PipelineNode.live, PipelineNode.ready_event

        def __init__(self) -> None:
            self.me, self.stage, self.version, self.banned, self._ready, self.asked = "new", 1, 0, set(), {}, []
            self.directory = {"data": 0, "joined": 1, "gone": 1}
            self.since = {"joined": 9}  # its HELLO: it downloaded version 8, serves from iteration 9
            self.transport = SimpleNamespace(members=lambda: ["data", "joined", "new"])
            self.config = SimpleNamespace(complete_timeout=0.0)

        async def fetch_weights(self, version: int, sources: list[str]) -> int | None:
            self.asked.append(sources)
            return 8 if "joined" in sources else None

        def announce(self) -> None:
            pass

    joiner = Joiner()
    assert asyncio.run(joiner.enter(8)) and joiner.entered
    assert joiner.asked == [["joined"]] and (joiner.version, joiner.serving_from) == (8, 9)

def test_leader_crash_the_next_data_node_leads():
    # two data nodes; the leader (smallest id, data node 0) dies early in iteration 1
    config = _mlp_config(
        peers=6, data_nodes=2, steps=4,
        pipeline=PipelineConfig(stages=2, microbatches=3, capacity=4, complete_timeout=0.5, aggregation_timeout=2.0),
        faults=ChurnConfig(crash_data_node=0, crash_iteration=1, crash_at=0.001),
    )
    summary = simulate_pipeline(config, progress=False)
    dead, survivor = summary["peer_ids"][:2]
    assert dead < survivor  # it was the leader
    rows = [r for r in summary["metrics"]]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    later = [mb for mb in summary["microbatches"] if mb["it"] >= 2]
    assert later and all(mb["src"] == survivor and mb["outcome"] == "ok" for mb in later)
    assert dead not in summary["replicas"]
    assert all(version == config.steps for _, version, _ in summary["replicas"].values())
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


def _stage_moves(summary: dict, config: PipelineRunConfig) -> int:
    """Rejoins that placed a relay in another stage than it served before."""
    serving = {pid: config.stage_of(i) for i, pid in enumerate(summary["peer_ids"])}
    moves = 0
    for e in summary["events"]:
        if e["kind"] == "join":
            moves += serving[e["peer"]] != e["stage"]
            serving[e["peer"]] = e["stage"]
    return moves


@pytest.mark.parametrize("routing", ["swarm", "gwtf"])
def test_sustained_churn_never_stalls_and_accuses_nobody(routing):
    # chars-gpt-pipeline at 20% leave and join per relay and iteration for 60 iterations: before the
    # fix every such run stalled for good (0 of 4 microbatches per iteration) and honest peers
    # accused each other (rejoined relays started from a stale stage map, behind replicas never
    # caught up, joiners were routed to before their download).
    from phalanx.runs.presets import get_preset

    config = get_preset("chars-gpt-pipeline")
    config = replace(config, steps=60, seed=1, train=replace(config.train, batch_size=4),
                     pipeline=replace(config.pipeline, routing=routing),
                     faults=ChurnConfig(leave_rate=0.2, join_rate=0.2))
    summary = simulate_pipeline(config, progress=False)
    mbs = summary["microbatches"]
    ok = sum(mb["outcome"] == "ok" for mb in mbs)
    assert ok >= 0.9 * len(mbs)
    assert summary["evidence"] == []  # nobody lies here: no honest peer is accused
    assert _stage_moves(summary, config) > 0  # relays did move stage, and that raised no evidence
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())
    assert [m["step"] for m in summary["metrics"]] == list(range(60))


def _cut_off_across_iteration_1(peer: str):
    """An adversary that partitions `peer` away from 6 s to 9.5 s: it misses iteration 1's aggregation and BEGIN."""
    def adversary(network, directory):
        loop = asyncio.get_running_loop()
        network.schedule(loop.time() + 6.0, lambda: network.partition([[peer]]))
        network.schedule(loop.time() + 9.5, network.heal)
    return adversary


def test_behind_replica_catches_up_before_serving():
    # stage-2 relay R is cut off across iteration 1's aggregation: it is out of the group, misses
    # BEGIN and comes back one version behind; it must fetch the stepped weights (digest confirmed)
    # before it computes anything for iteration 2, and end in agreement with its stage peer
    config = _mlp_config(
        peers=5, data_nodes=1, steps=5,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=2.0),
    )
    behind = peer_identity(config.seed, 2).peer_id  # relay 1: stage 2

    summary = simulate_pipeline(config, progress=False, adversary=_cut_off_across_iteration_1(behind))
    mine = [e for e in summary["events"] if e["peer"] == behind]
    aggregations = [e for e in mine if e["kind"] == "aggregate"]
    assert [e["it"] for e in aggregations] == [0, 2, 3, 4]  # the cut made it miss iteration 1's
    assert aggregations[1]["fetched"] and aggregations[1]["version"] == 3  # it downloaded the stepped weights
    changes = sorted((e["t1"], e["version"]) for e in mine if e["kind"] in ("aggregate", "catch_up"))
    served = [e for e in mine if e["kind"] == "fwd"]
    assert {e["it"] for e in served} >= {0, 3, 4}
    for e in served:  # every microbatch it computed, it computed at that iteration's version
        version = max([v for t, v in changes if t <= e["t0"]], default=0)
        assert version == e["it"]
    assert summary["replicas"][behind][:2] == [2, config.steps]
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())
    assert summary["evidence"] == []


def test_centered_clip_bounds_a_replica_lying_in_the_stage_all_reduce():
    # one stage of 4 relays, each serving 2 of the 8 microbatches; relay 0 sends -30x its honest
    # vector in the stage all-reduce. With the mean the stage steps up the gradient (update norms
    # many times the clean run's, loss climbs); with CenteredClip (tau 0.1) the honest replicas'
    # updates stay within the clean run's plus a few tau, and the loss near the clean run's
    def run(reducer: str, liar: bool) -> tuple[list[float], float]:
        config = _mlp_config(
            peers=5, data_nodes=1, steps=6, pipeline=PipelineConfig(stages=1, microbatches=8, capacity=2),
            allreduce=AllReduceConfig(reducer=reducer, tau=0.1),
            attack=LinkAttackConfig(name="scaling", factor=-30.0, relays="0", target="aggregation") if liar else LinkAttackConfig(),
        )
        summary = simulate_pipeline(config, progress=False)
        liar_id = summary["peer_ids"][1]
        assert all(len(d) == 1 for stage, d in _replicas_agree(summary).items())
        assert all(m["completed"] == 8 for m in summary["metrics"]) and summary["evidence"] == []
        norms = [e["norm"] for e in summary["events"]
                 if e["kind"] == "aggregate" and e["stage"] == 1 and e["peer"] != liar_id]
        return [m["loss"] for m in summary["metrics"]], max(norms)

    clean_loss, clean_norm = run("mean", liar=False)
    mean_loss, mean_norm = run("mean", liar=True)
    clip_loss, clip_norm = run("centered_clip", liar=True)
    assert mean_norm > 5 * clean_norm and mean_loss[-1] > clean_loss[-1] + 0.2
    assert clip_norm < clean_norm + 3 * 0.1 and abs(clip_loss[-1] - clean_loss[-1]) < 0.05


def test_departed_relay_is_out_of_the_next_aggregation():
    # relay 0 (stage 1 of 2, three relays per stage) crashes just after iteration 1 opens: the
    # aggregation of iteration 1 runs among the two that are left, who agree
    config = _mlp_config(
        peers=7, data_nodes=1, steps=3,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=2.0),
        faults=ChurnConfig(crash_relay=0, crash_iteration=1, crash_at=0.001),
    )
    summary = simulate_pipeline(config, progress=False)
    dead = summary["peer_ids"][1]
    groups = {(e["it"], e["stage"]): e["group"] for e in summary["events"] if e["kind"] == "aggregate"}
    assert groups[(0, 1)] == 3 and groups[(1, 1)] == 2 and groups[(2, 1)] == 2
    assert not [e for e in summary["events"] if e["kind"] == "aggregate" and e["peer"] == dead and e["it"] >= 1]
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


def test_a_late_aggregation_never_puts_a_replica_back():
    # Stage 2 has relays R and S; S dies 0.9 s before iteration 1's BEGIN (inside the 2 s detection
    # window), so R's all-reduce waits out S (two 5 s butterfly phases). With a 2 s aggregation timeout
    # the data node moves on, R is found behind, catches up (v2) and aggregates iteration 2 (v3); then the
    # stale all-reduce of iteration 1 ends. Applying it set R back to v2 (seen over hivemind: 5 -> 2, and
    # the stage's only replica then refused every joiner's download for 70 s).
    config = _mlp_config(
        peers=5, data_nodes=1, steps=5,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=2.0,
                                aggregation_timeout=2.0),
        faults=ChurnConfig(crash_relay=1, crash_iteration=1, crash_at=2.5),
    )
    summary = simulate_pipeline(config, progress=False)
    survivor = summary["peer_ids"][4]  # relay 3: stage 2
    mine = sorted((e for e in summary["events"] if e["peer"] == survivor and e["kind"] in ("aggregate", "catch_up")),
                  key=lambda e: e["t1"])
    late = [e for e in mine if e["kind"] == "aggregate" and e["it"] == 1]
    assert late and late[0]["t1"] > min(e["t1"] for e in mine if e["it"] == 2)  # the case arose
    versions = [e["version"] for e in mine]
    assert versions == sorted(versions) and versions[-1] == config.steps
    assert all(len(d) == 1 for d in _replicas_agree(summary).values())


def test_gwtf_routes_by_the_flow_after_the_warm_up():
    # every hop records the routing rule that chose it; churn-free, after the flow warm-up, the
    # flow's paired units and next hops choose them all (the cheapest-peer fallback none)
    config = PipelineRunConfig(
        peers=7, data_nodes=1, steps=4,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=4),
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=2, routing="gwtf"),
    )
    summary = simulate_pipeline(config, progress=False)
    branches = summary["routing_branches"]
    assert set(branches) <= {"paired", "flow", "fallback"} and sum(branches.values()) >= 4 * 4 * 3
    used = [e["branch"] for e in summary["events"] if e["kind"] == "send"]
    assert len(used) == sum(branches.values())
    assert used.count("paired") > 0 and used.count("fallback") == 0


def test_soak_compares_loss_at_an_equal_number_of_finished_microbatches():
    from phalanx.benchmarks.pipeline_soak import loss_gap

    reference = [(4 * (i + 1), 4.0 - 0.1 * i) for i in range(10)]  # 4 finished per iteration
    slower = [(2 * (i + 1), 4.0 - 0.05 * i) for i in range(10)]  # half as many: 20 finished at the end
    # 20 finished: the reference was there after 5 iterations; both sides average their last 3 points
    assert loss_gap(slower, reference, window=3) == pytest.approx((3.65 + 3.6 + 3.55) / (3.8 + 3.7 + 3.6) - 1)
    assert loss_gap(reference, reference, window=3) == pytest.approx(0.0)
    assert loss_gap([], reference, window=3) is None


@pytest.mark.parametrize("lead", [1, 1000])
def test_a_joiner_takes_no_weights_from_a_replica_that_lies_about_its_version(lead):
    # Stage 1 of 1 has four relays; relay 2 dies in iteration 0 and comes back as a joiner at iteration 1.
    # Relay 0 (the smallest id: the joiner's first source) runs the protocol and lies on weight downloads: it
    # claims `lead` versions more than it has and serves random weights under a digest that matches them.
    # Before: with lead 1000 the joiner took them (its one confirmer, asked for version 1001, answered only
    # after the aggregation timeout, with a lower version: no disagreement) and never served; with lead 1
    # the liar's disagreeing confirmations kept it out of the stage for good.
    config = _mlp_config(
        peers=5, data_nodes=1, steps=4,
        pipeline=PipelineConfig(stages=1, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=4.0),
        faults=ChurnConfig(crash_relay=2, crash_iteration=0, crash_at=0.001, join_rate=1.0),
        attack=LinkAttackConfig(name="random", relays="0", target="weights", lead=lead),
    )
    summary = simulate_pipeline(config, progress=False)
    liar, joiner = summary["peer_ids"][1], summary["peer_ids"][3]
    assert liar == min(summary["peer_ids"][1:])  # the joiner's first source
    assert [(e["peer"], e["stage"]) for e in summary["events"] if e["kind"] == "join"] == [(joiner, 1)]
    assert any(a["direction"] == "weights" and a["to"] == joiner for a in summary["attacks"])  # it lied to it
    assert joiner in summary["replicas"] and len(_replicas_agree(summary)[1]) == 1  # the honest weights at the end
    mine = [e for e in summary["events"] if e["peer"] == joiner and e["kind"] == "aggregate"]
    assert [(e["it"], e["fetched"]) for e in mine] == [(1, False), (2, False), (3, False)]  # in from iteration 1 on
    if lead > 1:  # a version the run cannot have reached: evidence, and only against the liar
        assert [e[1:] for e in summary["evidence"]] == [[liar, "false_version"]]
    else:  # a version an honest replica may hold for a moment: not evidence, but not believed alone
        assert summary["evidence"] == []


def test_two_replicas_that_confirm_each_others_forged_weights_are_not_believed():
    # A reviewer's attack on the two-source rule: relays 0 and 1 both claim one version more than they hold, serve
    # the same forged weights (`scaling` is deterministic) and confirm each other's digest. The joiner took them
    # (a digest no other replica had); now a version and digest count only when more than half of the sources
    # vouch for them, the most-claimed version first.
    config = _mlp_config(
        peers=6, data_nodes=1, steps=4,
        pipeline=PipelineConfig(stages=1, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=4.0),
        faults=ChurnConfig(crash_relay=2, crash_iteration=0, crash_at=0.001, join_rate=1.0),
        attack=LinkAttackConfig(name="scaling", relays="0,1", target="weights", lead=1),
    )
    summary = simulate_pipeline(config, progress=False)
    joiner = summary["peer_ids"][3]
    assert any(a["direction"] == "weights" and a["to"] == joiner for a in summary["attacks"])  # they lied to it
    assert len(_replicas_agree(summary)[1]) == 1  # whoever serves stage 1 at the end holds the honest weights


@pytest.mark.parametrize("lead", [1, 1000])
def test_a_behind_replica_catches_up_from_honest_replicas_around_one_that_lies_about_its_version(lead):
    # As test_behind_replica_catches_up_before_serving, with three more stage-2 relays, one of which (relay 3)
    # claims `lead` versions more than it holds and serves random weights. catch_up tried the highest claim
    # first and took it (lead 1000: version 1002, the replica never served again).
    config = _mlp_config(
        peers=9, data_nodes=1, steps=5,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=2.0),
        attack=LinkAttackConfig(name="random", relays="3", target="weights", lead=lead),
    )
    behind, liar = peer_identity(config.seed, 2).peer_id, peer_identity(config.seed, 4).peer_id

    summary = simulate_pipeline(config, progress=False, adversary=_cut_off_across_iteration_1(behind))
    mine = [e for e in summary["events"] if e["peer"] == behind]
    assert [e["it"] for e in mine if e["kind"] == "aggregate"] == [0, 2, 3, 4]  # the cut made it miss iteration 1's
    assert any(a["direction"] == "weights" and a["to"] == behind for a in summary["attacks"])  # it lied to it
    assert summary["replicas"][behind][:2] == [2, config.steps] and len(_replicas_agree(summary)[2]) == 1
    assert [e[1:] for e in summary["evidence"]] == ([[liar, "false_version"]] if lead > 1 else [])


def test_a_restarted_microbatch_is_not_denied_by_its_own_earlier_attempt():
    # Over hivemind (session 18, seed 2 iteration 13: 0 of 4): a stage-1 relay held the first attempts of
    # microbatches whose stage-2 peer died after their loss; the data node restarted them, and the relay,
    # full with attempts that would never finish, denied the restarts (and everything else) until the
    # iteration timed out. Here stage 1 has one live relay of capacity 1 (the other dies at the start);
    # the stage-2 relay that first finishes a forward in iteration 1 dies 0.05 s later.
    config = _mlp_config(
        peers=5, data_nodes=1, steps=3,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=1, flops_scale=2e5, complete_timeout=2.0,
                                microbatch_timeout=6.0, iteration_timeout=20.0),
        faults=ChurnConfig(crash_stage=2, crash_iteration=1, crash_at=0.05),
    )
    gone = peer_identity(config.seed, 3).peer_id  # relay 2, stage 1

    def adversary(network, directory):
        network.schedule(asyncio.get_running_loop().time(), lambda: network.crash(gone))

    summary = simulate_pipeline(config, progress=False, adversary=adversary)
    stage1 = summary["peer_ids"][1]
    restarted = [mb for mb in summary["microbatches"] if mb["it"] == 1 and mb["restarts"]]
    assert restarted and all(mb["outcome"] == "ok" and mb["path"][1] == stage1 for mb in restarted)
    assert [m["completed"] for m in summary["metrics"]] == [4, 4, 4]  # before: iteration 1 finished none
    assert summary["evidence"] == []


def test_two_replicas_behind_together_download_from_the_ones_that_hold_the_version():
    # Two of stage 2's four relays are cut off together across iteration 1's aggregation; each is the other's
    # first source. Before: each asked the other first and waited (wait=True) out the aggregation timeout, then
    # again for the confirmation: 40 s per download (issue 18's 40 s), the stage ended with two digests.
    # Now a probe finds the two that hold the version and the download takes a few milliseconds.
    config = _mlp_config(
        peers=9, data_nodes=1, steps=5,
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=4, flops_scale=2e5, complete_timeout=2.0,
                                aggregation_timeout=20.0),
    )
    cut = sorted(peer_identity(config.seed, i).peer_id for i in (2, 4, 6, 8))[:2]

    def adversary(network, directory):
        loop = asyncio.get_running_loop()
        network.schedule(loop.time() + 6.0, lambda: network.partition([cut]))
        network.schedule(loop.time() + 9.5, network.heal)

    summary = simulate_pipeline(config, progress=False, adversary=adversary)
    downloads = [e for e in summary["events"] if e["kind"] == "download"]
    assert sorted(e["peer"] for e in downloads) == cut and all(e["version"] == 3 for e in downloads)
    assert all(e["t1"] - e["t0"] < config.pipeline.complete_timeout for e in downloads)  # simulated seconds
    for peer in cut:
        assert [e["it"] for e in summary["events"] if e["kind"] == "aggregate" and e["peer"] == peer] == [0, 2, 3, 4]
    assert all(len(d) == 1 for d in _replicas_agree(summary).values()) and summary["evidence"] == []


def _relay_behind_a_bare_data_node(network, config: PipelineRunConfig, data, relay, directory: dict):
    """A stage-1 relay built by `build_node` on a simulated network, and its data node's bare transport, which
    answers every FORWARD and BACKWARD with OK."""
    from phalanx.runs.pipeline.run import build_node, pipeline_task

    source, transport = network.add_peer(data), network.add_peer(relay)
    for kind in (m.FORWARD, m.BACKWARD):
        source.add_request_handler(kind, lambda sender, payload: asyncio.sleep(0, m.answer(m.OK)))
    return source, build_node(config, transport, 1, directory, pipeline_task(config), lambda event: None)


def test_a_second_backward_for_a_microbatch_already_done_is_not_evidence():
    # Table II in the paper's regime, homogeneous 20 % gwtf seed 1 (no attacker): a stage-4 relay's send to a
    # stage-5 peer timed out while a repair's REFORWARD started a second send of the same microbatch; both
    # reached the new stage-5 peer, whose second backward found the stage-4 relay done with it:
    # `unknown_microbatch` evidence against an honest peer. Here the one relay of stage 1 takes a forward
    # and its backward from the data node, then the same backward again.
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=2, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=1, microbatches=1))
    data, relay = peer_identity(config.seed, 0), peer_identity(config.seed, 1)
    directory = {data.peer_id: 0, relay.peer_id: 1}

    async def main() -> tuple[list[bytes], list]:
        network = SimNetwork(SimConfig(seed=config.seed))
        source, node = _relay_behind_a_bare_data_node(network, config, data, relay, directory)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(1)[1:])
        key = (data.peer_id, 0, 0)
        forward = m.Carry(key, 0, 1, (data.peer_id,), x)
        words = [await source.request(relay.peer_id, m.FORWARD, forward.to_bytes(), 5.0)]
        grad = torch.ones_like(node.held[key].out)
        backward = m.Carry(key, 0, 1, (data.peer_id, relay.peer_id), grad)
        for _ in range(2):
            words.append(await source.request(relay.peer_id, m.BACKWARD, backward.to_bytes(), 5.0))
        await node.close()
        return words, node.transport.evidence

    words, evidence = run_simulation(main)
    assert words[:2] == [m.answer(m.OK)] * 2 and words[2] == m.answer(m.STALE)  # before: evidence against the sender
    assert evidence == []


def test_only_an_attempt_its_data_node_signed_frees_the_attempt_held():
    # A forward of attempt k frees the slots of attempts < k (session 19: a restart was denied by its own old
    # attempt). The stage-1 relay upstream of a stage-2 relay of capacity 1 writes attempt 1 of the microbatch
    # the stage-2 relay holds: without the data node's signature it is evidence against that relay and the
    # honest attempt 0 stays held; the data node's signed restart (attempt 1) frees it. Session 20 review: nor
    # does a signature by another key, or the data node's for another seq, attempt or iteration (H1: a deferred
    # microbatch starts again at attempt 0 in a later iteration, so an old signature would free the new attempt).
    from phalanx.core.errors import RequestFailed
    from phalanx.runs.pipeline.run import build_node, pipeline_task
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=3, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=2, microbatches=1, capacity=1))
    data, upstream, relay = (peer_identity(config.seed, i) for i in range(3))
    directory = {data.peer_id: 0, upstream.peer_id: 1, relay.peer_id: 2}

    async def main():
        network = SimNetwork(SimConfig(seed=config.seed))
        home, liar, transport = network.add_peer(data), network.add_peer(upstream), network.add_peer(relay)
        home.add_request_handler(m.FORWARD, lambda sender, payload: asyncio.sleep(0, m.answer(m.OK)))
        node = build_node(config, transport, 2, directory, pipeline_task(config), lambda event: None, stage=2)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(2)[1:])
        path = (data.peer_id, upstream.peer_id)
        first, second = (data.peer_id, 0, 0), (data.peer_id, 0, 1)
        words = [await liar.request(relay.peer_id, m.FORWARD, m.Carry(first, 0, 2, path, x).to_bytes(), 5.0)]
        by_liar = m.Restart.make(upstream, second, 0)
        forgeries = [
            None,  # unsigned
            by_liar,  # signed by the liar itself
            m.Restart(data.public_key, by_liar.signature),  # the liar's signature under the data node's key
            m.Restart.make(data, (data.peer_id, 1, 1), 0),  # the data node's, for another seq
            m.Restart.make(data, (data.peer_id, 0, 2), 0),  # for another attempt
            m.Restart.make(data, second, 1),  # for this attempt in another iteration (a deferred seq restarts at 0)
        ]
        for restart in forgeries:
            with pytest.raises(RequestFailed, match="forged_attempt"):
                await liar.request(relay.peer_id, m.FORWARD, m.Carry(second, 0, 2, path, x, restart=restart).to_bytes(), 5.0)
        held_after_forgery = sorted(node.held)
        signed = m.Carry(second, 0, 2, path, x, restart=m.Restart.make(data, second, 0))
        words.append(await liar.request(relay.peer_id, m.FORWARD, signed.to_bytes(), 5.0))
        held_after_restart = sorted(node.held)
        await node.close()
        return words, held_after_forgery, held_after_restart, transport.evidence

    words, after_forgery, after_restart, evidence = run_simulation(main)
    assert words == [m.answer(m.OK)] * 2
    assert after_forgery == [(data.peer_id, 0, 0)]  # before: the forgery freed it and took the slot
    assert after_restart == [(data.peer_id, 0, 1)]
    assert [(e.peer, e.kind) for e in evidence] == [(upstream.peer_id, "forged_attempt")] * 6


def test_a_key_planted_first_makes_the_relay_deny_the_other_path():
    # Session 20 review (L2): a relay that guesses a key (attempt 0 is predictable) can plant it at a next-stage
    # peer before the honest upstream sends it. The honest carry was answered "OK, already held": its sender
    # waited for a backward that goes to the planter. A carry for a held key from another path is DENIED (the
    # sender tries another peer); a resend along the same path is still OK. No evidence: either may be honest.
    from phalanx.runs.pipeline.run import build_node, pipeline_task
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=4, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=2, microbatches=1, capacity=4))
    data, planter, honest, relay = (peer_identity(config.seed, i) for i in range(4))
    directory = {data.peer_id: 0, planter.peer_id: 1, honest.peer_id: 1, relay.peer_id: 2}

    async def main():
        network = SimNetwork(SimConfig(seed=config.seed))
        home, liar, upstream, transport = (network.add_peer(p) for p in (data, planter, honest, relay))
        home.add_request_handler(m.FORWARD, lambda sender, payload: asyncio.sleep(0, m.answer(m.OK)))
        node = build_node(config, transport, 3, directory, pipeline_task(config), lambda event: None, stage=2)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(2)[1:])
        key = (data.peer_id, 0, 0)
        planted = m.Carry(key, 0, 2, (data.peer_id, planter.peer_id), x).to_bytes()
        words = [await liar.request(relay.peer_id, m.FORWARD, planted, 5.0)]
        words.append(await upstream.request(relay.peer_id, m.FORWARD, m.Carry(key, 0, 2, (data.peer_id, honest.peer_id), x).to_bytes(), 5.0))
        words.append(await liar.request(relay.peer_id, m.FORWARD, planted, 5.0))
        await node.close()
        return words, transport.evidence

    words, evidence = run_simulation(main)
    assert words == [m.answer(m.OK), m.answer(m.DENIED), m.answer(m.OK)] and evidence == []  # before: OK, OK, OK


def test_a_backward_from_a_peer_never_sent_the_microbatch_is_evidence_and_changes_nothing():
    # Session 20 review (H2): a peer writes its own path, so checking the sender against path[stage + 1] let any
    # peer take a microbatch's first backward (its key is predictable): the relay kept the forger's gradient and
    # answered the honest next peer STALE. A relay accepts a backward only from a peer it sent (or tried to send)
    # the microbatch to; a forward that timed out here but was computed there still counts as sent.
    from phalanx.core.errors import RequestFailed
    from phalanx.runs.pipeline.run import build_node, pipeline_task
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=4, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=2, microbatches=1))
    data, relay, nxt, other = (peer_identity(config.seed, i) for i in range(4))
    directory = {data.peer_id: 0, relay.peer_id: 1, nxt.peer_id: 2}  # the relay knows no other stage-2 peer

    async def main():
        network = SimNetwork(SimConfig(seed=config.seed))
        home, transport = network.add_peer(data), network.add_peer(relay)
        nxt_transport, other_transport = network.add_peer(nxt), network.add_peer(other)
        upstream: list[str] = []

        async def on_backward(sender: str, payload: bytes) -> bytes:
            upstream.append(sender)
            return m.answer(m.OK)

        home.add_request_handler(m.BACKWARD, on_backward)
        nxt_transport.add_request_handler(m.FORWARD, lambda sender, payload: asyncio.sleep(0, m.answer(m.OK)))
        node = build_node(config, transport, 1, directory, pipeline_task(config), lambda event: None, stage=1)
        key = (data.peer_id, 0, 0)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(1)[1:])
        await home.request(relay.peer_id, m.FORWARD, m.Carry(key, 0, 1, (data.peer_id,), x).to_bytes(), 5.0)
        while node.held[key].next_peer is None:
            await asyncio.sleep(0.05)
        grad = torch.ones_like(node.held[key].out)
        honest = m.Carry(key, 0, 1, (data.peer_id, relay.peer_id, nxt.peer_id), grad)
        forged = m.Carry(key, 0, 1, (data.peer_id, relay.peer_id, other.peer_id), 1000 * grad)
        words = []
        for sender, carry in ((other_transport, forged), (nxt_transport, honest), (other_transport, forged)):
            try:
                words.append(await sender.request(relay.peer_id, m.BACKWARD, carry.to_bytes(), 5.0))
            except RequestFailed as exc:
                words.append("unknown_microbatch" if "unknown_microbatch" in str(exc) else str(exc))
        await asyncio.sleep(1.0)
        kept = node.grads[key].clone()
        await node.close()
        return words, upstream, kept, transport.evidence

    words, upstream, kept, evidence = run_simulation(main)
    assert words == ["unknown_microbatch", m.answer(m.OK), "unknown_microbatch"]  # before: [OK, STALE, STALE]
    assert [(e.peer, e.kind) for e in evidence] == [(other.peer_id, "unknown_microbatch")] * 2
    assert upstream == [relay.peer_id] and kept.abs().max() < 1000  # the honest gradient was used


def test_a_backward_that_arrives_while_the_first_one_computes_is_stale():
    # Table II homogeneous 20 % gwtf seed 6 (session 20, no attacker): a data node got the same microbatch's
    # backward twice from its stage-1 relay, the second while the first was still computing; the key was then
    # neither held nor in `grads`: `unknown_microbatch` against the honest relay. Here the relay of the one
    # stage gets the same backward twice at once, with a backward that takes simulated compute time.
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=2, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=1, microbatches=1, flops_scale=1e6))
    data, relay = peer_identity(config.seed, 0), peer_identity(config.seed, 1)
    directory = {data.peer_id: 0, relay.peer_id: 1}

    async def main() -> tuple[list[bytes], list]:
        network = SimNetwork(SimConfig(seed=config.seed))
        source, node = _relay_behind_a_bare_data_node(network, config, data, relay, directory)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(1)[1:])
        key = (data.peer_id, 0, 0)
        await source.request(relay.peer_id, m.FORWARD, m.Carry(key, 0, 1, (data.peer_id,), x).to_bytes(), 30.0)
        backward = m.Carry(key, 0, 1, (data.peer_id, relay.peer_id), torch.ones_like(node.held[key].out)).to_bytes()
        words = await asyncio.gather(*(source.request(relay.peer_id, m.BACKWARD, backward, 30.0) for _ in range(2)))
        await node.close()
        return sorted(words), node.transport.evidence

    words, evidence = run_simulation(main)
    assert words == sorted([m.answer(m.OK), m.answer(m.STALE)]) and evidence == []  # before: unknown_microbatch


def test_a_broken_report_about_the_data_node_itself_restarts_and_the_old_attempt_is_stale():
    # The same run: the stage-1 relay's delivery of that input gradient to the data node failed, and it reported
    # BROKEN with stage 0 (the data node's own stage), which the data node took for a malformed report. A stage-1
    # relay on the microbatch's path may report it: the data node restarts the microbatch (it does not wait out
    # the microbatch timeout), and a late backward of the old attempt is STALE, not evidence.
    from phalanx.core.serialization import encode as enc
    from phalanx.runs.pipeline.run import build_node, pipeline_task
    from phalanx.runtime.pipeline.data_node import Microbatch
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=2, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=1, microbatches=1))
    data, relay = peer_identity(config.seed, 0), peer_identity(config.seed, 1)
    directory = {data.peer_id: 0, relay.peer_id: 1}

    async def main():
        network = SimNetwork(SimConfig(seed=config.seed))
        transport, stage1 = network.add_peer(data), network.add_peer(relay)
        forwards: list[int] = []

        async def on_forward(sender: str, payload: bytes) -> bytes:
            forwards.append(m.parse_carry(payload, sender, transport.limits, 2).key[2])
            return m.answer(m.OK)

        stage1.add_request_handler(m.FORWARD, on_forward)
        node = build_node(config, transport, 0, directory, pipeline_task(config), lambda event: None)
        x, y = node.task.batch(config.seed, data.peer_id, 0, config.train.batch_size)
        mb = Microbatch(0, x, y, 0)
        node.mbs = {0: mb}
        await node.start(mb, 0)
        out_shape = node.held[(data.peer_id, 0, 0)].out.shape
        mb.path = (data.peer_id, relay.peer_id)  # its output came home: the path is known
        await stage1.send(data.peer_id, m.BROKEN, enc({"src": data.peer_id, "seq": 0, "att": 0, "stage": 0}))
        for _ in range(100):
            if len(forwards) > 1:
                break
            await asyncio.sleep(0.05)
        late = m.Carry((data.peer_id, 0, 0), 0, 0, (data.peer_id, relay.peer_id), torch.ones(out_shape))
        word = await stage1.request(data.peer_id, m.BACKWARD, late.to_bytes(), 5.0)
        await node.close()
        return forwards, mb.att, word, transport.evidence

    forwards, att, word, evidence = run_simulation(main)
    assert forwards == [0, 1] and att == 1  # before: a malformed report, no restart
    assert word == m.answer(m.STALE) and evidence == []


def test_a_backward_for_a_microbatch_given_up_here_is_not_evidence():
    # The same Table II run on this session's code: a repair's REFORWARD made the stage-1 holder of a microbatch
    # look for another stage-2 peer while the first one's backward was on its way; it found none, gave the
    # microbatch up (DENY to the data node), and the backward that then arrived raised `unknown_microbatch`
    # against the honest stage-2 peer, whom the data nodes banned. Here the one stage-2 peer refuses the
    # forward, the relay gives it up, and the stage-2 peer's backward for it arrives.
    from phalanx.runs.pipeline.run import build_node, pipeline_task
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=3, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=2, microbatches=1))
    data, relay, late = (peer_identity(config.seed, i) for i in range(3))
    directory = {data.peer_id: 0, relay.peer_id: 1, late.peer_id: 2}

    async def main() -> tuple[list[bytes], list]:
        network = SimNetwork(SimConfig(seed=config.seed))
        source, transport, nxt = network.add_peer(data), network.add_peer(relay), network.add_peer(late)
        denied = asyncio.Event()
        source.add_message_handler(m.DENY, lambda sender, payload: denied.set())
        nxt.add_request_handler(m.FORWARD, lambda sender, payload: asyncio.sleep(0, m.answer(m.DENIED)))
        node = build_node(config, transport, 1, directory, pipeline_task(config), lambda event: None)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(1)[1:])
        key = (data.peer_id, 0, 0)
        word = await source.request(relay.peer_id, m.FORWARD, m.Carry(key, 0, 1, (data.peer_id,), x).to_bytes(), 5.0)
        grad = torch.ones_like(node.held[key].out)
        await asyncio.wait_for(denied.wait(), 5.0)  # it gave the microbatch up
        backward = m.Carry(key, 0, 1, (data.peer_id, relay.peer_id, late.peer_id), grad)
        words = [word, await nxt.request(relay.peer_id, m.BACKWARD, backward.to_bytes(), 5.0)]
        await node.close()
        return words, transport.evidence

    words, evidence = run_simulation(main)
    assert words == [m.answer(m.OK), m.answer(m.STALE)] and evidence == []  # before: unknown_microbatch


def test_a_download_that_ends_after_the_replica_caught_up_leaves_its_weights_alone():
    # The secure-gpt-pipeline all cell, seed 1, crashed the simulation: a catch-up's download ended after an
    # aggregation had brought the replica to that version, copied over the weights in use, and the backward of
    # a microbatch computed with them failed ("modified by an inplace operation"). Here a relay at version 1
    # computes a forward, then downloads version 1 from two peers that serve other weights, then gets the backward.
    from phalanx.core.serialization import digest
    from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

    config = _mlp_config(peers=4, data_nodes=1, steps=1, pipeline=PipelineConfig(stages=1, microbatches=1))
    data, relay, *peers = (peer_identity(config.seed, i) for i in range(4))
    directory = {data.peer_id: 0, relay.peer_id: 1, **{p.peer_id: 1 for p in peers}}

    async def main():
        network = SimNetwork(SimConfig(seed=config.seed))
        source, node = _relay_behind_a_bare_data_node(network, config, data, relay, directory)
        other = [p.detach() + 0.5 for p in node.params]
        body = {"version": 1, "digest": digest(b"".join(t.numpy().tobytes() for t in other)), "params": other, "state": {}}
        for identity in peers:
            network.add_peer(identity).add_request_handler(m.WEIGHTS, lambda sender, payload: asyncio.sleep(0, encode(body)))
        node.version = 1
        key = (data.peer_id, 0, 0)
        x = torch.randn(config.train.batch_size, *node.staged.input_shape(1)[1:])
        await source.request(relay.peer_id, m.FORWARD, m.Carry(key, 1, 1, (data.peer_id,), x).to_bytes(), 5.0)
        before = [p.detach().clone() for p in node.params]
        got = await node.fetch_weights(1, [p.peer_id for p in peers])
        backward = m.Carry(key, 1, 1, (data.peer_id, relay.peer_id), torch.ones_like(node.held[key].out))
        word = await source.request(relay.peer_id, m.BACKWARD, backward.to_bytes(), 5.0)
        same = all(torch.equal(a, b) for a, b in zip(before, node.params))
        await node.close()
        return got, word, same

    got, word, same = run_simulation(main)
    assert got is None and same and word == m.answer(m.OK)  # before: the weights were replaced, the backward crashed


def test_a_denied_microbatch_is_sent_again_as_soon_as_one_of_its_data_nodes_microbatches_finishes():
    # 4 microbatches, 2 stage-1 slots (2 relays x capacity 1): two are denied and wait for a slot. Each is sent
    # again the moment a microbatch of its data node finishes (its slots are free again), not a tenth of a
    # COMPLETE timeout later (a stage that lost a banned replica waited 0.5 s per iteration for that).
    config = _gpt_config(steps=2, capacity=1)
    summary = simulate_pipeline(config, progress=False)
    assert [(m["completed"], m["deferred"]) for m in summary["metrics"]] == [(4, 0), (4, 0)]
    ends = [mb["t_end"] for mb in summary["microbatches"]]
    sends = sorted((e for e in summary["events"] if e["kind"] == "send" and e["stage"] == 0), key=lambda e: e["t0"])
    denied: dict[tuple, float] = {}  # microbatch -> when its latest send was denied
    waited = []  # sends of a microbatch that every stage-1 relay had denied: when they started
    for e in sends:
        key = (e["it"], e["seq"], e["att"])
        if key in denied and abs(e["t0"] - denied[key]) > 1e-9:  # not the next relay tried at once
            waited.append(e["t0"])
        if e["answer"] == m.DENIED:
            denied[key] = e["t1"]
    assert len(waited) >= 2
    assert all(any(abs(t - end) < 1e-9 for end in ends) for t in waited)


def test_flow_handover_modes_reach_the_flow_driver():
    # Session 20 review (M3, L1): pipeline.flow_handover maps onto the FlowDriver (off: no handover; warmup:
    # handovers end at the first iteration; always: they run in iterations too), `off` by default (warmup
    # completed no handover in Table II's regime). A relay that joins mid-run under warmup starts with handovers
    # ended: its peers ended theirs, so its queries would go unanswered and lock its units until its first forward.
    from types import SimpleNamespace

    from phalanx.runs.pipeline.run import make_routing

    transport = SimpleNamespace(peer_id=peer_identity(0, 1).peer_id, add_message_handler=lambda topic, handler: None)
    seen = {}
    for mode in ("off", "warmup", "always"):
        config = _mlp_config(pipeline=PipelineConfig(stages=2, routing="gwtf", flow_handover=mode))
        for joiner in (False, True):
            _, flow = make_routing(config, transport, 1, 2, joiner=joiner)
            seen[mode, joiner] = (flow.node.config.handover, flow.handover_in_iterations, flow.node.handovers_ended)
    assert PipelineConfig().flow_handover == "off"
    assert seen == {
        ("off", False): (False, False, False), ("off", True): (False, False, True),
        ("warmup", False): (True, False, False), ("warmup", True): (True, False, True),  # before: a joiner probed
        ("always", False): (True, True, False), ("always", True): (True, True, False),
    }
