"""Stage gradients that can be recomputed (issue 18 item 2): validators recompute a stage replica's
gradient from the inputs it committed to, each sealed by its sender."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from test_stage_btard import START, _config

from phalanx.core.identity import Identity
from phalanx.core.serialization import DEFAULT_LIMITS, decode, encode
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline import messages as m
from phalanx.runtime.pipeline import stage_btard
from phalanx.runtime.pipeline.node import PipelineNode
from phalanx.runtime.pipeline.stages import contribution

VALIDATORS = 2  # of a group of 4: every replica is a validator or a target each iteration


def _honest_agree(summary: dict, liar: str) -> None:
    found = defaultdict(set)
    for peer, (stage, _version, digest) in summary["replicas"].items():
        if peer != liar:
            found[stage].add(digest)
    assert sorted(found) == [0, 1, 2] and all(len(d) == 1 for d in found.values())


def test_with_validators_a_clean_run_bans_nobody():
    # every replica is recomputed by a validator from its sealed inputs each iteration: honest ones match
    summary = simulate_pipeline(_config(validators=VALIDATORS), progress=False)
    assert summary["banned"] == [] and summary["bans"] == [] and summary["evidence"] == []
    assert all(m["completed"] == 8 for m in summary["metrics"])


# approve_all with scale -0.99 commits 0.99 x its true stage vector: a 1% lie, 100 x the tolerance
@pytest.mark.parametrize("attack,params", [("approve_all", {"scale": -0.99}), ("withhold_gradient", {})])
def test_a_replica_that_forges_its_stage_gradient_is_caught_by_a_validator_that_recomputes_it(attack, params):
    summary = simulate_pipeline(_config(attack=attack, params=params, validators=VALIDATORS), progress=False)
    liar = summary["peer_ids"][2]  # relay 1, stage 2
    assert summary["banned"] == [liar]
    assert {b["reason"] for b in summary["bans"]} == {"btard:gradient"}
    assert all(START <= b["step"] <= START + 2 for b in summary["bans"])
    assert all(m["completed"] == 8 for m in summary["metrics"])
    _honest_agree(summary, liar)
    if attack == "approve_all":  # what differed, as each replica recomputed it (the validator's claim too)
        claims = [e for e in summary["events"] if e["kind"] == "claim"]
        assert claims and all(c["peer"] == liar and c["by"] != liar for c in claims)
        for event, found in [(e, d) for e in summary["bans"] + claims for d in e["gradient"]]:
            assert found["target"] == liar and found["version"] == event["step"]  # recomputed at that step's weights
            assert found["gap"] > found["tolerance"] > 0 and found["max_abs"] > 0
            assert abs(found["ratio"] - 0.99) < 1e-6  # the lie: 0.99 x the true vector
            assert {p["j"] for p in found["partitions"]} == set(range(4)) and found["tensors"][0]["max_abs"] == found["max_abs"]
            assert len(found["microbatches"]) >= 1 and all(abs(mb["fit"] + 0.01) < 0.01 for mb in found["microbatches"])


def test_an_accuser_that_lies_about_a_recomputation_is_the_one_banned():
    # slander: the liar accuses an honest replica of a forged stage gradient, with its true committed
    # inputs and parts as evidence; every replica recomputes from them, finds it honest, bans the accuser
    summary = simulate_pipeline(_config(attack="slander", validators=VALIDATORS), progress=False)
    liar = summary["peer_ids"][2]
    assert summary["banned"] == [liar]
    assert {b["reason"] for b in summary["bans"]} == {"btard:slander:gradient"}
    _honest_agree(summary, liar)
    for ban in summary["bans"]:  # what the judges found in the evidence: the target's parts match the recomputation
        (found,) = ban["gradient"]
        assert found["accuser"] == liar and found["target"] != liar and found["version"] == ban["step"]
        assert found["gap"] <= found["tolerance"] and found["ratio"] == pytest.approx(1.0)


def test_a_replica_that_claims_an_input_nobody_sent_is_banned(monkeypatch):
    # From START the liar claims that the output gradient of its first microbatch was twice what its
    # sender sent, sealed by itself, and commits the stage vector that these inputs give: the
    # recomputation matches, only the seal (its own, not its sender's) gives it away
    config = _config(validators=VALIDATORS)
    liars = [peer_identity(config.seed, 2).peer_id]  # relay 1, stage 2
    honest_contribute, honest_record = PipelineNode.contribute, stage_btard.StageInputs.record

    def served(node: PipelineNode) -> list:
        paths = node.finished_paths
        return sorted(k for k in node.grads if k in paths and paths[k][node.stage] == node.me)

    def contribute(self, it, vector):
        if self.me not in liars or it < START or not served(self):
            return honest_contribute(self, it, vector)
        group = sorted(self.groups[self.stage])
        work = sum(1 for p in self.finished_paths.values() if len(p) > self.stage and p[self.stage] in group)
        return vector + contribution(self.grads[served(self)[0]], work, len(group))

    def record(self, it, group):
        honest_record(self, it, group)
        node = self.node
        if node.me not in liars or it < START or not served(node):
            return
        records = decode(self.mine[it], "", DEFAULT_LIMITS)
        first = records[0]
        first["g"] = first["g"] * 2
        key = (first["src"], first["seq"], first["att"])
        first["gs"] = m.Seal.make(node.transport.identity, key, it, "backward", node.stage, first["g"]).to_obj()
        self.mine[it] = encode(records)

    monkeypatch.setattr(PipelineNode, "contribute", contribute)
    monkeypatch.setattr(stage_btard.StageInputs, "record", record)
    summary = simulate_pipeline(config, progress=False)
    liar = summary["peer_ids"][2]
    assert liars == [liar]
    assert summary["banned"] == [liar]
    assert {b["reason"] for b in summary["bans"]} == {"btard:inputs"}
    _honest_agree(summary, liar)


def test_a_seal_binds_its_signer_tensor_microbatch_direction_and_stage():
    sender, other = Identity.generate(), Identity.generate()
    key, tensor = ("data", 3, 0), torch.arange(6, dtype=torch.float32).reshape(2, 3)
    seal = m.Seal.make(sender, key, 5, "forward", 2, tensor)
    assert seal.valid(key, 5, "forward", 2, tensor.clone())
    assert not seal.valid(key, 5, "forward", 2, tensor + 1e-3)  # another activation
    assert not seal.valid(("data", 4, 0), 5, "forward", 2, tensor)  # another microbatch
    assert not seal.valid(key, 5, "backward", 2, tensor) and not seal.valid(key, 5, "forward", 1, tensor)
    forged = m.Seal(other.peer_id, sender.public_key, seal.signature)  # someone else's key under its name
    assert not forged.valid(key, 5, "forward", 2, tensor)
    carry = m.Carry(key, 5, 2, ("data", "a"), tensor, seal=seal)
    parsed = m.parse_carry(carry.to_bytes(), "a", DEFAULT_LIMITS, 3)
    assert parsed.seal == seal and parsed.seal.valid(key, 5, "forward", 2, parsed.tensor)


def test_a_replica_that_holds_weights_of_another_version_cannot_judge_a_stage_gradient():
    # Issue 18's seed-1 launch: a joiner still at version 13 when iteration 14's round began kept version-13
    # weights for step 14, recomputed a peer's stage gradient with them and accused it (gap 250x the tolerance).
    from types import SimpleNamespace

    from phalanx.runtime.rounds.btard_state import CannotJudge

    inputs = stage_btard.StageInputs.__new__(stage_btard.StageInputs)
    inputs.node = SimpleNamespace(stage=1, transport=SimpleNamespace(limits=DEFAULT_LIMITS))
    part = torch.nn.Linear(3, 3)
    inputs.kept = {14: stage_btard._Iteration(part, {}, 4, 0, version=13), 15: stage_btard._Iteration(part, {}, 4, 0, version=15)}
    inputs.explained = {}
    for step in (14, 16):  # weights of version 13 kept for step 14; nothing kept for step 16
        with pytest.raises(CannotJudge):
            inputs.recompute("target", step, encode([]))
        assert inputs.explain("target", step, encode([]), {}, [])["judged"] is False
    assert float(inputs.recompute("target", 15, encode([])).norm()) == 0.0  # its own version: it judges


def test_a_sender_that_seals_two_activations_for_one_microbatch_is_reported_and_its_receiver_stays(monkeypatch):
    # From START the liar (relay 0, stage 1) sends each output a second time to the same receiver, scaled
    # by 1.01 under its own valid seal: the receiver holds two sealed activations for one microbatch, a
    # proof against their signer, and keeps computing with the first (the one it committed to)
    config = _config(validators=VALIDATORS)
    liar = peer_identity(config.seed, 1).peer_id
    honest_send = PipelineNode.send_forward

    async def send_forward(self, key):
        await honest_send(self, key)
        h = self.held.get(key)
        if self.me != liar or h is None or h.next_peer is None or h.carry.it < START:
            return
        tensor = h.out.detach() * 1.01
        carry = m.Carry(key, h.carry.it, self.stage + 1, h.carry.path + (self.me,), tensor,
                        seal=self.seal("forward", key, h.carry.it, self.stage + 1, tensor))
        await self.deliver(h.next_peer, "forward", carry)

    monkeypatch.setattr(PipelineNode, "send_forward", send_forward)
    summary = simulate_pipeline(config, progress=False)
    reported = {(accuser, peer, kind) for accuser, peer, kind in summary["evidence"]}
    assert reported and all(peer == liar and kind == "equivocation" for _, peer, kind in reported)
    assert summary["banned"] == []  # no stage round bans an honest receiver (nor the sender: it is not a stage-gradient lie)
    _honest_agree(summary, liar)


def test_a_replica_that_withholds_its_inputs_is_eliminated_with_its_validator(monkeypatch):
    # From START the liar answers no validator: only the validator saw the omission, so it eliminates the
    # target and goes with it (App. D.3's price: one honest peer at most per Byzantine)
    config = _config(validators=VALIDATORS)
    liar = peer_identity(config.seed, 2).peer_id
    honest_serve = stage_btard.StageInputs._serve

    async def serve(self, sender, payload):
        if self.node.me == liar and decode(payload, sender, DEFAULT_LIMITS)["it"] >= START:
            return encode({"it": 0, "inputs": None})
        return await honest_serve(self, sender, payload)

    monkeypatch.setattr(stage_btard.StageInputs, "_serve", serve)
    summary = simulate_pipeline(config, progress=False)
    reasons = {b["peer"]: b["reason"] for b in summary["bans"]}
    assert reasons[liar] == "btard:eliminated:no_inputs"
    validators = [p for p, r in reasons.items() if p != liar]
    assert len(validators) == 1 and reasons[validators[0]] == "btard:eliminator"
    assert sorted(summary["banned"]) == sorted([liar, *validators])
