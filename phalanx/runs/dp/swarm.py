"""What a run is made of, the same in the simulator and over hivemind.

Who is who (identities from the seed, which indices are Byzantine or crash),
how one peer runs its steps (training, then MPRNG every k steps), and how the
per-peer records become the run's files: config.json, metrics.jsonl (one
object per step), timeline.jsonl (one object per peer and step), summary.json.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from pathlib import Path

from ...algorithms.btard.attacks import PROTOCOL_ATTACKS, ProtocolPolicy, make_policy
from ...algorithms.catchup import manifest_digest, manifest_of
from ...algorithms.robust.attacks import ATTACKS, Attack, AttackSchedule, make_attack
from ...core.identity import Identity
from ...core.rng import py_stream
from ...runtime.dp.admission import AdmissionService
from ...runtime.dp.catchup import CatchupService
from ...runtime.dp.checkpoint import PeerCheckpoints
from ...runtime.dp.peer import DataParallelPeer, task_of
from ...runtime.dp.state import state_bytes
from ...runtime.rounds.btard import SecureRound
from ...runtime.rounds.mprng import (
    MPRNGBehaviour,
    MPRNGFailed,
    SplitView,
    WithholdReveal,
    WrongReveal,
    run_mprng,
)
from ...transport.base import Transport
from ...transport.sim import LinkProfile, SimConfig
from ..config import NetworkConfig
from .config import RunConfig

log = logging.getLogger(__name__)

MPRNG_BEHAVIOURS: dict[str, type[MPRNGBehaviour]] = {
    "honest": MPRNGBehaviour,
    "withhold": WithholdReveal,
    "wrong": WrongReveal,
    "split": SplitView,
}


def sim_config(network: NetworkConfig, seed: int) -> SimConfig:
    """The simulated network a run's `network` config describes."""
    return SimConfig(
        seed=seed,
        link=LinkProfile(latency=network.latency, bandwidth=network.bandwidth),
        loss=network.loss,
        detection_delay=network.detection_delay,
        default_flops=network.flops,
    )


def peer_identity(seed: int, index: int) -> Identity:
    """The identity of experiment peer `index`: public and reproducible, so runs compare."""
    return Identity.from_seed(f"phalanx-experiment/{seed}/{index}".encode())


def byzantine_indices(config: RunConfig) -> list[int]:
    """Which peers lie: drawn from the seed, never among the evaluating peers; then the first byzantine.joiners joiners."""
    pool = list(range(min(config.eval_peers, config.peers), config.peers))
    drawn = sorted(py_stream(config.seed, "byzantine").sample(pool, min(config.byzantine.count, len(pool))))
    return drawn + [config.peers + j for j in range(config.byzantine.joiners)]


def crash_indices(config: RunConfig) -> list[int]:
    """Which honest peers crash: drawn from the seed among the non-evaluating honest peers."""
    byzantine = set(byzantine_indices(config))
    pool = [i for i in range(min(config.eval_peers, config.peers), config.peers) if i not in byzantine]
    return sorted(py_stream(config.seed, "crash").sample(pool, min(config.faults.crash, len(pool))))


def byzantine_policies(config: RunConfig) -> tuple[Attack | None, ProtocolPolicy | None]:
    """(gradient attack, protocol policy) a Byzantine peer of `config` runs; None where it has none."""
    attack = policy = None
    schedule = AttackSchedule(start_step=config.byzantine.start_step, every=config.byzantine.every)
    if config.byzantine.attack in ATTACKS:
        attack = make_attack(config.byzantine.attack, schedule, **config.byzantine.params)
    if config.byzantine.attack in PROTOCOL_ATTACKS:
        colluders = frozenset(peer_identity(config.seed, i).peer_id for i in byzantine_indices(config))
        policy = make_policy(config.byzantine.attack, schedule, config.seed, colluders, **config.byzantine.params)
    return attack, policy


def build_peer(config: RunConfig, transport: Transport, index: int) -> DataParallelPeer:
    attack, policy = byzantine_policies(config) if index in byzantine_indices(config) else (None, None)
    return DataParallelPeer(
        transport,
        task_of(config.train, config.task),
        config.train,
        config.seed,
        allreduce=config.allreduce,
        attack=attack,
        colluders=config.byzantine.count,
        evaluate=index < config.eval_peers,
        btard=config.btard,
        policy=policy,
        server=peer_identity(config.seed, 0).peer_id,  # the trusted server of allreduce.topology=server: peer 0, never Byzantine
    )


