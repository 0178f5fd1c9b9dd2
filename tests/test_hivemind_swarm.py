"""Three real OS processes over hivemind: training steps and an MPRNG round, bounded in time."""

import dataclasses
import json
import os
import runpy
from pathlib import Path

import pytest

from phalanx.runs.config import override
from phalanx.runs.dp.launch import launch
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset

pytestmark = pytest.mark.hivemind



def test_three_processes_train_and_agree_on_mprng(tmp_path, monkeypatch):
    # The peers train a user's plug-in task (examples/csv_cnn: a CNN on a CSV of pixels), imported by each process.
    example = Path(__file__).resolve().parent.parent / "examples" / "csv_cnn"
    runpy.run_path(str(example / "make_pixels_csv.py"))["write_pixels_csv"](str(tmp_path / "pixels.csv"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(example), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(example))
    config = override(dataclasses.replace(get_preset("digits-dp"), peers=3, steps=6, mprng_every=3),
                      ["task.factory=pixel_task:make_task", f"task.params.path={tmp_path / 'pixels.csv'}"])
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
    assert json.loads((tmp_path / "launch" / "config.json").read_text())["task"]["factory"] == "pixel_task:make_task"
