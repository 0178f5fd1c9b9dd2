"""Checkpoints and --resume of simulated runs: byte-identical continuation, crash consistency, config errors."""

from __future__ import annotations

import json
import shutil

import pytest

from phalanx.cli import main
from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.dp.checkpoints import CheckpointStore, resume_config
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset

FILES = ("metrics.jsonl", "timeline.jsonl")


def _run(out, preset, *assignments):
    return simulate(override(get_preset(preset), list(assignments)), out, progress=False)


def _resume(out, preset, *args):
    assert main(["simulate", preset, "--resume", str(out), "--no-progress", *args]) == 0


def test_resume_after_a_torn_checkpoint_continues_bit_for_bit(tmp_path):
    small = ["peers=4", "checkpoint.every=4", "train.eval_every=4"]
    _run(tmp_path / "whole", "digits-dp", "steps=12", *small)
    cut = tmp_path / "cut"
    _run(cut, "digits-dp", "steps=8", *small)
    store = CheckpointStore(cut / "checkpoints")
    assert store.steps() == [4, 8] and store.latest().step == 8
    # A crash while sealing step 8 (no manifest) and one while writing a later step (a torn temp file, no manifest).
    (store.step_dir(8) / "MANIFEST.json").unlink()
    store.step_dir(12).mkdir()
    (store.step_dir(12) / ".peer-0.pt.tmp-999").write_bytes(b"PK\x03\x04 torn")
    assert store.latest().step == 4
    _resume(cut, "digits-dp", "--steps", "12")
    for name in FILES:
        assert (cut / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    resumed = json.loads((cut / "summary.json").read_text())
    for key in ("final_loss", "final_accuracy", "simulated_seconds", "network", "steps"):
        assert resumed[key] == whole[key], key
    assert store.latest().step == 12 and store.steps() == [8, 12]  # keep=2; the partial dir was replaced


def test_a_corrupt_checkpoint_file_falls_back_to_the_previous_one(tmp_path):
    _run(tmp_path, "digits-dp", "peers=2", "steps=4", "checkpoint.every=2", "checkpoint.keep=3")
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.latest().step == 4
    peer = store.step_dir(4) / "peer-1.pt"
    peer.write_bytes(peer.read_bytes()[:-10])
    assert store.latest().step == 2


def test_btard_run_with_bans_before_and_after_the_checkpoint_resumes_bit_for_bit(tmp_path):
    attack = [
        "peers=5", "byzantine.count=2", "byzantine.attack=sign_flip", "byzantine.start_step=0",
        "btard.timeout=1.0", "btard.validators=2", "checkpoint.every=1",
    ]
    _run(tmp_path / "whole", "btard-digits", "steps=3", *attack)
    _run(tmp_path / "cut", "btard-digits", "steps=1", *attack)
    first = [json.loads(line) for line in (tmp_path / "cut" / "bans.jsonl").read_text().splitlines()]
    _resume(tmp_path / "cut", "btard-digits", "--steps", "3")
    bans = [json.loads(line) for line in (tmp_path / "whole" / "bans.jsonl").read_text().splitlines()]
    assert len(first) == 1 and len(bans) == 2 and bans[0] == first[0]  # one ban restored with the ledger, one after
    for name in (*FILES, "bans.jsonl"):
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _run(out, "digits-dp", "peers=2", "steps=2", "checkpoint.every=1")
    return out


@pytest.mark.parametrize(
    "args, message",
    [
        (["peers=3"], "peers=3 differs from the run's peers=2"),
        (["seed=1"], "seed=1 differs"),
        (["train.lr=0.5"], "train.lr=0.5 differs"),
        (["steps=2"], "steps=2 must be > 2"),
    ],
)
def test_resume_rejects_a_change_of_the_runs_identity(checkpointed, args, message):
    with pytest.raises(ConfigError, match=message):
        resume_config(checkpointed, "digits-dp", args, "simulate")


def test_resume_errors_name_what_to_change(checkpointed, tmp_path, capsys):
    config, checkpoint = resume_config(checkpointed, "digits-dp", ["steps=5", "checkpoint.keep=4"], "simulate")
    assert (config.steps, config.checkpoint.keep, checkpoint.step) == (5, 4, 2)
    with pytest.raises(ConfigError, match="preset 'digits-dp', not 'btard-digits'"):
        resume_config(checkpointed, "btard-digits", [], "simulate")
    with pytest.raises(ConfigError, match="resume it with 'phalanx simulate'"):
        resume_config(checkpointed, "digits-dp", [], "launch")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resume_config(tmp_path, "digits-dp", [], "simulate")
    assert main(["simulate", "digits-dp", "--resume", str(checkpointed), "--out", str(tmp_path), "--steps", "3"]) == 2
    assert "a resumed run continues in its own directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="checkpoint.every=-1 must be >= 0"):
        override(get_preset("digits-dp"), ["checkpoint.every=-1"])
    with pytest.raises(ConfigError, match="without injected faults"):
        simulate(override(get_preset("digits-dp-crash"), ["checkpoint.every=5"]), tmp_path, progress=False)


def test_checkpoint_keeps_the_last_n(tmp_path):
    _run(tmp_path, "digits-dp", "peers=2", "steps=6", "checkpoint.every=1", "checkpoint.keep=2")
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.steps() == [5, 6]
    shutil.rmtree(store.step_dir(6))
    assert store.latest().step == 5
