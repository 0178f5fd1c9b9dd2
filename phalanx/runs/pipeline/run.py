"""Pipeline runs: build data nodes and relays from a `PipelineRunConfig`, run them, write the run's files.

Files: config.json, metrics.jsonl (one object per iteration), microbatches.jsonl
(path, times, recomputations, outcome of every microbatch attempt that settled),
events.jsonl (every forward, backward, loss and aggregation with its node,
stage and times: the stage x time diagram), summary.json. With SENTINEL on:
bans.jsonl (peer, step, reason "sentinel", the verifier and link) and
verdicts.jsonl (every judged tensor); with malicious relays: attacks.jsonl (the
attack log, ground truth for scoring; never read by a verifier).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ...algorithms.gwtf.flow import FlowConfig
from ...algorithms.sentinel.statistics import BACKWARD, FORWARD
from ...core.errors import ConfigError
from ...core.rng import py_stream
from ...runtime.dp.peer import task_of
from ...runtime.pipeline import DataNode, Relay, StagedModel, SwarmRouter
from ...runtime.pipeline.attacker import AttackingRelay
from ...runtime.pipeline.gwtf import FlowDriver, FlowRouter
from ...runtime.pipeline.relay import JoinRefused, ask_for_stage
from ...runtime.pipeline.routing import RepairRouter, Router
from ...runtime.pipeline.stage_btard import StageRound
from ...runtime.pipeline.verifier import VerifierNode
from ...training.task import Task, make_task
from ...transport.base import Transport
from ...transport.sim import LinkProfile, SimConfig, SimNetwork, run_simulation
from ..dp.swarm import peer_identity
from ..live import LiveLog
from .config import PipelineRunConfig
from .launch_churn import iteration_churn, leave_allowed, leave_offset, stage_floor


def pipeline_task(config: PipelineRunConfig) -> Task:
    """The plug-in task (task.factory), or the built-in one deep enough for the stages: an MLP with one 64-wide hidden layer per stage, or a GPT
    with max(2, stages - 1) blocks (data nodes hold the first piece, relays one piece each)."""
    if config.task.enabled:
        return task_of(config.train, config.task)
    stages = config.pipeline.stages
    corpus = {"corpus": config.train.corpus} if config.train.corpus else {}
    if config.train.task == "digits-mlp":
        return make_task("digits-mlp", hidden=(64,) * stages)
    if config.train.task == "chars-gpt":
        return make_task("chars-gpt", n_layer=max(2, stages - 1), **corpus)
    raise ConfigError(f"train.task={config.train.task!r} has no pipeline split; use chars-gpt or digits-mlp")


def capacities(config: PipelineRunConfig) -> list[int]:
    """Capacity of every peer index (data nodes: their microbatch count)."""
    rng = py_stream(config.seed, "pipeline", "capacity")
    caps = [config.pipeline.microbatches] * config.data_nodes
    for _ in range(config.relays):
        caps.append(rng.randint(config.capacity_min, config.capacity_max) if config.capacity_max else config.pipeline.capacity)
    return caps


def speeds(config: PipelineRunConfig) -> list[float]:
    rng = py_stream(config.seed, "pipeline", "speeds")
    return [config.network.flops * math.exp(config.network.flops_spread * rng.gauss(0.0, 1.0)) for _ in range(config.peers)]


def make_router(config: PipelineRunConfig, peer: str) -> Router:
    penalty = 4 * config.pipeline.complete_timeout
    if config.pipeline.routing == "gwtf":
        return RepairRouter(config.pipeline.ema, penalty)
    return SwarmRouter(py_stream(config.seed, peer, "route"), config.pipeline.ema, penalty,
                       paper=config.pipeline.routing == "swarm-paper")


def make_routing(
    config: PipelineRunConfig, transport: Transport, stage: int, capacity: int, joiner: bool = False,
) -> tuple[Router, FlowDriver | None]:
    """The router of a node and, under gwtf routing, the flow driver it routes by. A joiner's handovers
    start ended unless they run in iterations too (`flow_handover=always`): its peers' ended at their first
    iteration, and queries they would not answer would lock its units."""
    router = make_router(config, transport.peer_id)
    if config.pipeline.routing != "gwtf":
        return router, None
    flow = FlowDriver(transport, stage, config.pipeline.stages, capacity, config.pipeline.microbatches,
                      FlowConfig(handover=config.pipeline.flow_handover != "off"),
                      py_stream(config.seed, transport.peer_id, "gwtf-flow"), config.pipeline.flow_period,
                      handover_in_iterations=config.pipeline.flow_handover == "always",
                      handovers_ended=joiner and config.pipeline.flow_handover != "always")
    return FlowRouter(flow.node, router, units_are_slots=config.pipeline.capacity_mode == "iteration"), flow


def verifier_ids(config: PipelineRunConfig) -> dict[int, str]:
    """Boundary verifiers (SENTINEL, placement=boundary): link -> peer id; empty otherwise."""
    if not (config.sentinel.enabled and config.sentinel.placement == "boundary"):
        return {}
    return {link: verifier_identity(config.seed, link).peer_id for link in range(config.pipeline.stages + 1)}


def verifier_identity(seed: int, link: int):
    return peer_identity(seed, 100_000 + link)


def build_node(
    config: PipelineRunConfig, transport: Transport, index: int, directory: dict[str, int], task: Task,
    on_event: Callable[[dict], None], stage: int | None = None, probe=None, joiner: bool = False,
) -> DataNode | Relay:
    """A data node or relay; with SENTINEL it knows the boundary verifiers (or verifies, client-routed);
    a relay listed in `attack.relays` is an `AttackingRelay` that logs to `on_event` (kind "attack")."""
    stage = config.stage_of(index) if stage is None else stage
    staged = StagedModel(task, config.seed, config.pipeline.stages, config.train.batch_size, config.train.device)
    capacity = capacities(config)[index] if index < config.peers else config.pipeline.capacity  # a fresh joiner
    router, flow = make_routing(config, transport, stage, capacity, joiner)
    client = config.sentinel.enabled and config.sentinel.placement == "data_node"
    extra: dict = {"verifiers": verifier_ids(config), "client_routed": client, "off_path": config.sentinel.off_path}
    if index < config.data_nodes:
        cls = DataNode
        extra["sentinel"] = config.sentinel if client else None
        extra["verdict_timeout"] = config.sentinel.verdict_timeout
    elif index - config.data_nodes in config.attack.indices and config.attack.name != "none":
        cls = AttackingRelay
        extra.update(attack=config.attack.policy(config.seed, transport.peer_id), log=on_event, probe=probe,
                     lead=config.attack.lead)
    else:
        cls = Relay
    if config.btard.enabled:
        extra["btard"] = config.btard
        if index >= config.data_nodes and index - config.data_nodes in config.byzantine.indices:
            colluders = frozenset(peer_identity(config.seed, config.data_nodes + i).peer_id for i in config.byzantine.indices)
            extra["policy"] = config.byzantine.policy(config.seed, colluders)
    return cls(
        transport, task, staged, stage, config.train, config.pipeline, directory, config.seed,
        router, capacity=capacity, allreduce=config.allreduce, reducer=config.allreduce.build_reducer(),
        on_event=on_event, flow=flow, **extra,
    )


def seed_mprng(node: DataNode | Relay, seed: int, incarnation: int) -> None:
    """Simulator only: a stage round's MPRNG entropy from the run seed, so that a run is reproducible
    (as data-parallel simulations do); each incarnation of a relay draws from its own stream."""
    if isinstance(node.allreduce, StageRound):
        node.allreduce.round.entropy = py_stream(seed, node.me, "mprng", incarnation).randbytes


class PipelineRecorder:
    """Iteration records of the data nodes and events of every node; writes the run's files."""

    def __init__(self, config: PipelineRunConfig, ids: list[str]) -> None:
        self.config = config
        self.ids = ids
        self.iterations: list[dict] = []
        self.events: list[dict] = []
        self.bans: list[dict] = []
        self.verdicts: list[dict] = []
        self.attacks: list[dict] = []

    def on_event(self, event: dict) -> None:
        """Sort a node's event: SENTINEL bans and verdicts, the attack log, or a pipeline event."""
        kind = event["kind"]
        {"ban": self.bans, "verdict": self.verdicts, "attack": self.attacks}.get(kind, self.events).append(event)

    def metrics(self) -> list[dict]:
        rows = []
        for it in sorted({r["it"] for r in self.iterations}):
            recs = [r for r in self.iterations if r["it"] == it]
            losses = [(r["loss"], r["completed"]) for r in recs if r["loss"] is not None]
            done = sum(c for _, c in losses)
            t0, t1 = min(r["t_start"] for r in recs), max(r["t_end"] for r in recs)
            rows.append({
                "step": it,
                "loss": sum(loss * c for loss, c in losses) / done if done else None,
                "completed": sum(r["completed"] for r in recs),
                "deferred": sum(r["deferred"] for r in recs),
                "t_start": t0, "time": t1, "duration": t1 - t0,
                "train_seconds": max(r["t_train"] for r in recs) - t0,
            })
        return rows

    def routing_branches(self) -> dict[str, int]:
        """How many hops each routing rule chose (paired / flow / fallback under gwtf, swarm, client)."""
        counts: dict[str, int] = {}
        for e in self.events:
            if e["kind"] == "send" and e.get("branch"):
                counts[e["branch"]] = counts.get(e["branch"], 0) + 1
        return dict(sorted(counts.items()))

    def departures(self) -> dict[str, list[str]]:
        """Stage rounds' departures: `departed` (left while their round was open, not banned), `retired`
        (departed leaving a check unjudged: out for good, not counted as banned) and `refused` (a banned or
        retired identity that asked to join again)."""
        return {name: sorted({e["peer"] for e in self.events if e["kind"] == kind})
                for name, kind in (("departed", "depart"), ("retired", "retire"), ("refused", "refuse"))}

    def microbatches(self) -> list[dict]:
        return [mb for r in self.iterations for mb in r["microbatches"]]

    def wasted_compute(self) -> float:
        """Compute seconds spent on (microbatch attempt, node) pairs that are not on a finished path."""
        useful = {(mb["src"], mb["seq"], mb["att"], peer) for mb in self.microbatches() if mb["outcome"] == "ok" for peer in mb["path"]}
        return sum(e["t1"] - e["t0"] for e in self.events if e["kind"] in ("fwd", "bwd")
                   and (e["src"], e["seq"], e["att"], e["peer"]) not in useful)

    def write(self, out: Path, extra: dict) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        metrics = self.metrics()
        (out / "config.json").write_text(self.config.to_json() + "\n")
        files = [("metrics", metrics), ("microbatches", self.microbatches()), ("events", self.events)]
        if self.config.sentinel.enabled or self.config.btard.enabled:
            files += [("bans", self.bans), ("verdicts", self.verdicts)]
        if self.attacks:
            files.append(("attacks", self.attacks))
        for name, rows in files:
            with open(out / f"{name}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row, sort_keys=True) + "\n")
        losses = [m["loss"] for m in metrics if m["loss"] is not None]
        mbs = self.microbatches()
        ok = [mb for mb in mbs if mb["outcome"] == "ok"]
        summary = {
            "preset": self.config.preset, "kind": "pipeline", "peers": self.config.peers, "steps": self.config.steps,
            "seed": self.config.seed, "task": self.config.train.task, "routing": self.config.pipeline.routing,
            "final_loss": losses[-1] if losses else None,
            "microbatches_ok": len(ok), "microbatches_deferred": len(mbs) - len(ok),
            "throughput_per_iteration": len(ok) / max(1, len(metrics)),
            "recomputed_stages": sum(len(mb["recomputed"]) for mb in ok),
            "restarts": sum(mb["restarts"] for mb in mbs), "repairs": sum(mb["repairs"] for mb in mbs),
            "wasted_compute_seconds": self.wasted_compute(), "peer_ids": self.ids,
            "banned": sorted({b["peer"] for b in self.bans}),
            **self.departures(),
            "routing_branches": self.routing_branches(),
            **extra,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary


def simulate_pipeline(
    config: PipelineRunConfig, out: Path | None = None, progress: bool = True,
    adversary: Callable[[SimNetwork, dict[str, int]], None] | None = None, evaluate: bool = False,
) -> dict:
    """Run a pipeline config in the simulator; write its files to `out` (if given); return the summary.

    `adversary(network, directory)` may add peers of its own (attack policies) before the run starts.
    `evaluate`: also report `val_loss`, the held-out loss of the model assembled from one up-to-date
    replica per stage that is not among `attack.relays` (the experiment's view, not a defence's).
    """
    torch.set_num_threads(1)
    wall_start = time.perf_counter()
    identities = [peer_identity(config.seed, i) for i in range(config.peers)]
    ids = [identity.peer_id for identity in identities]
    directory = {pid: config.stage_of(i) for i, pid in enumerate(ids)}
    task = pipeline_task(config)
    recorder = PipelineRecorder(config, ids)
    live = LiveLog(out, config.to_json())
    index_of = {peer: i for i, peer in enumerate(ids)}
    bar = tqdm(total=config.steps, desc=f"simulate {config.preset}", disable=not progress, leave=False)
    relay_ids = ids[config.data_nodes:]

    async def main() -> tuple[float, dict]:
        net = config.network
        network = SimNetwork(SimConfig(
            seed=config.seed, link=LinkProfile(latency=net.latency, bandwidth=net.bandwidth_max), loss=net.loss,
            detection_delay=net.detection_delay, default_flops=net.flops,
        ))
        transports = [network.add_peer(identity, flops=speed) for identity, speed in zip(identities, speeds(config))]
        if net.bandwidth_min < net.bandwidth_max:
            rng = py_stream(config.seed, "pipeline", "links")
            for a in ids:
                for b in ids:
                    if a != b:
                        network.set_link(a, b, LinkProfile(net.latency, rng.uniform(net.bandwidth_min, net.bandwidth_max)))
        done = [asyncio.Event() for _ in range(config.data_nodes)]
        staying = {relay_ids[r] for r in config.faults.staying}
        crashed: set[str] = set()
        leaving: dict[str, tuple[float, int]] = {}  # relay -> (when, iteration drawn) of a leave not yet fallen
        triggered: list[str] = []
        nodes: dict[str, DataNode | Relay] = {}

        def on_iteration(record: dict) -> None:
            recorder.iterations.append(record)
            live.write(index_of[record["peer"]], {"type": "iteration", **record})
            if record["peer"] == ids[0]:
                bar.update(1)

        def on_start(it: int, duration: float) -> None:
            """The first data node opens iteration `it`: inject this iteration's faults."""
            f = config.faults
            if f.crash_relay >= 0 and it == f.crash_iteration:
                victim = relay_ids[f.crash_relay]
                network.schedule(asyncio.get_running_loop().time() + f.crash_at, lambda: _crash(victim))
            if f.crash_data_node >= 0 and it == f.crash_iteration:
                victim_node = ids[f.crash_data_node]
                network.schedule(asyncio.get_running_loop().time() + f.crash_at, lambda: _crash(victim_node))
            # a leave falls within the iteration it was drawn in: one not yet due falls as the next one opens
            for pid, (_, drawn) in sorted(leaving.items(), key=lambda item: item[1]):
                _leave(pid, drawn)
            now = asyncio.get_running_loop().time()
            for pid, fraction in iteration_churn(config.seed, it, relay_ids, crashed, f, staying):  # `launch`'s too
                if fraction is None:
                    crashed.discard(pid)
                    # its old node (stage, version) is gone: until it is placed again it keeps no stage alive
                    # for _leave (gwtf seed 4 at 20%: it let stage 2's last relay leave, and no joiner could
                    # be placed there again, so iterations 213-299 finished nothing)
                    nodes.pop(pid, None)
                    network.restart(pid)
                    churned(pid, it, "returned")
                else:
                    at = now + leave_offset(f, fraction, duration)
                    leaving[pid] = (at, it)
                    network.schedule(at, lambda pid=pid, it=it: _leave(pid, it))

        def churned(pid: str, it: int, decision: str, why: str = "") -> None:
            """Record a churn decision: relay `pid`'s draw of iteration `it` brought it back, took it, or was kept
            from taking it (`why`: `stage`, the stage rule; `down`, gone already by another fault)."""
            now = asyncio.get_running_loop().time()
            recorder.events.append({"kind": "churn", "peer": pid, "it": it, "decision": decision, "why": why,
                                    "t0": now, "t1": now})

        def on_event(event: dict) -> None:
            recorder.on_event(event)
            live.write(index_of.get(event["peer"], len(ids)), {"type": "event", **event})
            f = config.faults
            if (f.crash_stage and event["kind"] == f.crash_after and event["stage"] == f.crash_stage
                    and event["it"] == f.crash_iteration and not crashed and not triggered):
                triggered.append(event["peer"])
                network.schedule(event["t1"] + f.crash_at, lambda: _crash(event["peer"]))

        def _leave(pid: str, drawn: int) -> None:
            """Churn takes a relay (its draw of iteration `drawn`), unless it would leave its stage fewer unbanned
            live replicas than `stage_floor` (one; two under BTARD per stage): the stage's weights would be gone, and
            GWTF does not say how a wiped-out stage recovers; a banned replica serves nobody, as the first data node
            sees it. A relay still joining (not placed, or refused) serves no stage and may always go, as in `launch`."""
            if leaving.get(pid, (0.0, None))[1] != drawn:
                return  # fell already, as its iteration ended
            del leaving[pid]
            if pid in crashed:
                churned(pid, drawn, "kept", "down")
                return
            node = nodes.get(pid)
            out = nodes[ids[starter]].banned if ids[starter] in nodes else set()
            serving = {p: n.stage for p, n in nodes.items() if p not in crashed and n.version >= node.version} if node else {}
            if leave_allowed(pid, serving, out, stage_floor(config)):  # the rule `launch` applies too
                _crash(pid)
                churned(pid, drawn, "left")
            else:
                churned(pid, drawn, "kept", "stage")

        def _crash(pid: str) -> None:
            if pid not in crashed:
                crashed.add(pid)
                network.crash(pid)
                now = asyncio.get_running_loop().time()
                node = nodes.get(pid)
                recorder.events.append({"kind": "leave", "peer": pid, "stage": node.stage if node else -1,
                                        "it": node.version if node else -1, "t0": now, "t1": now})

        incarnations = [0] * config.peers
        starter = config.data_nodes - 1 if config.faults.crash_data_node == 0 else 0  # a data node that lives

        def factory(index: int):
            async def node_main() -> None:
                incarnations[index] += 1
                if incarnations[index] > 1:  # a relay coming back: a joiner (GWTF V-B)
                    await join(index)
                    return
                node = build_node(config, transports[index], index, directory, task, on_event, probe=probe)
                seed_mprng(node, config.seed, 1)
                nodes[ids[index]] = node
                if isinstance(node, DataNode):
                    await node.run(config.steps, on_iteration, on_start if index == starter else None)
                    done[index].set()
                else:
                    await node.serve()

            return node_main

        async def join(index: int) -> None:
            transport = transports[index]
            try:
                placed = await ask_for_stage(transport, directory, capacities(config)[index], 2 * config.pipeline.complete_timeout)
            except JoinRefused:
                return  # a banned identity: stays out
            if placed is None:
                return  # no leader answered or no stage can take it: stays idle
            node = build_node(config, transport, index, placed.directory, task, on_event, stage=placed.stage, joiner=True)
            node.banned.update(placed.banned)
            seed_mprng(node, config.seed, incarnations[index])
            nodes[ids[index]] = node
            recorder.events.append({"kind": "join", "peer": ids[index], "stage": placed.stage, "it": placed.it,
                                    "t0": asyncio.get_running_loop().time(), "t1": asyncio.get_running_loop().time()})
            if await node.enter(placed.it):
                await node.serve()

        verifiers = verifier_ids(config)
        hops = {}
        for link, vid in verifiers.items():
            vt = network.add_peer(verifier_identity(config.seed, link), flops=config.sentinel.verifier_flops)
            node = VerifierNode(vt, config.sentinel, config.pipeline, config.seed, directory, on_event, verifiers)
            hops[link] = node.hop
            network.spawn(vid, node.serve)

        def probe(kind: str, link: int, tensor: torch.Tensor, key=None) -> bool:
            """The white-box view lent to an adaptive attacker: would the verifier of `link` accept it?
            (Client-routed: the first data node's verifier.)"""
            hop = hops.get(link) or getattr(nodes.get(ids[0]), "verifier", None)
            direction = FORWARD if kind == "activation" else BACKWARD
            return True if hop is None else hop.sentinel.would_accept(link, direction, tensor, key)

        for index, pid in enumerate(ids):
            network.spawn(pid, factory(index))
        if adversary is not None:
            adversary(network, directory)
        for index, event in enumerate(done):
            if index != config.faults.crash_data_node:
                await event.wait()
        digests = {pid: [node.stage, node.version, param_digest(node)] for pid, node in nodes.items()
                   if pid not in crashed and node.version == config.steps}
        evidence = [[t.peer_id, e.peer, e.kind] for t in transports for e in t.evidence]
        val = validation_loss(config, task, nodes, crashed) if evaluate else None
        sample = text_sample(config, task, nodes, crashed)
        return asyncio.get_running_loop().time(), {**network.stats(), "digests": digests, "evidence": evidence,
                                                   "val_loss": val, "sample": sample}

    try:
        simulated_seconds, stats = run_simulation(main)
    finally:
        bar.close()
        live.close()
    verifiers_of_run = verifier_ids(config)
    extra = {"mode": "simulate", "wall_seconds": time.perf_counter() - wall_start, "simulated_seconds": simulated_seconds,
             "messages": stats["messages_sent"], "bytes": stats["bytes_sent"], "replicas": stats["digests"],
             "evidence": stats["evidence"], "val_loss": stats["val_loss"], "sample": stats["sample"]}
    if out is None:
        summary = dict(extra)
        summary["metrics"] = recorder.metrics()
        summary["microbatches"] = recorder.microbatches()
        summary["events"] = recorder.events
        summary["bans"] = recorder.bans
        summary["verdicts"] = recorder.verdicts
        summary["attacks"] = recorder.attacks
        summary["banned"] = sorted({b["peer"] for b in recorder.bans})
        summary.update(recorder.departures())
        summary["wasted_compute_seconds"] = recorder.wasted_compute()
        summary["peer_ids"] = ids
        summary["verifier_ids"] = verifiers_of_run
        summary["routing_branches"] = recorder.routing_branches()
        return summary
    summary = recorder.write(out, extra)
    return summary


def assembled_model(config: PipelineRunConfig, task: Task, nodes: dict, crashed: set[str]) -> torch.nn.Module | None:
    """The model made of one honest, up-to-date replica per stage (None if a stage has none)."""
    lying = {peer_identity(config.seed, config.data_nodes + i).peer_id for i in config.attack.indices}
    model = task.build_model(config.seed)
    parts = task.stages(model, config.pipeline.stages + 1)
    for stage, part in enumerate(parts):
        source = next((n for p, n in sorted(nodes.items()) if n.stage == stage and p not in crashed
                       and p not in lying and n.version == config.steps), None)
        if source is None:
            return None
        with torch.no_grad():
            for mine, theirs in zip(part.parameters(), source.params):
                mine.copy_(theirs)
    return model


def validation_loss(config: PipelineRunConfig, task: Task, nodes: dict, crashed: set[str]) -> float | None:
    """Held-out loss of the assembled model (see `assembled_model`)."""
    model = assembled_model(config, task, nodes, crashed)
    return None if model is None else task.evaluate(model)["loss"]


def text_sample(config: PipelineRunConfig, task: Task, nodes: dict, crashed: set[str], length: int = 120) -> str | None:
    """A character GPT's continuation of the start of the validation text (sampled from the assembled
    model with a generator seeded by the run seed), or None for other tasks."""
    corpus = getattr(task, "corpus", None)
    model = assembled_model(config, task, nodes, crashed) if corpus is not None else None
    if model is None:
        return None
    block = task.cfg.block_size
    ids = corpus.val[:16].tolist()
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        for _ in range(length):
            logits = model(torch.tensor([ids[-block:]]))[0, -1]
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return corpus.decode(ids)


def param_digest(node: DataNode | Relay) -> str:
    """sha256 prefix of a node's stage parameters (replicas of a stage must agree)."""
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in node.params)).hexdigest()[:16]


