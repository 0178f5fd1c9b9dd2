"""BTARD per pipeline stage (issue 18): the replicas of each relay stage aggregate with the secure round."""

from __future__ import annotations

from collections import defaultdict

import pytest

from phalanx.core.errors import ConfigError
from phalanx.core.serialization import DEFAULT_LIMITS, encode
from phalanx.runs.config import override
from phalanx.runs.pipeline.config import PipelineRunConfig, StageByzantineConfig
from phalanx.runs.pipeline.report import report_pipeline
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runs.presets import get_preset
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.stage_btard import StageBanReports
from phalanx.runtime.rounds.btard import BTARDConfig
from phalanx.runtime.rounds.butterfly import AllReduceConfig

START = 2  # the liar's first lying iteration


def _config(btard: bool = True, attack: str = "none", relays: str = "1", validators: int = 0,
            params: dict | None = None, **kw) -> PipelineRunConfig:
    # 1 data node + 2 stages x 4 relays (relay r is in stage 1 + r mod 2: relay 1 is in stage 2),
    # 8 microbatches of capacity 2, so every replica serves and contributes
    return PipelineRunConfig(
        peers=9, data_nodes=1, steps=7,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=2),
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        btard=BTARDConfig(enabled=btard, validators=validators),
        byzantine=StageByzantineConfig(attack=attack, relays=relays if attack != "none" else "", start_step=START,
                                       params=params or {}),
        **kw,
    )


def _digests_by_stage(summary: dict, leave_out: set[str] = frozenset()) -> dict[int, set[str]]:
    """Final parameter digests of the replicas that finished every iteration, by stage."""
    found = defaultdict(set)
    for peer, (stage, _version, digest) in summary["replicas"].items():
        if peer not in leave_out:
            found[stage].add(digest)
    return found


def _losses(summary: dict) -> list[float]:
    return [m["loss"] for m in summary["metrics"]]


@pytest.fixture(scope="module")
def plain():
    return simulate_pipeline(_config(btard=False), progress=False)


def test_a_clean_run_with_btard_bans_nobody_and_its_loss_matches_the_plain_run(plain):
    # Same reducer, same microbatches: the secure round reduces the same rows as the plain butterfly,
    # in another order (float rounding only), so the losses agree to 1e-4 relative
    summary = simulate_pipeline(_config(), progress=False)
    assert summary["banned"] == [] and summary["bans"] == [] and summary["evidence"] == []
    assert all(m["completed"] == 8 for m in summary["metrics"])
    assert _losses(summary) == pytest.approx(_losses(plain), rel=1e-4)
    digests = _digests_by_stage(summary)
    assert sorted(digests) == [0, 1, 2] and all(len(d) == 1 for d in digests.values())
    assert len(summary["replicas"]) == 9


@pytest.mark.parametrize("attack", ["agg_shift", "scaled_aggregate", "list_nobody", "equivocate", "slander"])
def test_a_replica_that_lies_in_its_stage_all_reduce_is_banned_and_training_goes_on(plain, attack):
    summary = simulate_pipeline(_config(attack=attack), progress=False)
    liar = summary["peer_ids"][1 + 1]  # relay 1, stage 2
    assert summary["banned"] == [liar]
    assert {b["step"] for b in summary["bans"]} == {START}  # caught on the iteration it first lies
    assert all(b["reason"].startswith("btard:") for b in summary["bans"])
    # every honest replica of its stage recorded the ban (the run's one ledger)
    stage2 = {p for p in summary["peer_ids"][1:] if summary["peer_ids"].index(p) % 2 == 0}
    assert {b["by"] for b in summary["bans"]} >= stage2 - {liar}
    # the ban takes effect at the end of iteration START + 1's round: from START + 2 on the liar
    # is out of routing (no microbatch through it) and out of its stage's group
    served = {e["it"] for e in summary["events"] if e["kind"] == "fwd" and e["peer"] == liar}
    assert served and max(served) <= START + 1
    groups = {e["it"]: e["group"] for e in summary["events"] if e["kind"] == "aggregate" and e["stage"] == 2 and e["peer"] != liar}
    assert groups[START] == 4 and all(groups[it] == 3 for it in range(START + 2, 7))
    # training goes on: every microbatch completes, honest replicas of each stage agree, loss near clean
    assert all(m["completed"] == 8 for m in summary["metrics"])
    digests = _digests_by_stage(summary, {liar})
    assert sorted(digests) == [0, 1, 2] and all(len(d) == 1 for d in digests.values())
    assert abs(_losses(summary)[-1] - _losses(plain)[-1]) < 0.05


def test_btard_on_a_pipeline_preset_is_one_override_and_bad_combinations_are_one_line_errors():
    config = override(get_preset("chars-gpt-pipeline"), ["btard.enabled=true", "allreduce.reducer=centered_clip"])
    assert config.btard.enabled and config.btard.validators == 0
    secure = get_preset("secure-gpt-pipeline")
    assert secure.btard.enabled and secure.sentinel.enabled and secure.pipeline.routing == "gwtf"
    assert secure.btard.validators == 2  # stage gradients recomputed from sealed inputs (issue 18 item 2)
    assert (secure.peers - secure.data_nodes) // secure.pipeline.stages == 4 and secure.pipeline.stages == 3
    bad = [
        (["btard.enabled=true", "allreduce.reducer=median"], "allreduce.reducer='median' cannot be verified by BTARD"),
        (["byzantine.attack=agg_shift", "byzantine.relays=0"], "is a BTARD protocol attack on the stage all-reduce"),
        (["btard.enabled=true", "byzantine.attack=agg_shift", "byzantine.relays=9"], "byzantine.relays='9' must list relay indices below"),
        (["byzantine.attack=sign_flip"], "byzantine.attack='sign_flip' is not known"),
    ]
    for assignments, message in bad:
        with pytest.raises(ConfigError) as exc:
            override(get_preset("chars-gpt-pipeline"), assignments)
        assert message in str(exc.value) and "\n" not in str(exc.value)


class _Node:
    """What `StageBanReports` reads of a pipeline node."""

    def __init__(self) -> None:
        self.me = "data"
        self.directory = {"data": 0, "a": 1, "b": 1, "c": 1, "d": 1, "x": 2}
        self.groups = [["data"], ["a", "b", "c", "d"], ["x"]]
        self.banned: set[str] = set()
        self.flow = None
        self.transport = self

    limits = DEFAULT_LIMITS

    def add_message_handler(self, topic, handler) -> None:
        self.handler = handler


def test_a_reported_stage_ban_is_applied_on_a_majority_of_that_stage_only():
    node = _Node()
    StageBanReports(node)
    ban = encode({"peer": "d", "it": 3, "stage": 1})
    node.handler("a", ban)
    node.handler("x", encode({"peer": "d", "it": 3, "stage": 2}))  # another stage's replica: proves nothing
    node.handler("a", ban)  # the same reporter twice counts once
    assert node.banned == set()
    node.handler("b", ban)
    assert node.banned == set()  # 2 of 4 is not a majority
    node.handler("c", ban)
    assert node.banned == {"d"}


def test_the_report_lists_btard_bans_with_their_iteration_and_reason(tmp_path):
    summary = simulate_pipeline(_config(attack="agg_shift"), out=tmp_path, progress=False)
    liar = summary["peer_ids"][2]
    table = report_pipeline(tmp_path, summary)
    assert f"{liar[:8]} {START} btard:v2_sum" in table and (tmp_path / "stages.png").exists()
    assert "crashed" not in table  # simulate has no processes
    # a launch's summary: a relay that came back twice, served, then crashed the second time
    table = report_pipeline(tmp_path, {**summary, "joiners": {"5": ["served", "crashed"]}, "crashed": [{"name": "5", "code": 1}]})
    assert "crashed: 1, served: 1" in table and "5 (code 1)" in table
