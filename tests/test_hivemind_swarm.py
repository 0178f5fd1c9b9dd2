"""Three real OS processes over hivemind: training steps and an MPRNG round, bounded in time."""

import dataclasses
import json

import pytest

from phalanx.experiments.launch import launch
from phalanx.experiments.simulate import simulate
from phalanx.presets import get_preset

pytestmark = pytest.mark.hivemind



def test_three_processes_train_and_agree_on_mprng(tmp_path):
    config = dataclasses.replace(get_preset("digits-dp"), peers=3, steps=6, mprng_every=3)
    real = launch(config, tmp_path / "launch", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "launch" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["peers"] == 3 and r["dropped"] == 0 and r["missing_parts"] == 0 for r in rows)
    mprng_rows = [r for r in rows if "mprng" in r]
    assert [r["step"] for r in mprng_rows] == [2, 5]
    assert all(r["mprng_agree"] for r in mprng_rows)
    assert mprng_rows[0]["mprng"] != mprng_rows[1]["mprng"]
    assert real["banned"] == []
    # Same seed, same public batches and identities: the simulator computes the same losses.
    simulated = simulate(config, tmp_path / "sim", progress=False)
    sim_rows = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert len(sim_rows) == len(rows)
    for a, b in zip(rows, sim_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert real["final_accuracy"] == pytest.approx(simulated["final_accuracy"], abs=0.02)