def reference_losses(config: PipelineRunConfig) -> list[float]:
    """Single-process training on the same microbatches: mean loss per iteration (no churn); with
    `pipeline.grad_clip`, each stage's gradient clipped on its own, as the pipeline does."""
    torch.set_num_threads(1)
    task = pipeline_task(config)
    model = task.build_model(config.seed)
    from ...runtime.dp.peer import make_optimizer

    optimizer = make_optimizer(config.train, model.parameters())
    stages = task.stages(model, config.pipeline.stages + 1)  # each clips its own gradient (pipeline.grad_clip)
    sources = sorted(peer_identity(config.seed, i).peer_id for i in range(config.data_nodes))
    m = config.pipeline.microbatches
    losses = []
    for it in range(config.steps):
        optimizer.zero_grad(set_to_none=True)
        values = []
        for src in sources:
            for seq in range(it * m, (it + 1) * m):
                x, y = task.batch(config.seed, src, seq, config.train.batch_size)
                loss = task.output_loss(model(x), y)
                (loss / (m * len(sources))).backward()
                values.append(float(loss.detach()))
        if config.pipeline.grad_clip > 0:
            for stage in stages:
                torch.nn.utils.clip_grad_norm_(stage.parameters(), config.pipeline.grad_clip)
        optimizer.step()
        losses.append(sum(values) / len(values))
    return losses
