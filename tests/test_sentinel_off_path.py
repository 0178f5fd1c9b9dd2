"""SENTINEL's boundary verifiers off the data path (`sentinel.hop=off_path`, issue 18).

Setup: character GPT, 1 data node + 2 relay stages x 3 relays, 8 microbatches per iteration, a short
verifier warm-up (24 tensors per link and direction, 3 iterations). Senders send each carry straight to
its receiver and a copy to the link's verifier; receivers send the verifier a receipt; the verifier tells
the data node its verdicts, and the data node aggregates only microbatches whose every relay-sent tensor
was cleared. The verifiers never see which relays are malicious.
"""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import LinkAttackConfig, PipelineRunConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline import messages as m
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.links import Links
from phalanx.runtime.pipeline.verifier import VerifierConfig, VerifierHop

STEPS, START = 8, 4


def _config(attack: str = "none", relays: str = "", hop: str = "off_path", steps: int = STEPS,
            target: str = "both") -> PipelineRunConfig:
    return PipelineRunConfig(
        peers=7, data_nodes=1, steps=steps,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.001, batch_size=4),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=8, routing="swarm"),
        sentinel=VerifierConfig(enabled=True, placement="boundary", hop=hop, warmup=24),
        attack=LinkAttackConfig(name=attack, relays=relays, start=START, target=target),
    )


def _flagged(summary: dict) -> set[tuple]:
    """(iteration, key) of every tensor a verifier flagged."""
    return {(v["it"], (v["src"], v["seq"], v["att"])) for v in summary["verdicts"] if v["flagged"]}


def _aggregated(summary: dict) -> set[tuple]:
    """(iteration, key) of every microbatch in a BEGIN's finished list."""
    return {(mb["it"], (mb["src"], mb["seq"], mb["att"])) for mb in summary["microbatches"] if mb["outcome"] == "ok"}


def test_a_tampered_activation_is_banned_off_the_path_and_its_microbatch_is_not_aggregated():
    summary = simulate_pipeline(_config("zeros", "2"), progress=False)
    attacker = summary["peer_ids"][1:][2]
    assert summary["banned"] == [attacker]
    flagged = _flagged(summary)
    assert flagged and not flagged & _aggregated(summary)
    # the data node itself left out microbatches that had finished (without the verdicts they would be aggregated)
    left_out = [e for e in summary["events"] if e["kind"] == "unverified" and e["flagged"]]
    assert left_out and all((e["it"], (e["src"], e["seq"], e["att"])) in flagged for e in left_out)
    # nothing is substituted off the path, and training goes on around the ban
    assert not any(v["substituted"] for v in summary["verdicts"])
    assert summary["metrics"][-1]["completed"] == 8


def test_a_relay_that_shows_the_verifier_another_tensor_than_the_receiver_is_banned(monkeypatch):
    """Relay 2 (stage 1) sends zeros to its receivers and, to the verifier, its honest output under a record it
    signs for that one. The receiver's receipt carries the record signed for the zeros: two digests signed
    for one hop, the sender's equivocation."""
    honest_copy = Links.send_copy

    async def send_copy(self, verifier, direction, to, c, pad):
        h = self.held.get(c.key)
        if direction == "forward" and self.me == forker and c.it >= START and h is not None:
            own = c.hops[-1]
            shown = h.out.detach()
            record = m.Hop.signed(self.transport.identity, own.key, own.it, own.direction, own.link, own.sender,
                                  own.received, m.tensor_digest(shown), own.to)
            c = dataclasses.replace(c, tensor=shown, hops=c.hops[:-1] + (record,))
        await honest_copy(self, verifier, direction, to, c, pad)

    config = _config("zeros", "2", target="activations")
    forker = peer_identity(config.seed, 3).peer_id  # relay 2 is peer 3 (after the data node)
    monkeypatch.setattr(Links, "send_copy", send_copy)
    summary = simulate_pipeline(config, progress=False)
    assert summary["peer_ids"][3] == forker
    assert summary["banned"] == [forker]
    forked = [v for v in summary["verdicts"] if v["reason"] == "forked_copy"]
    assert forked and {v["peer"] for v in forked} == {forker}
    assert summary["bans"][0]["step"] == START
    # what the verifier was shown passed its fences: only the receipts caught it
    assert not [v for v in summary["verdicts"] if v["peer"] == forker and v["flagged"] and v["reason"] != "forked_copy"]
    assert not {(v["it"], (v["src"], v["seq"], v["att"])) for v in forked} & _aggregated(summary)


def test_a_relay_that_keeps_its_tensors_from_the_verifier_is_banned(monkeypatch):
    """Relay 2 (stage 1) sends no copy from iteration START on (its tensors are honest: it only hides them).
    Its receivers' receipts show the verifier signed records of tensors it never got: flags against the relay
    alone, which ban it; those microbatches are not aggregated and no honest relay is banned."""
    honest_copy = Links.send_copy

    async def send_copy(self, verifier, direction, to, c, pad):
        if not (self.me == skipper and c.it >= START):
            await honest_copy(self, verifier, direction, to, c, pad)

    config = _config()
    skipper = peer_identity(config.seed, 3).peer_id
    monkeypatch.setattr(Links, "send_copy", send_copy)
    summary = simulate_pipeline(config, progress=False)
    assert summary["banned"] == [skipper] and START <= summary["bans"][0]["step"] <= START + 1
    hidden = [v for v in summary["verdicts"] if v["reason"] == "no_copy"]
    assert hidden and {v["peer"] for v in hidden} == {skipper}
    assert not {(v["it"], (v["src"], v["seq"], v["att"])) for v in hidden} & _aggregated(summary)
    assert summary["metrics"][-1]["completed"] == 8


def test_off_the_path_a_send_is_one_round_trip_and_inline_two():
    """The structure of a clean iteration: a send through an inline verifier crosses 4 links (sender ->
    verifier -> receiver and back), off the path 2; both runs finish every microbatch."""
    latency = _config().network.latency
    durations = {}
    for hop in ("inline", "off_path"):
        summary = simulate_pipeline(_config(hop=hop, steps=3), progress=False)
        sends = [e["t1"] - e["t0"] for e in summary["events"] if e["kind"] == "send" and e["answer"] == m.OK]
        durations[hop] = (min(sends), max(sends))
        assert all(r["completed"] == 8 for r in summary["metrics"])
    assert 2 * latency <= durations["off_path"][0] and durations["off_path"][1] < 3 * latency
    assert durations["inline"][0] >= 4 * latency


def test_a_verifier_that_never_answers_costs_the_gradients_not_the_run(monkeypatch):
    monkeypatch.setattr(VerifierHop, "_tell", lambda self, slot, passed, sent: None)
    summary = simulate_pipeline(_config(steps=2), progress=False)
    assert [r["completed"] for r in summary["metrics"]] == [0, 0]  # nothing cleared: nothing aggregated
    unverified = [e for e in summary["events"] if e["kind"] == "unverified"]
    assert len(unverified) == 16 and not any(e["flagged"] for e in unverified)
    assert summary["banned"] == []


def test_off_path_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sentinel.hop"):
        override(_config(), ["sentinel.hop=sideways"])
    with pytest.raises(ConfigError, match="sentinel.hop=off_path"):
        override(_config(), ["sentinel.forward_response=substitute"])
    with pytest.raises(ConfigError, match="sentinel.verdict_timeout"):
        override(_config(), ["sentinel.verdict_timeout=0"])
