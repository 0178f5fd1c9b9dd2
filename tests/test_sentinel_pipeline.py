"""SENTINEL wired into the simulated pipeline: boundary verifiers and the client-routed data node.

Setup: character GPT, 1 data node + 2 relay stages x 3 relays, 8 microbatches per
iteration, warm-up 120 tensors per link and direction (15 iterations). Malicious
relays 2 (stage 1) and 3 (stage 2) attack activations and gradients from iteration
18. The verifiers never see which relays are malicious; the attack log is only used
here to check the exact banned set.
"""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.algorithms.sentinel.attacks import make_link_attack
from phalanx.benchmarks.sentinel_sim import score
from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.pipeline.config import LinkAttackConfig, PipelineRunConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.verifier import VerifierConfig

STEPS, START, MALICIOUS = 28, 18, "2,3"


def _config(attack: str = "none", placement: str = "boundary", routing: str = "swarm", enabled: bool = True,
            start: int = START, **sentinel):
    return PipelineRunConfig(
        peers=7, data_nodes=1, steps=STEPS,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.001, batch_size=4),
        # gwtf routes by its flow: with room for all 8 microbatches on one relay per stage the flow may leave
        # the attackers idle (nothing to detect); 3 per relay makes it use every relay of a stage
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=3 if routing == "gwtf" else 8, routing=routing),
        sentinel=VerifierConfig(enabled=enabled, placement=placement, warmup=120, **sentinel),
        attack=LinkAttackConfig(name=attack, relays=MALICIOUS if attack != "none" else "", start=start),
    )


def _tail_loss(summary: dict, n: int = 5) -> float:
    losses = [m["loss"] for m in summary["metrics"][-n:]]
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def clean():
    return simulate_pipeline(_config(), progress=False)


def _check_attackers_banned(summary: dict, within: int) -> set[str]:
    relays = summary["peer_ids"][1:]
    malicious = {relays[2], relays[3]}
    assert set(summary["banned"]) == malicious
    assert all(START <= b["step"] < START + within and b["reason"] == "sentinel" for b in summary["bans"])
    last_ban = max(b["step"] for b in summary["bans"])
    # after the ban no microbatch runs through a banned relay, and every iteration still finishes all 8
    later = [mb for mb in summary["microbatches"] if mb["it"] > last_ban and mb["outcome"] == "ok"]
    assert later and not any(set(mb["path"]) & malicious for mb in later)
    assert not [e for e in summary["events"] if e["kind"] == "fwd" and e["peer"] in malicious and e["it"] > last_ban]
    assert all(m["completed"] == 8 for m in summary["metrics"])
    tampered = [a for a in summary["attacks"] if a["tampered"]]
    assert tampered and {a["peer"] for a in tampered} == malicious
    return malicious


def test_clean_run_has_no_bans_and_few_false_flags(clean):
    judged = [v for v in clean["verdicts"] if v["reason"] not in ("warmup",)]
    flags = [v for v in judged if v["flagged"]]
    assert clean["banned"] == [] and clean["bans"] == []
    assert len(judged) > 300 and len(flags) / len(judged) < 0.01  # the bound, with the default vote
    assert any("bind" in v["distances"] for v in judged)  # the staleness distance takes part
    assert clean["attacks"] == []


def test_detect_only_flags_bans_nobody_and_scores_f1_over_many_tensors():
    summary = simulate_pipeline(_config("scaling", start=16, detect_only=True), progress=False)
    assert summary["bans"] == [] and summary["banned"] == []
    relays = summary["peer_ids"][1:]
    malicious = [relays[2], relays[3]]
    figures = score(summary, malicious, 16, relays)
    assert figures["tampered"] >= 100 and figures["f1"] >= 0.9
    # per worker: both attackers reach the strike rule (convicted, not banned), no honest relay does
    assert figures["detected"] == sorted(malicious) and figures["worker_f1"] == 1.0


@pytest.mark.parametrize("attack,placement,routing", [
    ("zeros", "boundary", "swarm"),
    ("scaling", "boundary", "gwtf"),
    ("zeros", "data_node", "swarm"),
])
def test_attackers_are_banned_rerouted_and_training_goes_on(clean, attack, placement, routing):
    summary = simulate_pipeline(_config(attack, placement, routing), progress=False)
    _check_attackers_banned(summary, within=3)
    if placement == "boundary":
        assert {b["by"] for b in summary["bans"]} <= set(summary["verifier_ids"].values())
    # momentum substitution and the bans keep the loss within 3% of the clean run
    assert _tail_loss(summary) <= _tail_loss(clean) * 1.03


def test_a_framing_relay_is_banned_and_the_framed_relay_is_not():
    """Relay 3 (stage 2) scales its outputs and writes a stage-1 peer into the path and the verifier record it
    forwards. Blame follows the verifiers' signatures, so the victim shares none of it; the broken record
    is evidence against the framer, which is banned in the first attacked iteration."""
    config = dataclasses.replace(_config(), attack=LinkAttackConfig(name="framing", relays="3", start=START))
    summary = simulate_pipeline(config, progress=False)
    relays = summary["peer_ids"][1:]
    framer = relays[3]
    victim = make_link_attack("framing", seed=config.seed, worker=framer).victim([relays[0], relays[2], relays[4]])
    assert summary["banned"] == [framer] and summary["bans"][0]["step"] == START
    assert any(v["reason"] == "forged_hop" and v["peer"] == framer for v in summary["verdicts"])
    assert victim not in summary["banned"]
    # the victim is blamed only for microbatches it really computed (as any upstream worker of a flagged tensor)
    computed = {(e["src"], e["seq"], e["att"]) for e in summary["events"] if e["kind"] == "fwd" and e["peer"] == victim}
    blamed = {(v["src"], v["seq"], v["att"]) for v in summary["verdicts"] if victim in v["suspects"]}
    assert blamed <= computed
    assert all(m["completed"] == 8 for m in summary["metrics"])


def test_sentinel_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sentinel.placement"):
        override(_config(), ["sentinel.placement=everywhere"])
    with pytest.raises(ConfigError, match="sentinel.forward_response"):
        override(_config(), ["sentinel.forward_response=drop"])
    with pytest.raises(ConfigError, match="sentinel.placement"):
        override(_config(), ["sentinel.placement=data_node", "pipeline.routing=gwtf"])
    with pytest.raises(ConfigError, match="sentinel.k"):
        override(_config(), ["sentinel.k=-1"])
    with pytest.raises(ConfigError, match="attack.relays"):
        override(_config(), ["attack.relays=9"])
    with pytest.raises(ConfigError, match="attack.name"):
        override(_config(), ["attack.name=gossip"])
