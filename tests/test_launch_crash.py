"""One real launch over hivemind (BTARD digits with admission, 4 workers) that is checkpointed, loses a
worker, takes it back through admission, and is resumed.

Crash and rejoin: worker 3 is killed with SIGKILL mid-run. The run finishes,
summary.json lists it under `crashed` with the last step it recorded, the
launcher exits 0 and names only that worker. The killed worker, restarted at
once with the same identity (`phalanx peer --index 3 --run-token ...`), catches
up (downloads the agreed state, replays the agreed updates), trains the rest
of the run in the others' groups and ends with their state digest.

Admission (BTARD App. F) over hivemind: the restarted worker is a peer joining
the running launch. The killed trusted worker departs (not banned); back, it is
untrusted, then trusted after T=2 approvals, and from then on in every group;
every process holds the same admission sets at every step and nobody is banned.

Checkpoint and resume: the run checkpoints its last step; the launcher seals
that checkpoint with the three workers that wrote it (the killed one had
exited). The run is then resumed for a few more steps with all four workers
(worker 3 starts from a survivor's file). Over hivemind the groups of a step
depend on timing, so the resumed run is not compared with an uninterrupted
one. Instead: every worker's first step after the resume is computed on
exactly the checkpointed model (its recorded loss is recomputed here from the
checkpoint and the public batch), each worker's records cover every step it
trained once (the resume appended after the checkpoint's step), the replicas
agree at every checkpoint (same state digest) and the run finishes.

After each part no process of the run (workers, DHT children, p2pd, watchdogs) is left.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from phalanx.core.serialization import decode
from phalanx.runs.dp.checkpoints import CheckpointStore
from phalanx.runs.dp.config import RunConfig
from phalanx.runs.processes import MARKER_ENV, kill_marked, marked_processes
from phalanx.runtime.dp.checkpoint import from_bytes
from phalanx.runtime.dp.peer import task_of
from phalanx.training.task import compute_gradient

pytestmark = pytest.mark.hivemind

PEERS = 4
# Killed once it has recorded 15 steps, the worker is back within ~11 steps (departed at step 16, untrusted at
# 18-25, trusted at 23-31). The survivors wait for the dead peer two or three timeouts (its commitment of step 15,
# then its join while it is still a candidate: 16-25 s, issue-14 notes "Session 17"); the pace keeps the ~43
# steps after that at >= 21 s, so together they cover the restart's start-up (~25 s pinned to one busy core).
STEPS = 60
PACE = 0.5  # min_step_seconds
KILL_AFTER = 15
MORE = 4  # steps the resumed run adds, checkpointed every 2
T = 2  # approvals a joiner needs
# BTARD timeouts above the 5 s default, so that a descheduled process is not taken for a silent one; each costs
# the survivors ~2 waits after the kill.
SETS = ["seed=11", "byzantine.count=0", f"btard.admission_after={T}", f"train.eval_every={STEPS}", "btard.timeout=8",
        "allreduce.timeout=8", f"min_step_seconds={PACE}"]


def _worker_pid(marker: str) -> int | None:
    """The worker process itself: the marked process whose command line is the worker module."""
    for pid in marked_processes(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"phalanx.runs.dp.launch" in cmdline and b"--die-with-parent" in cmdline:
            return pid
    return None


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _digests(store: CheckpointStore, step: int, peers: list[int]) -> set[str]:
    manifest = json.loads((store.step_dir(step) / "MANIFEST.json").read_text())
    assert sorted(manifest["peers"]) == [str(i) for i in peers]
    return {entry["digest"] for entry in manifest["peers"].values()}


def _nothing_left(token: str) -> None:
    deadline = time.monotonic() + 10
    while marked_processes(token, prefix=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked_processes(token, prefix=True) == []


def test_killed_worker_rejoins_and_the_run_resumes_from_its_checkpoint(tmp_path):
    token = f"test-{uuid.uuid4().hex}"
    out, rejoin_out = tmp_path / "run", tmp_path / "rejoin"
    env = {**os.environ, MARKER_ENV: token, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = ["btard-digits", "--peers", str(PEERS), "--steps", str(STEPS), *[x for s in SETS for x in ("--set", s)]]
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", *run, "--checkpoint-every", str(STEPS), "--out", str(out),
           "--no-progress"]
    launcher = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    rejoined = resumed = None
    try:
        records = out / "peers" / "3.jsonl"
        deadline = time.monotonic() + 240
        while not (records.exists() and len(records.read_text().splitlines()) >= KILL_AFTER):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach the kill step"
            time.sleep(0.05)
        pid = _worker_pid(f"{token}/3")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        run_token = (out / "run_token").read_text().strip()
        first = (out / "peers" / "0.addr").read_text().split()[0]
        rejoin = [sys.executable, "-m", "phalanx.cli", "peer", *run, "--index", "3", "--run-token", run_token,
                  "--initial-peers", first, "--host", "/ip4/127.0.0.1/tcp/0", "--out", str(rejoin_out)]
        rejoined = subprocess.Popen(rejoin, env=env, stderr=subprocess.PIPE, text=True)
        _, stderr = launcher.communicate(timeout=400)
        _, rejoin_stderr = rejoined.communicate(timeout=60)
        assert launcher.returncode == 0, stderr
        assert rejoined.returncode == 0, rejoin_stderr
        summary = json.loads((out / "summary.json").read_text())
        victim = summary["peer_ids"][3]
        last = summary["crashed"][victim]
        assert list(summary["crashed"]) == [victim] and KILL_AFTER - 1 <= last < STEPS - 1
        assert "peer 3 was killed by SIGKILL" in stderr and "peer 0" not in stderr
        rows = _records(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert rows[-1]["peers"] == 3 and rows[-1]["group"] == 4, rejoin_stderr[-3000:]  # the restarted peer trains with them
        assert summary["final_accuracy"] > 0.8
        # The restarted process has the killed one's identity, trains a contiguous range up to the
        # last step, and ends with the state digest of the three that never stopped.
        tail = rejoin_stderr[-3000:]
        steps = [r["step"] for r in _records(rejoin_out / "peers" / "3.jsonl")]
        assert steps and steps == list(range(steps[0], STEPS)) and steps[0] > last, tail
        final = json.loads((rejoin_out / "summary.json").read_text())["final_digests"]
        assert list(final) == [victim], tail
        assert len(summary["final_digests"]) == 3 and set(summary["final_digests"].values()) == {final[victim]}, tail
        # Admission: the restarted worker came back as a joiner and is trusted after T approvals.
        events = _records(out / "admissions.jsonl")
        assert [e["event"] for e in events if e["peer"] == victim] == ["departed", "untrusted", *["approved"] * T, "trusted"]
        assert all(r["admission_agree"] for r in rows) and rows[-1]["trusted"] == PEERS and rows[-1]["untrusted"] == 0
        trusted_at = next(e["step"] for e in events if e["event"] == "trusted")
        assert all(r["group"] == PEERS for r in rows if r["step"] > trusted_at)
        assert summary["banned"] == []
        _nothing_left(token)

        # The last step's checkpoint holds the three launched workers that reached it, in agreement.
        store = CheckpointStore(out / "checkpoints")
        assert store.latest().step == STEPS and len(_digests(store, STEPS, [0, 1, 2])) == 1
        saved = from_bytes((store.step_dir(STEPS) / "peer-0.pt").read_bytes(), "peer-0.pt")
        resume = [sys.executable, "-m", "phalanx.cli", "launch", run[0], "--peers", str(PEERS), "--steps",
                  str(STEPS + MORE), "--checkpoint-every", "2", "--resume", str(out), "--no-progress"]
        resumed = subprocess.Popen(resume, env=env, stderr=subprocess.PIPE, text=True)
        _, stderr = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == STEPS + MORE and summary["crashed"] == {}
        rows = _records(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(STEPS + MORE)) and rows[-1]["peers"] == PEERS
        assert store.steps() == [STEPS + 2, STEPS + 4]
        assert all(len(_digests(store, step, list(range(PEERS)))) == 1 for step in store.steps())

        config = RunConfig.from_dict(json.loads((out / "config.json").read_text()))
        task = task_of(config.train)
        model = task.build_model(config.seed)
        model.load_state_dict(decode(saved["state"], "checkpoint")["model"])
        torch.set_num_threads(1)
        for index in range(PEERS):
            recorded = _records(out / "peers" / f"{index}.jsonl")
            before = list(range(last + 1)) if index == 3 else list(range(STEPS))  # the killed worker's own records
            assert [r["step"] for r in recorded] == before + list(range(STEPS, STEPS + MORE))
            first = recorded[len(before)]
            _, loss = compute_gradient(task, model, *task.batch(config.seed, first["peer"], STEPS, config.train.batch_size))
            assert first["loss"] == pytest.approx(float(loss), rel=1e-6)
        _nothing_left(token)
    finally:
        for proc in (launcher, rejoined, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
        kill_marked(token, prefix=True)
