"""BTARD over hivemind: four real processes, one sends NaN parts and is banned by all honest peers."""

import json

import pytest

from phalanx.runs.config import override
from phalanx.runs.dp.launch import launch
from phalanx.runs.presets import get_preset

pytestmark = pytest.mark.hivemind


def test_nan_sender_is_banned_by_every_honest_process_and_the_run_finishes(tmp_path):
    config = override(
        get_preset("btard-digits"),
        ["peers=4", "steps=4", "byzantine.count=1", "byzantine.attack=constant", "byzantine.params.value=nan", "byzantine.start_step=0", "train.eval_every=2"],
    )
    summary = launch(config, tmp_path, progress=False)
    villain = summary["byzantine"][0]
    honest = [p for p in summary["peer_ids"] if p != villain]
    assert all(summary["banned_by_peer"][p] == [villain] for p in honest)
    bans = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert [(b["peer"], b["step"]) for b in bans] == [(villain, 0)]  # banned in the step it first lied
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["peers"] == 3
    assert summary["final_accuracy"] is not None
