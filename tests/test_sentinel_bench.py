"""Smoke test of `phalanx bench sentinel --preset quick` (in-process 4-stage pipeline)."""

import pytest

from phalanx.algorithms.sentinel.statistics import SentinelConfig
from phalanx.benchmarks.sentinel import (
    RunSpec,
    SentinelBenchConfig,
    quick,
    run_grid,
    run_one,
)
from phalanx.cli import main
from phalanx.core.errors import ConfigError


def test_quick_preset_bans_exactly_the_attackers_and_keeps_the_loss(tmp_path):
    config = quick()
    rows = {(r["attack"], r["defended"]): r for r in run_grid(config, tmp_path)}
    clean, clean_checked = rows[("none", False)], rows[("none", True)]
    assert clean_checked["banned"] == [] and clean_checked["fp_rate"] < 0.01
    for attack in ("zeros", "scaling"):
        defended = rows[(attack, True)]
        assert defended["banned"] == ["s1r2", "s2r2"] == defended["malicious"]
        assert defended["max_ban_iterations"] is not None and defended["max_ban_iterations"] <= 5
        # gradient-momentum substitution and the bans keep the loss within 3% of the clean run
        assert defended["val_loss"] <= clean["val_loss"] * 1.03
    assert rows[("zeros", False)]["val_loss"] > clean["val_loss"] * 1.03  # without SENTINEL the attack hurts
    assert (tmp_path / "results.csv").exists()


def test_cli_rejects_unknown_sentinel_preset(capsys):
    assert main(["bench", "sentinel", "--preset", "huge"]) == 2
    assert "unknown sentinel preset" in capsys.readouterr().err


def test_an_attack_inside_the_verifiers_warm_up_is_a_config_error():
    """The warm-up trusts every tensor: an attack starting inside it would be learned by the fences as honest."""
    with pytest.raises(ConfigError, match=r"attack_start=10 falls inside the verifiers' warm-up \(15 iterations"):
        SentinelBenchConfig(iterations=40, attack_start=10, microbatches=8, sentinel=SentinelConfig(warmup=120))
    SentinelBenchConfig(iterations=40, attack_start=15, microbatches=8, sentinel=SentinelConfig(warmup=120))


def test_a_100_step_delay_attacker_is_flagged_and_banned():
    """In-process pipeline: 1 of 4 relays per middle stage replays the tensors it sent 100 iterations earlier
    (another microbatch, an older model). The bind distance (each stage's output against its input for the
    same microbatch) flags them; both attackers and nobody else are banned within a few iterations."""
    config = SentinelBenchConfig(iterations=112, attack_start=104, delay=100, microbatches=4, batch_size=4,
                                 lr=1e-3, jobs=1, sentinel=SentinelConfig(warmup=120))
    row = run_one(config, RunSpec("delay", True))
    assert row["exact_bans"] and row["max_ban_iterations"] <= 6
    assert row["tampered"] > 0 and row["recall"] >= 0.8
