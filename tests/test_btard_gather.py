"""The gather of a stage round (issue 18): owners that left before committing are not waited for, and a Byzantine that
looks gone to one replica, commits late to another only and declares to it only splits no stage's weights."""

from __future__ import annotations

import asyncio

from phalanx.core.envelope import SignedEnvelope
from phalanx.core.errors import PeerTimeout
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import ChurnConfig, PipelineRunConfig, StageByzantineConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.stage_btard import StageView
from phalanx.runtime.rounds.btard import BTARDConfig, SecureRound
from phalanx.runtime.rounds.butterfly import AllReduceConfig
from phalanx.transport.base import BROADCAST_TOPIC
from phalanx.transport.sim import SimTransport

IT = 3  # the iteration whose stage-2 round the tests disturb
T = 2.5  # btard.timeout (allreduce.timeout 5 s): the gather waits up to 7.5 s for a missing declaration


def _config(steps: int = 5, attack: str = "none", relays: str = "") -> PipelineRunConfig:
    # 1 data node + 2 stages x 4 relays (relay r is in stage 1 + r mod 2: stage 2 is relays 1, 3, 5, 7)
    return PipelineRunConfig(
        peers=9, data_nodes=1, steps=steps,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=2),
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        btard=BTARDConfig(enabled=True, validators=2, timeout=T),
        byzantine=StageByzantineConfig(attack=attack, relays=relays, start_step=IT),
        faults=ChurnConfig(),
    )


def _pid(relay: int) -> str:
    return peer_identity(0, 1 + relay).peer_id


def _stage_digests(summary: dict, leave_out: set[str]) -> set[str]:
    return {d for p, (s, _, d) in summary["replicas"].items() if s == 2 and p not in leave_out}


def _crash_at_commitment(monkeypatch, crashed: set[str]) -> None:
    """`crashed` crash as their round of iteration IT commits, before their commitments go out."""
    commit = SecureRound._commit

    async def crash(self, st, parts):
        if st.step == IT and self.transport.peer_id in crashed:
            self.transport.inner._network.crash(self.transport.peer_id)
            await asyncio.sleep(3600)  # cancelled by the crash
        return await commit(self, st, parts)

    monkeypatch.setattr(SecureRound, "_commit", crash)


def _gather_times(monkeypatch) -> dict[str, float]:
    """How long each replica's gather of iteration IT took (simulated seconds), filled as the run goes."""
    gather, took = SecureRound._gather, {}

    async def timed(self, st, mine, rcommitted):
        start = self.transport.clock.now()
        try:
            return await gather(self, st, mine, rcommitted)
        finally:
            if st.step == IT:
                took[self.transport.peer_id] = self.transport.clock.now() - start

    monkeypatch.setattr(SecureRound, "_gather", timed)
    return took


def test_a_stage_does_not_wait_for_the_declarations_of_the_half_that_left_before_committing(monkeypatch):
    # Issue 18's all/1, iteration 4: half of stage 3 left at the iteration's opening, and the two others waited
    # allreduce.timeout + btard.timeout (10 s there) for their declarations, since two declarations of four decide
    # nothing (`passed_over`). Here relays 3 and 5 of stage 2 crash before committing at iteration 3: they are out
    # of the survivors' views by then and no commitment of theirs reached anyone, so the gather stops after its
    # minimum (the fetch of withheld declarations, btard.timeout / 2) and passes them over. Before: 7.5 s each.
    crashed = {_pid(3), _pid(5)}
    _crash_at_commitment(monkeypatch, crashed)
    took = _gather_times(monkeypatch)
    summary = simulate_pipeline(_config(), progress=False)
    survivors = [_pid(1), _pid(7)]
    assert all(took[p] < T for p in survivors)
    assert summary["bans"] == [] and summary["banned"] == []
    assert len(_stage_digests(summary, crashed)) == 1
    assert all(m["completed"] == 8 for m in summary["metrics"])