async def run_peer(
    config: RunConfig,
    peer: DataParallelPeer,
    index: int,
    deterministic: bool,
    on_step: Callable[[dict], None],
    catchup: CatchupService | None = None,
    checkpoints: PeerCheckpoints | None = None,
    admission: AdmissionService | None = None,
) -> None:
    """Train from peer.step to config.steps; after every mprng_every-th step, run an MPRNG round; report each step.

    With `catchup`, the peer serves state to joiners and checks its digest at sync points;
    its last record carries its final state digest. With `checkpoints`, the peer is
    restored from a checkpoint first (on a resume) and offers it each step to write.
    With `admission` (BTARD App. F), each record carries the admission status the
    step used and what changed.
    """
    byzantine = index in byzantine_indices(config)
    behaviour = MPRNG_BEHAVIOURS[config.byzantine.mprng if byzantine else "honest"]()
    streams = {}
    if deterministic:
        stream = streams["mprng"] = py_stream(config.seed, peer.transport.peer_id, "mprng")
        entropy = stream.randbytes
    else:
        entropy = secrets.token_bytes
    me = peer.transport.peer_id
    if isinstance(peer.allreduce, SecureRound):
        peer.allreduce.entropy = entropy
    if checkpoints is not None:
        checkpoints.attach(peer, streams)
    if admission is not None:
        await admission.start(peer.step)
    clock = peer.transport.clock
    for step in range(peer.step, config.steps):
        started = clock.now()
        if checkpoints is not None and config.checkpoint.due(step):
            await peer.settle()  # BTARD: no verification is in flight at a checkpoint
        if checkpoints is not None:
            await checkpoints.at_step(step)
        if catchup is not None:
            await catchup.before_step(step)  # a re-sync loads the agreed state, bans included
        if peer.ledger.is_banned(me):  # checked last: a peer that learns its ban here must not train the step
            await peer.settle()
            return  # the honest peers have banned us: they no longer listen
        record = await peer.train_step(step)
        if step == config.steps - 1:
            await peer.finish(record)
        if admission is not None:
            record.update(admission.record(step))
        if config.mprng_every and (step + 1) % config.mprng_every == 0:
            try:
                result = await run_mprng(peer.transport, peer.ledger, step, config.mprng, entropy, behaviour)
                record["mprng"] = result.value.hex()[:16]
                record["mprng_attempts"] = result.attempts
            except MPRNGFailed as exc:
                log.warning("%s", exc)
                record["mprng"] = None
            record["banned"] = list(peer.ledger.banned)
        peer.step = step + 1
        if peer.step == config.steps:  # model, optimizer and ban ledger: equal on replicas that agree
            record["digest"] = manifest_digest(manifest_of(state_bytes(peer, peer.step), config.catchup.chunk_bytes)).hex()
        on_step(record)
        if (rest := started + config.min_step_seconds - clock.now()) > 0:
            await clock.sleep(rest)
    if checkpoints is not None and not peer.ledger.is_banned(me):
        await checkpoints.at_step(config.steps)


