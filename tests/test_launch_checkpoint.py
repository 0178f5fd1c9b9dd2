"""Two real workers over hivemind checkpoint every 2 steps; the run ends at step 4 and is resumed to step 8.

What is asserted, and why not more: over hivemind the groups of a step depend
on timing, so a resumed run is not compared with an uninterrupted one. Instead:
every worker's first step after the resume is computed on exactly the
checkpointed model (its recorded loss is recomputed here from the checkpoint
and the public batch), each worker's records cover every step once (the resume
appended after the checkpoint's step), the replicas agree at every checkpoint
(same state digest), the run finishes, and no process of it is left.
"""

import json
import uuid
from pathlib import Path

import pytest
import torch

from phalanx.cli import main
from phalanx.core.serialization import decode
from phalanx.experiments.checkpoints import CheckpointStore
from phalanx.experiments.processes import MARKER_ENV, kill_marked, marked_processes
from phalanx.runtime.checkpoint import from_bytes
from phalanx.runtime.dp_peer import task_of
from phalanx.config import RunConfig
from phalanx.training.task import compute_gradient

pytestmark = pytest.mark.hivemind

PEERS = 2


def _launch(out: Path, *args: str) -> None:
    base = ["launch", "digits-dp", "--peers", str(PEERS), "--no-progress"]
    assert main([*base, *args]) == 0


def _digests(store: CheckpointStore, step: int) -> set[str]:
    manifest = json.loads((store.step_dir(step) / "MANIFEST.json").read_text())
    assert sorted(manifest["peers"]) == [str(i) for i in range(PEERS)]
    return {entry["digest"] for entry in manifest["peers"].values()}


def test_launch_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    token = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv(MARKER_ENV, token)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    out = tmp_path / "run"
    try:
        _launch(out, "--steps", "4", "--checkpoint-every", "2", "--out", str(out), "--set", "train.eval_every=4")
        store = CheckpointStore(out / "checkpoints")
        assert store.latest().step == 4 and len(_digests(store, 4)) == 1
        saved = from_bytes((store.step_dir(4) / "peer-0.pt").read_bytes(), "peer-0.pt")

        _launch(out, "--steps", "8", "--resume", str(out))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 8 and summary["crashed"] == {}
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(8))
        assert store.steps() == [6, 8] and len(_digests(store, 6)) == 1 and len(_digests(store, 8)) == 1

        config = RunConfig.from_dict(json.loads((out / "config.json").read_text()))
        task = task_of(config.train)
        model = task.build_model(config.seed)
        model.load_state_dict(decode(saved["state"], "checkpoint")["model"])
        torch.set_num_threads(1)
        for index in range(PEERS):
            records = [json.loads(line) for line in (out / "peers" / f"{index}.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == list(range(8))
            first = records[4]
            _, loss = compute_gradient(task, model, *task.batch(config.seed, first["peer"], 4, config.train.batch_size))
            assert first["loss"] == pytest.approx(float(loss), rel=1e-6)
        assert marked_processes(token, prefix=True) == []
    finally:
        kill_marked(token, prefix=True)
