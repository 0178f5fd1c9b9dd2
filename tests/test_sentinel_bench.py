"""Smoke test of `phalanx bench sentinel --preset quick` (in-process 4-stage pipeline)."""

from phalanx.cli import main
from phalanx.experiments.sentinel_bench import quick, run_grid


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