class Recorder:
    """Collects every peer's step records and writes the run's files."""

    def __init__(self, config: RunConfig, ids: list[str]) -> None:
        self.config = config
        self.ids = ids
        self.index_of = {p: i for i, p in enumerate(ids)}
        self.records: list[dict] = []
        self.byzantine = set(byzantine_indices(config))
        self.crashed = [ids[i] for i in crash_indices(config) if i < len(ids)]  # launch sets the observed ones

    def last_step(self, peer: str) -> int | None:
        """The last step `peer` recorded (None if it recorded none): where a crashed peer was last seen."""
        return max((r["step"] for r in self.records if r["peer"] == peer), default=None)

    def add(self, record: dict) -> None:
        self.records.append(record)

    def metrics(self) -> list[dict]:
        by_step: dict[int, list[dict]] = {}
        for record in self.records:
            by_step.setdefault(record["step"], []).append(record)
        rows = []
        for step in sorted(by_step):
            recs = sorted(by_step[step], key=lambda r: self.index_of.get(r["peer"], 0))
            row = {
                "step": step,
                "loss": sum(r["loss"] for r in recs) / len(recs),
                "peers": len(recs),
                "group": max(r["group"] for r in recs),
                "dropped": sum(r["dropped"] for r in recs),
                "missing_parts": sum(r["missing_parts"] for r in recs),
                "time": max(r["t_end"] for r in recs),
            }
            for key in ("test_loss", "test_accuracy"):
                values = [r[key] for r in recs if key in r]
                if values:
                    row[key] = sum(values) / len(values)
            mprng = [r["mprng"] for r in recs if "mprng" in r and self.index_of.get(r["peer"]) not in self.byzantine]
            if mprng:
                row["mprng"] = mprng[0]
                row["mprng_agree"] = len(set(mprng)) == 1
            admission = [json.dumps(r["admission"], sort_keys=True) for r in recs if "admission" in r and self.index_of.get(r["peer"]) not in self.byzantine]
            if admission:
                status = json.loads(admission[0])
                row["trusted"], row["untrusted"], row["queued"] = len(status["trusted"]), len(status["untrusted"]), len(status["queued"])
                row["admission_agree"] = len(set(admission)) == 1
            rows.append(row)
        return rows

    def timeline(self) -> list[dict]:
        rows = []
        for r in sorted(self.records, key=lambda r: (r["step"], self.index_of.get(r["peer"], 0))):
            rows.append(
                {
                    "peer": self.index_of.get(r["peer"], -1),
                    "step": r["step"],
                    "t_start": r["t_start"],
                    "t_computed": r["t_computed"],
                    "t_end": r["t_end"],
                    "byzantine": self.index_of.get(r["peer"]) in self.byzantine,
                }
            )
        return rows

    def _witness(self, key: str) -> str | None:
        """The honest peer that recorded `key` the longest (lowest index on ties): banned peers stop early."""
        best, best_step = None, -1
        for index, peer in enumerate(self.ids):
            steps = [r["step"] for r in self.records if r["peer"] == peer and key in r]
            if index not in self.byzantine and steps and max(steps) > best_step:
                best, best_step = peer, max(steps)
        return best

    def banned(self) -> list[str]:
        """Bans as seen by the last record of the honest peer that ran longest (lowest index on ties)."""
        witness = self._witness("banned")
        recs = [r for r in self.records if r["peer"] == witness and "banned" in r]
        return max(recs, key=lambda r: r["step"])["banned"] if recs else []

    def banned_by_peer(self) -> dict[str, list[str]]:
        """Each peer's ban list at its last recorded step (BTARD runs; honest ones must agree)."""
        last: dict[str, dict] = {}
        for r in self.records:
            if "banned" in r and r["step"] >= last.get(r["peer"], {}).get("step", -1):
                last[r["peer"]] = r
        return {peer: r["banned"] for peer, r in sorted(last.items())}

    def ban_records(self) -> list[dict]:
        """Every ban (step, peer, reason, accuser) in the order the longest-running honest BTARD peer applied them."""
        witness = self._witness("bans")
        recs = sorted((r for r in self.records if r["peer"] == witness and "bans" in r), key=lambda r: r["step"])
        return [ban for r in recs for ban in r["bans"]]

    def admission_events(self) -> list[dict]:
        """Admission changes (step, peer, event) as the longest-running honest peer applied them (BTARD App. F)."""
        witness = self._witness("admission")
        recs = sorted((r for r in self.records if r["peer"] == witness and "admission_events" in r), key=lambda r: r["step"])
        return [{"step": r["step"], "peer": peer, "event": event} for r in recs for peer, event in r["admission_events"]]

    def write(self, out: Path, extra: dict) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        metrics = self.metrics()
        if any("bans" in r for r in self.records):
            with open(out / "bans.jsonl", "w") as f:
                for ban in self.ban_records():
                    f.write(json.dumps(ban, sort_keys=True) + "\n")
        if any("admission" in r for r in self.records):
            with open(out / "admissions.jsonl", "w") as f:
                for event in self.admission_events():
                    f.write(json.dumps(event, sort_keys=True) + "\n")
        (out / "config.json").write_text(self.config.to_json() + "\n")
        with open(out / "metrics.jsonl", "w") as f:
            for row in metrics:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        with open(out / "timeline.jsonl", "w") as f:
            for row in self.timeline():
                f.write(json.dumps(row, sort_keys=True) + "\n")
        evaluated = [m for m in metrics if "test_accuracy" in m]
        summary = {
            "preset": self.config.preset,
            "peers": self.config.peers,
            "steps": self.config.steps,
            "seed": self.config.seed,
            "task": self.config.train.task,
            "final_loss": metrics[-1]["loss"] if metrics else None,
            "final_test_loss": evaluated[-1]["test_loss"] if evaluated else None,
            "final_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
            "banned": self.banned(),
            "banned_by_peer": self.banned_by_peer(),
            "byzantine": [self.ids[i] for i in sorted(self.byzantine)],
            "crashed": {peer: self.last_step(peer) for peer in self.crashed},
            "final_digests": {r["peer"]: r["digest"] for r in self.records if "digest" in r},
            "peer_ids": self.ids,
            **extra,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary
