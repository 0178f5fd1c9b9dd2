"""`phalanx bench secure-pipeline` (issue 18 item 5): its runs, and a tiny slice of its table."""

import pytest

from phalanx.benchmarks.secure_pipeline import (
    PRESETS,
    SecurePipelineConfig,
    attackers,
    format_table,
    goals,
    measure,
    read_rows,
    run_bench,
    run_config,
    runs_of,
)
from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.launch_churn import iteration_churn
from phalanx.runs.pipeline.presets import PIPELINE_PRESETS


def test_each_cell_sets_its_attackers_on_each_side():
    config = PRESETS["full"]()
    secure = run_config(config, "all", "secure", 2)
    assert (secure.seed, secure.btard.enabled, secure.sentinel.enabled) == (2, True, True)
    assert (secure.attack.name, secure.attack.indices, secure.byzantine.attack, secure.byzantine.indices) == ("zeros", [1], "agg_shift", [0])
    assert (secure.faults.leave_rate, secure.faults.join_rate) == (0.1, 0.1)
    plain = run_config(config, "protocol", "plain", 0)
    assert (plain.btard.enabled, plain.sentinel.enabled, plain.allreduce.reducer) == (False, False, "mean")
    assert (plain.attack.name, plain.attack.target, plain.attack.factor, plain.attack.indices) == ("scaling", "aggregation", -10.0, [0])
    assert attackers(config, "all", "secure") == {1: ("link", 20), 0: ("protocol", 10)}
    assert attackers(config, "all", "plain") == {1: ("link", 20)}
    forger = run_config(config, "forge", "secure", 0)
    assert (forger.byzantine.attack, forger.byzantine.indices, forger.byzantine.start_step) == ("approve_all", [8], 10)
    assert ("forge", "secure", 0) in runs_of(config)
    unknown = override(config, ["forge_attack=no_such_attack"])  # not registered: the cell is left out, not run
    assert not unknown.forge_available() and all(cell != "forge" for cell, _, _ in runs_of(unknown))
    with pytest.raises(ConfigError, match="cells"):
        override(config, ["cells=clean,bogus"])
    with pytest.raises(ConfigError, match="clean"):
        SecurePipelineConfig(cells="link")


def test_the_lying_replica_is_banned_alone_and_the_clean_run_bans_nobody(tmp_path):
    # 3 iterations, the stage-1 replica (relay 0) shifts its partition of the stage aggregate from iteration 1.
    config = SecurePipelineConfig(steps=3, seeds=1, cells="clean,protocol", sides="secure", protocol_start=1, jobs=1)
    rows = run_bench(config, tmp_path, log=lambda line: None)
    clean, liar = rows
    assert (clean["cell"], clean["banned"], clean["honest_banned"]) == ("clean", "", 0)
    assert (liar["cell"], liar["byzantine"], liar["banned"], liar["exact"]) == ("protocol", "0", "0", True)
    assert liar["steps_to_ban"] == "0:0" and liar["honest_banned"] == 0
    assert abs(liar["final_loss"] / clean["final_loss"] - 1) < 0.03
    table = format_table(rows, config)
    assert "goal exact bans: met" in table and "goal no honest ban: met" in table
    assert read_rows(tmp_path / "runs.csv") == rows  # read_only=true tabulates what a run wrote


def test_a_byzantine_relay_retired_before_its_attack_counts_as_removed_and_one_retired_after_it_as_a_miss():
    # The all cell's seed 2: relay 0 (agg_shift from step 10) left at iteration 4 and its stage retired it
    # (departed:unverifiable); refused on every join, it never lied. Relay 3 (honest) was retired at 15.
    config = PRESETS["full"]()
    run = run_config(config, "protocol", "secure", 2)
    peer = {r: peer_identity(run.seed, run.data_nodes + r).peer_id for r in (0, 3)}

    def summary(retired_at: int) -> dict:
        events = [{"kind": "retire", "peer": peer[0], "step": retired_at}, {"kind": "retire", "peer": peer[3], "step": 15}]
        return {"bans": [], "events": events, "metrics": [{"loss": 3.0}], "microbatches": [], "attacks": [],
                "simulated_seconds": 1.0}

    byzantine = attackers(config, "protocol", "secure")
    early = measure(run, summary(4), byzantine)
    assert (early["exact"], early["steps_to_ban"], early["retired"], early["honest_banned"]) == (True, "0:out", "0 3", 0)
    late = measure(run, summary(12), byzantine)  # retired after it could lie: it escaped a ban by leaving
    assert (late["exact"], late["steps_to_ban"]) == (False, "0:-")
    # retired at step 9 but the retirement settled late: it rejoined and aggregated at 10 and 11, so it could lie
    rejoined = summary(9)
    rejoined["events"] += [{"kind": "aggregate", "peer": peer[0], "it": it, "in_group": True} for it in (10, 11)]
    assert (measure(run, rejoined, byzantine)["exact"], measure(run, rejoined, byzantine)["steps_to_ban"]) == (False, "0:-")
    four = override(config, ["link_relays=4"])  # session 21's link cell, seed 2: relay 4 was on no path, tampered nothing
    link = run_config(four, "link", "secure", 2)
    idle = measure(link, summary(4), attackers(four, "link", "secure"))
    assert (idle["exact"], idle["steps_to_ban"]) == (True, "4:idle")
    lying = {**summary(4), "attacks": [{"peer": peer_identity(link.seed, link.data_nodes + 4).peer_id, "tampered": True}]}
    assert measure(link, lying, attackers(four, "link", "secure"))["steps_to_ban"] == "4:-"
    rows = [{**early, "cell": "protocol", "side": "secure", "seed": 2}]
    assert "honest relays retired (departed leaving a check unjudged): protocol/2: 3" in goals(rows)


def test_the_all_cells_attackers_stay_so_that_every_attack_runs_in_every_seed():
    """Session 22: before, churn took the link attacker for good at iteration 12 of seed 0 (it never lied) and
    retired it before its attack in seed 2. The all cell's Byzantine relays now never leave by churn, and both
    sides of a seed draw the same churn."""
    config = PRESETS["full"]()
    steps = PIPELINE_PRESETS[config.preset]().steps
    for seed in range(3):
        secure, plain = (run_config(config, "all", side, seed) for side in ("secure", "plain"))
        assert secure.faults == plain.faults and secure.faults.staying == [0, 1]
        assert (secure.faults.leave_span, secure.faults.stage_floor) == (0.11, 2)  # a moment and a rule both sides share
        histories = []
        for run in (secure, plain):
            relays = [str(r) for r in range(run.relays)]
            down, history = set(), []
            for it in range(steps):
                for relay, fraction in iteration_churn(run.seed, it, relays, down, run.faults, {str(r) for r in run.faults.staying}):
                    (down.discard if fraction is None else down.add)(relay)
                    history.append((it, relay, fraction))
            histories.append(history)
            assert not {relay for _, relay, fraction in history if fraction is not None} & {"0", "1"}, seed
            assert history  # churn still takes the honest relays
        assert histories[0] == histories[1]
    with pytest.raises(ConfigError, match="faults.stay"):
        override(run_config(config, "all", "secure", 0), ["faults.stay=12"])
    assert run_config(override(config, ["stay=false"]), "all", "secure", 0).faults.staying == []  # the old choice


def test_the_table_counts_the_churn_decisions_the_two_sides_share():
    from phalanx.benchmarks.secure_pipeline import churn_comparison

    secure, plain = "1:3:L 2:3:R 5:4:S 7:2:L", "1:3:L 2:3:R 5:4:L 6:4:R 7:2:L"
    assert churn_comparison(secure, plain) == "3 of 5 the same; differ: 5:4 S/L, 6:4 -/R"
    assert churn_comparison("", "") == "0 of 0 the same"