def test_a_byzantine_that_looks_gone_to_one_replica_and_declares_to_another_only_splits_no_weights(monkeypatch):
    # The adversary of the gather's early stop. Relay 7 crashes before committing at iteration 3, so the declarations
    # of the other three are the group's but one. Byzantine relay 5 looks gone to honest relay 1 from the start of
    # 1's round of iteration 3 to the end of its gather (out of 1's view, sends it nothing, answers none of its
    # requests); it sends its commitment to relay 3 only, after 3's commitment wait (3 x btard.timeout: 5 was in its
    # view and silent), so that 3 holds it and waits its gather out, and its declaration to relay 3 only, after relay
    # 1 stopped. Relay 1 stops once 3's declaration is in (5 and 7 gone, no commitment of theirs here); relay 3 holds
    # 5's declaration and waits the whole gather: the two cut differently. Had 3 applied 5's aggregate (nobody
    # passed over while the declarations do not decide it, as before), relay 1 could not have taken it from 3 (3's
    # round was still open and 5's declaration not yet there when 1 filled its missing partitions), and stage 2's
    # honest weights parted for good. Both pass 5 over (both declarations drop it as silent): one digest, and 5,
    # late for both owners that declared, departs.
    byzantine, blind, other, crashed = _pid(5), _pid(1), _pid(3), _pid(7)
    _crash_at_commitment(monkeypatch, {crashed})
    gone, held = {"now": False}, {}
    members, send, request, broadcast = SimTransport.members, SimTransport.send, SimTransport.request, StageView.broadcast
    call, gather = SecureRound.__call__, SecureRound._gather

    async def blind_round(self, step, vector, group):
        if self.transport.peer_id == blind and step == IT:
            gone["now"] = True
        return await call(self, step, vector, group)

    async def blind_gather(self, st, mine, rcommitted):
        try:
            return await gather(self, st, mine, rcommitted)
        finally:
            if st.step == IT:
                held[self.transport.peer_id] = set(self.transport.board.get("bt.rcommit", IT))
            if self.transport.peer_id == blind and st.step == IT:
                gone["now"] = False

    async def withheld(self, peer, topic, payload):
        if not (gone["now"] and self.peer_id == byzantine and peer == blind):
            await send(self, peer, topic, payload)

    async def unanswered(self, peer, topic, payload, timeout):
        if gone["now"] and self.peer_id == blind and peer == byzantine:
            await asyncio.sleep(timeout)
            raise PeerTimeout(peer, "looks gone")
        return await request(self, peer, topic, payload, timeout)

    opened = {}

    async def to_one_late(self, topic, step, payload):
        if not (self.peer_id == byzantine and step == IT and topic in ("bt.commit", "bt.rcommit")):
            return await broadcast(self, topic, step, payload)
        opened.setdefault(step, self.clock.now())
        envelope = SignedEnvelope.create(self.identity, topic, step, payload)

        async def later():
            await asyncio.sleep(opened[step] + (3.2 if topic == "bt.commit" else 3.6) * T - self.clock.now())
            self.board.add(envelope)
            await self.send(other, BROADCAST_TOPIC, envelope.to_bytes())

        if topic == "bt.commit":
            asyncio.ensure_future(later())
        else:
            await later()
        return envelope

    monkeypatch.setattr(SecureRound, "__call__", blind_round)
    monkeypatch.setattr(SecureRound, "_gather", blind_gather)
    monkeypatch.setattr(SimTransport, "members", lambda self: [p for p in members(self) if not (
        gone["now"] and self.peer_id == blind and p == byzantine)])
    monkeypatch.setattr(SimTransport, "send", withheld)
    monkeypatch.setattr(SimTransport, "request", unanswered)
    monkeypatch.setattr(StageView, "broadcast", to_one_late)
    summary = simulate_pipeline(_config(), progress=False)
    assert byzantine not in held[blind] and byzantine in held[other]  # the two cut differently
    assert set(summary["banned"]) <= {byzantine}
    assert len(_stage_digests(summary, {byzantine, crashed})) == 1
    assert sum(1 for p, (s, _, _) in summary["replicas"].items() if s == 2 and p not in (byzantine, crashed)) == 2
