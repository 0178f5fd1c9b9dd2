"""The data node: source and sink of its microbatches, holder of stage 0 and the loss.

Each iteration it pushes `microbatches` public batches (deferred ones first),
computes the loss when a last-stage output comes home, and sends the gradient
back along the path. A microbatch with no news for `microbatch_timeout` is
restarted from scratch; one unfinished at `iteration_timeout` is deferred to
the next iteration. A broken backward (BROKEN) is repaired (GWTF: the last
live node of the path resends its stored activation to a new peer, which
recomputes only the missing stage) or restarted (SWARM).

Leader: the data node with the smallest id in the membership view. Every data
node sends its settled microbatches (DONE) to the leader it sees; the leader
floods BEGIN AGGREGATION once all live data nodes have reported. When the
leader dies, the others stop seeing it after the detection delay, resend DONE
to the next smallest id, which takes over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ...algorithms.gwtf.placement import (
    UtilQuery,
    leader,
    merge_entries,
    place_joiners,
    stage_utilization,
)
from ...algorithms.sentinel.statistics import BACKWARD as CHECK_BACKWARD
from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.errors import Evidence, RemoteError
from ...core.serialization import check_tensor, encode
from . import messages as m
from .forward import Held
from .node import PipelineNode
from .relay import parse_util, util_bytes
from .verifier import VERDICT, VerifierConfig, VerifierHop, chained_upstream

MIN_STAGE_GROUP = 3  # under BTARD per stage a joiner goes to a stage with fewer live replicas than this first
SILENT_AFTER = 3  # verdict_timeouts: a link's verifier that gave me no verdict this long while I waited on it is silent


@dataclass
class Microbatch:
    seq: int
    x: torch.Tensor
    y: torch.Tensor
    first_it: int
    att: int = 0
    t_start: float = 0.0
    t_progress: float = 0.0  # its last news: start, loss, a broken-backward report
    t_loss: float | None = None
    t_end: float | None = None
    loss: float | None = None
    path: tuple[str, ...] = ()  # the nodes of its stages: the backward's once it finished
    loss_path: tuple[str, ...] = ()  # the path of the output that came home (a repair changes `path`, not this)
    recomputed: tuple[int, ...] = ()
    restarts: int = 0
    repairs: int = 0
    opened: dict[int, tuple[str, int]] = field(default_factory=dict)  # stage -> (holder, stage of the node that
    # resends) of each repair started and not yet resumed
    fed: dict[tuple[int, str], str] = field(default_factory=dict)  # (link, node a repair put on the path) -> the
    # sender of what it recomputed from, as its holder told (`repaired`); the latest repair wins
    outcome: str = "pending"
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def key(self, src: str) -> m.Key:
        return (src, self.seq, self.att)


def expected_slots(
    loss_path: tuple[str, ...], path: tuple[str, ...], last: int, me: str, fed: Mapping[tuple[int, str], str] | None = None,
) -> list[tuple[str, int, str, str]]:
    """The verdict slots (direction, link, sender, receiver) of every relay-sent tensor that a microbatch's aggregated
    gradients were computed from, given the path of the output that came home (`loss_path`), the path its backward
    finished on (`path`; they differ after a repair) and who fed each node a repair put on the path (`fed`: (link,
    receiver) -> sender). Forward: links 1..S along `loss_path` (the loss, and every stage a repair did not rebuild,
    computed from those activations), and the link into each node a repair put on the path (it recomputed from what
    crossed it): from its sender in `fed`, else from the node before it in `path` (wrong when a later repair rebuilt
    that stage too: the microbatch then waits for a verdict that never comes, and is deferred); backward: links
    0..S-1 along `path`. A repair's last rebuilt stage never sends its recomputed output (the holder resumes with the
    gradient of the output it had): nothing was computed from it, so no verdict on it is wanted; its sender gains
    nothing, since the output it replaced stays wanted."""
    def receiver(p: tuple[str, ...], link: int) -> str:
        return p[link + 1] if link < last else me

    fed = fed or {}
    slots = {(CHECK_FORWARD, link, loss_path[link], receiver(loss_path, link)) for link in range(1, last + 1)}
    slots |= {(CHECK_FORWARD, link, fed[(link, path[link + 1])], path[link + 1]) for link in range(1, last)
              if (link, path[link + 1]) in fed}
    slots |= {(CHECK_FORWARD, link, path[link], path[link + 1]) for link in range(1, last)
              if path[link + 1] != loss_path[link + 1] and (link, path[link + 1]) not in fed}
    slots |= {(CHECK_BACKWARD, link, path[link + 1], path[link]) for link in range(last)}
    return sorted(slots)


class DataNode(PipelineNode):
    """A data node (stage 0); call `run(iterations, on_iteration)`.

    With `sentinel` (client-routed placement) it is also the verifier of its
    microbatches: relays hand it their outputs and input gradients, it judges
    them, routes forwards to the next stage itself and delivers gradients.
    """

    def __init__(self, *args, sentinel: VerifierConfig | None = None, verdict_timeout: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # hop=off_path: the boundary verifiers' verdicts on my microbatches' relay-sent tensors, by (key, it) and
        # (direction, link, sender, receiver) -> cleared; the digest of the output I took per (key, it); the wait
        self.verdict_timeout = verdict_timeout
        self.verdicts: dict[tuple[m.Key, int], dict[tuple[str, int, str, str], bool]] = {}
        self.outputs: dict[tuple[m.Key, int], bytes] = {}
        self._verdict = asyncio.Event()
        self.heard: dict[int, float] = {}  # link -> when its verifier last gave me a verdict (or I began to wait)
        self.unverified: dict[int, int] = {}  # link -> my microbatches left out unverified without its verdict
        self.silent: set[int] = set()  # links whose verifier I reported silent and have not heard from since
        if self.off_path:
            self.transport.add_message_handler(VERDICT, self._on_verdict)
        self.verifier: VerifierHop | None = None
        if sentinel is not None:
            self.client_routed = True
            self.verifier = VerifierHop(self.transport, sentinel, self.config, self.run_seed,
                                        lambda p: self.directory.get(p) == 0, self.on_event,
                                        choose=self._choose_next, on_ban=self.sentinel_ban)
        self.mbs: dict[int, Microbatch] = {}
        self.lost_seen: set[tuple[m.Key, str]] = set()  # (microbatch, departed peer) of the lost reports taken this iteration
        self.repairing: set[tuple[m.Key, int]] = set()  # (microbatch, stage) repaired on a broken report within a COMPLETE timeout
        self.deferred: list[Microbatch] = []
        self.next_seq = 0
        self.deadline = 0.0
        self.reports: dict[int, dict[str, dict]] = {}
        self._report_event = asyncio.Event()
        self.transport.add_message_handler(m.BROKEN, self._on_broken)
        self.transport.add_message_handler(m.REPAIRED, self._on_repaired)
        self.transport.add_message_handler(m.DONE, self._on_done)
        self.transport.add_message_handler(m.SUSPECT, self._on_suspect)
        self.transport.add_message_handler(m.UTIL, self._on_util)
        self.transport.add_request_handler(m.JOIN, self._on_join)
        self.utilization: dict[str, tuple[int, int, int]] = {}  # peer -> (0-based stage, capacity, flow)
        self.util_period = -1
        self.placed = 0
        self._leading: set[int] = set()
        self._wake = asyncio.Event()  # a microbatch found no stage-1 peer: look at the stages again
        self._freed = asyncio.Event()  # set (and replaced) when a microbatch of mine finishes: its slots are free

    def leader(self) -> str:
        return leader(self.data_nodes())

    # --- the iteration loop -----------------------------------------------------

    async def run(
        self, iterations: int, on_iteration: Callable[[dict], None],
        on_start: Callable[[int, float], None] | None = None,
    ) -> None:
        """Train `iterations` iterations; `on_start(it, last duration)` is told when each opens."""
        duration = self.config.complete_timeout
        self.start_background()
        if self.flow is not None:
            await asyncio.sleep(self.config.flow_warmup)  # let the flow algorithm form pipelines first
        for it in range(iterations):
            if it > 0:
                await self.aggregated_event(it - 1).wait()
            if on_start is not None:
                on_start(it, duration)
            record = await self.iteration(it)
            duration = record["t_end"] - record["t_start"]
            on_iteration(record)

    async def iteration(self, it: int) -> dict:
        t_start = self.now()
        batch = self.deferred[: self.config.microbatches]
        self.deferred = self.deferred[len(batch):]
        while len(batch) < self.config.microbatches:
            x, y = self.task.batch(self.run_seed, self.me, self.next_seq, self.train.batch_size)
            batch.append(Microbatch(self.next_seq, x, y, it))
            self.next_seq += 1
        self.mbs = {mb.seq: mb for mb in batch}
        self.lost_seen.clear()
        if self.flow is not None:
            self.flow.pause(True)  # routes stay put while this iteration's microbatches run
        for mb in batch:
            mb.outcome, mb.done = "pending", asyncio.Event()
            self.spawn(self.start(mb, it))
        self.deadline = deadline = t_start + self.config.iteration_timeout
        while (pending := [mb for mb in batch if not mb.done.is_set()]) and self.now() < deadline:
            if self.stage_without_relay():
                break  # nothing can finish in this iteration: defer the rest now, not at the deadline
            self._wake.clear()
            waits = [asyncio.ensure_future(e.wait()) for e in [*(mb.done for mb in pending), self._wake]]
            soonest = min(mb.t_progress for mb in pending) + self.config.microbatch_timeout
            # also look again after half a COMPLETE timeout: a stage-1 peer holding one of ours may have left
            wake = min(deadline, soonest, self.now() + self.config.complete_timeout / 2)
            await asyncio.wait(waits, timeout=max(1e-3, wake - self.now()), return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            self.check_next_peers()
            self.check_paths()
            for mb in pending:
                if not mb.done.is_set() and self.now() - mb.t_progress >= self.config.microbatch_timeout and self.now() < deadline:
                    self.restart(mb, it)
        t_train = self.now()
        if self.leader() == self.me:  # utilization of this iteration, for the joiners of the next (GWTF V-B)
            query = util_bytes(UtilQuery(self.me, "", self.me, it, ()))
            for peer in self.live(1):
                await self.transport.send(peer, m.UTIL, query)
        if self.off_path:
            await self.await_verdicts(it, [mb for mb in batch if mb.outcome == "ok"])
        finished = [mb for mb in batch if mb.outcome == "ok"]
        for mb in batch:
            if mb.outcome != "ok":
                self.held.pop(mb.key(self.me), None)
                self.rerouted.add(mb.key(self.me))  # its backward may still come before the aggregation: STALE
                if mb.outcome == "flagged":
                    continue  # left out for good: run again, the same batch would be flagged again (an honest outlier)
                mb.outcome = "deferred"
                self.deferred.append(Microbatch(mb.seq, mb.x, mb.y, mb.first_it))
        report = {"it": it, "done": [[self.me, mb.seq, mb.att, list(mb.path)] for mb in finished],
                  "suspects": sorted(self.suspects)}
        await self.settle(it, report)
        losses = [mb.loss for mb in finished if mb.loss is not None]
        return {
            "it": it, "peer": self.me, "t_start": t_start, "t_train": t_train, "t_end": self.now(),
            "loss": sum(losses) / len(losses) if losses else None, "completed": len(finished),
            "deferred": len(batch) - len(finished),
            "microbatches": [self._mb_record(mb, it) for mb in batch],
        }

    def stage_without_relay(self) -> int | None:
        """A relay stage with no live peer serving this iteration (its joiners serve from the next), if any."""
        return next((s for s in range(1, self.last + 1) if not self.live(s)), None)

    def _mb_record(self, mb: Microbatch, it: int) -> dict:
        return {"it": it, "src": self.me, "seq": mb.seq, "att": mb.att, "path": list(mb.path), "t_start": mb.t_start,
                "t_loss": mb.t_loss, "t_end": mb.t_end, "loss": mb.loss, "recomputed": list(mb.recomputed),
                "restarts": mb.restarts, "repairs": mb.repairs, "outcome": mb.outcome, "first_it": mb.first_it}

    async def settle(self, it: int, report: dict) -> None:
        """Report to the leader (or lead), then wait for this iteration's aggregation to finish."""
        payload = encode(report)
        done = self.aggregated_event(it)
        while not done.is_set():
            leader = self.leader()
            if leader == self.me:
                self._store_report(self.me, report)
                self.spawn(self.lead(it))
            else:
                await self.transport.send(leader, m.DONE, payload)
            try:
                await asyncio.wait_for(done.wait(), 2 * self.config.aggregation_timeout)
            except asyncio.TimeoutError:
                continue

    async def lead(self, it: int) -> None:
        """As leader: wait for every live data node's DONE, then flood BEGIN AGGREGATION."""
        if it in self._begun or self.me not in self.reports.get(it, {}) or it in self._leading:
            return
        self._leading.add(it)
        # Every live data node reports by its iteration deadline; one that died leaves the view.
        while not set(self.data_nodes()) <= set(self.reports.get(it, {})):
            self._report_event.clear()
            try:
                await asyncio.wait_for(self._report_event.wait(), self.config.complete_timeout)
            except asyncio.TimeoutError:
                pass
        if it in self._begun:
            return
        reports = self.reports.get(it, {})
        done = [d for r in reports.values() for d in r["done"]]
        suspects = {p for r in reports.values() for p in r["suspects"]}
        members = set(self.transport.members())
        groups = [self.data_nodes()]
        for stage in range(1, self.last + 1):
            live = sorted(p for p, s in self.directory.items() if s == stage and p in members and p not in self.banned)
            groups.append([p for p in live if p not in suspects] or live)  # never leave a stage without replicas
        payload = encode({"it": it, "done": done, "groups": groups})
        # The flood runs front to back (each relay passes it on); the leader also sends it to every live
        # relay itself, so a stage left empty by crashes does not cut the stages behind it off.
        relays = sorted(p for p, s in self.directory.items() if s > 0 and p in members)
        for peer in [*self.data_nodes(), *relays]:
            if peer != self.me:
                await self.transport.send(peer, m.BEGIN, payload)
        self._on_begin(self.me, payload)

    def _on_suspect(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "suspect report")
        peer, evidence = obj.get("peer"), obj.get("evidence")
        if not isinstance(peer, str) or not isinstance(evidence, bool):
            raise RemoteError(Evidence(sender, "malformed", "suspect report without a peer id"))
        if self.directory.get(sender, 0) > 0 and self.directory.get(peer, 0) > 0 and sender not in self.banned:
            self.suspects.add(peer)
            if evidence:  # a relay holds evidence against it: route around it (it may frame, see notes)
                self.banned.add(peer)

    def _on_util(self, sender: str, payload: bytes) -> None:
        query = parse_util(payload, sender, self.transport)
        if self.directory.get(sender) != self.last or query.leader != self.me:
            return  # our views of its stage differ (a move not yet seen here): not evidence
        if query.period > self.util_period:
            self.util_period, self.utilization = query.period, {}
        if query.period == self.util_period:
            self.utilization.update(merge_entries([query]))

    async def _on_join(self, sender: str, payload: bytes) -> bytes:
        """A joiner's capacity: place it in the most utilized stage that still has a live relay (GWTF V-B),
        under BTARD per stage in the thinnest stage first while one has fewer than MIN_STAGE_GROUP live
        replicas (churn left stage groups of one, the liar, whose ban emptied the stage for good); a banned
        identity is refused."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, "join request")
        capacity = obj.get("capacity")
        if type(capacity) is not int or not 1 <= capacity <= 1024:
            raise RemoteError(Evidence(sender, "malformed", "join request without a capacity"))
        if sender in self.banned:  # banned (or retired) in the run's one ledger: no stage takes it again
            self.on_event({"kind": "refuse", "peer": sender, "by": self.me, "it": self.version, "t0": self.now(),
                           "t1": self.now()})
            return encode({"refused": True})
        # It came back as a fresh process: out of every group and route until its HELLO says where it serves.
        self.directory.pop(sender, None)
        self.since.pop(sender, None)
        deadline = self.now() + self.config.complete_timeout / 2  # then place on the latest report there is
        while self.util_period < self.version - 1 and self.now() < deadline:
            await asyncio.sleep(self.config.complete_timeout / 20)  # the last iteration's flood is on its way
        members = set(self.transport.members())
        entries = {p: v for p, v in self.utilization.items() if p in members and p != sender}  # a stage no copy
        # reached counts as fully utilized; a stage with no live relay cannot take a joiner (no weights to fetch)
        util = {k: v for k, v in stage_utilization(entries, self.last).items() if self.live(k + 1)}
        if not util:
            return encode({"stage": 0, "it": self.version})
        stage = place_joiners({sender: capacity}, util)[sender] + 1
        if self.stage_bans is not None:  # BTARD per stage: a stage group needs an honest majority against a liar
            sizes = {k + 1: len(self.live(k + 1)) for k in util}
            thin = [s for s, n in sizes.items() if n < MIN_STAGE_GROUP]
            if thin:
                stage = min(thin, key=lambda s: (sizes[s], s))
        self.utilization[sender] = (stage - 1, capacity, 0)  # the next joiner sees this one placed
        self.placed += 1
        known = {p: s for p, s in self.directory.items() if p in members}
        # the ledger the joiner starts from: a fresh process knows no ban, and would route to banned peers
        return encode({"stage": stage, "it": self.version, "directory": known, "banned": sorted(self.banned)})

    def _store_report(self, sender: str, report: dict) -> None:
        self.reports.setdefault(report["it"], {})[sender] = report
        self._report_event.set()

    def _on_done(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "done report")
        ok = (
            self.directory.get(sender) == 0 and type(obj.get("it")) is int and isinstance(obj.get("done"), list)
            and isinstance(obj.get("suspects"), list) and all(isinstance(p, str) for p in obj["suspects"])
            and all(isinstance(d, list) and len(d) == 4 and d[0] == sender and isinstance(d[3], list) for d in obj["done"])
        )
        if not ok:
            raise RemoteError(Evidence(sender, "malformed", "bad DONE report"))
        self._store_report(sender, obj)
        if self.leader() == self.me and obj["it"] == self.version:
            self.spawn(self.lead(obj["it"]))

    # --- one microbatch -----------------------------------------------------------

    async def start(self, mb: Microbatch, it: int) -> None:
        """Compute stage 0 and send the activation into the pipeline."""
        key = mb.key(self.me)
        mb.t_start = mb.t_progress = t0 = self.now()
        async with self.compute_lock:
            if it != self.version:
                return
            with torch.enable_grad():
                out = self.part(mb.x)
            await self._compute(self.staged.forward_flops[0])
        if self.mbs.get(mb.seq) is not mb or mb.att != key[2] or mb.done.is_set():
            return
        restart = m.Restart.make(self.transport.identity, key, it) if key[2] > 0 else None  # relays free the old attempt on it
        self.held[key] = Held(m.Carry(key, it, 0, (), out.detach(), restart=restart), None, out)
        self._emit("fwd", key, it, t0, recompute=mb.restarts > 0)
        await self.send_forward(key)

    def restart(self, mb: Microbatch, it: int) -> None:
        """Start the microbatch again from scratch under a new attempt number (a late backward of the old
        attempt is STALE, not evidence)."""
        self.rerouted.add(mb.key(self.me))
        self.held.pop(mb.key(self.me), None)
        self.pending.pop(mb.key(self.me), None)
        self.delivered.pop(mb.key(self.me), None)
        self.resends.pop(mb.key(self.me), None)
        if self.verifier is not None:
            self.verifier.drop(mb.key(self.me), self.version)
        mb.att += 1
        mb.restarts += 1
        mb.t_loss, mb.loss_path = None, ()
        mb.opened.clear()
        mb.fed.clear()
        self.spawn(self.start(mb, it))

    def _live_mb(self, key: m.Key) -> Microbatch | None:
        mb = self.mbs.get(key[1])
        if key[0] != self.me or mb is None or mb.att != key[2] or mb.done.is_set():
            return None
        return mb

    async def give_up(self, key: m.Key) -> None:
        """Every stage-1 peer denied or failed: wait for one to free memory (`_freed`) and retry; defer if none is
        left, or at once under per-iteration slots (no slot frees before the next iteration)."""
        h = self.held.get(key)
        mb = self._live_mb(key)
        if h is None or mb is None:
            self.held.pop(key, None)
            return
        if not self.live(1) or self.now() >= self.deadline or self.config.capacity_mode == "iteration":
            self.held.pop(key, None)
            self.rerouted.add(key)  # a backward racing the last refusal is STALE, not evidence
            mb.outcome = "denied"
            mb.done.set()
            return
        self._wake.set()
        # Retry once one of my microbatches finishes (its slots on every stage are free again: with one data
        # node, as here, the slots a denied microbatch waits for), at the latest after a tenth of a COMPLETE
        # timeout (another data node's microbatch may free them unseen).
        try:
            await asyncio.wait_for(self._freed.wait(), self.config.complete_timeout / 10)
        except asyncio.TimeoutError:
            pass
        if self.held.get(key) is h:
            h.excluded.clear()
            self.spawn(self.send_forward(key))

    async def take_output(self, sender: str, c: m.Carry) -> bytes:
        mb = self._live_mb(c.key)
        if mb is None or c.path[0] != self.me:
            if c.key[0] == self.me and c.it < self.version or c.key[0] == self.me and c.key[1] in self.mbs:
                return m.answer(m.STALE)  # an old attempt or iteration: not evidence
            raise RemoteError(Evidence(sender, "unknown_microbatch", f"output of {m.key_name(c.key)} I never sent", c.it))
        check_tensor(c.tensor, sender, shape=self.staged.out_shapes[self.last], dtype=torch.float32, step=c.it)
        if self.off_path:
            # the first output whose records chain from mine counts; one planted by a relay off the path, or a
            # second one, is refused (not evidence: the sender may be honest and an upstream relay have lied)
            digest = m.tensor_digest(c.tensor)
            if chained_upstream(c)[1] or self.outputs.setdefault((c.key, c.it), digest) != digest:
                return m.answer(m.DENIED)
        self.receipt(CHECK_FORWARD, c, sender)
        tensor = await self.inbound(CHECK_FORWARD, c)
        if tensor is None:
            return m.answer(m.DENIED)
        t0 = self.now()
        logits = tensor.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = self.task.output_loss(logits, mb.y)
            (grad,) = torch.autograd.grad(loss, logits)
        mb.loss, mb.t_loss, mb.path, mb.loss_path = float(loss.detach()), self.now(), c.path, c.path
        mb.t_progress = self.now()
        self._emit("loss", c.key, c.it, t0)
        self.spawn(self.send_backward(m.Carry(c.key, c.it, self.last, c.path, grad, recomputed=c.recomputed,
                                              seal=self.seal(CHECK_BACKWARD, c.key, c.it, self.last, grad))))
        return m.answer(m.OK)

    def finished(self, key: m.Key, carry: m.Carry) -> None:
        mb = self._live_mb(key)
        if mb is None:
            return
        mb.path, mb.recomputed, mb.t_end, mb.outcome = carry.path, carry.recomputed, self.now(), "ok"
        mb.done.set()
        self._freed.set()
        self._freed = asyncio.Event()

    # --- SENTINEL (client-routed verification, bans) ------------------------------------

    async def inbound(self, direction: str, c: m.Carry) -> torch.Tensor | None:
        if self.verifier is None:
            return c.tensor
        tensor = self.verifier.judge(direction, c, self.me)
        await self.transport.charge_compute(self.verifier.cost(c.tensor))
        return tensor

    def _on_verdict(self, sender: str, payload: bytes) -> None:
        """A boundary verifier's verdict on a relay-sent tensor of one of my microbatches (hop=off_path), from
        that link's verifier only. A flag is final: a later clearing of the same slot does not undo it."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, "verdict")
        key = m.parse_key(obj, sender)
        it, direction, link, relay, to, ok = (obj.get(k) for k in ("it", "dir", "link", "sender", "to", "ok"))
        if not (type(it) is int and direction in (CHECK_FORWARD, CHECK_BACKWARD) and type(link) is int
                and isinstance(relay, str) and isinstance(to, str) and isinstance(ok, bool)) or key[0] != self.me:
            raise RemoteError(Evidence(sender, "malformed", "bad verdict"))
        if sender != self.verifiers.get(link):
            raise RemoteError(Evidence(sender, "false_stage", f"a verdict on link {link} from a peer that does not verify it"))
        if it < self.version - 1:
            return
        slots = self.verdicts.setdefault((key, it), {})
        slot = (direction, link, relay, to)
        slots[slot] = ok and slots.get(slot, True)
        self.heard[link] = self.now()
        self.silent.discard(link)
        self._verdict.set()

    def _expected(self, mb: Microbatch) -> list[tuple[str, int, str, str]]:
        """The verdict slots that clear a microbatch (see `clearance`)."""
        return expected_slots(mb.loss_path or mb.path, mb.path, self.last, self.me, mb.fed)

    def _paths_whole(self, mb: Microbatch) -> bool:
        return len(mb.path) == self.last + 1 and len(mb.loss_path or mb.path) == self.last + 1

    def missing(self, mb: Microbatch, it: int) -> set[int]:
        """The links whose verifier has given no verdict yet on a relay-sent tensor of the microbatch's path."""
        slots = self.verdicts.get((mb.key(self.me), it), {})
        return {slot[1] for slot in self._expected(mb) if slot not in slots} if self._paths_whole(mb) else set()

    def clearance(self, mb: Microbatch, it: int) -> bool | None:
        """Whether every relay-sent tensor its stages computed from was cleared by its link's verifier (True), one
        was flagged (False), or verdicts are still missing (None); which tensors: `expected_slots`. What I send is
        not judged. Verdicts about other senders or receivers are not about this microbatch's paths: ignored."""
        slots = self.verdicts.get((mb.key(self.me), it), {})
        if not self._paths_whole(mb):
            return False
        expected = self._expected(mb)
        if not all(slots.get(slot, True) for slot in expected):
            return False
        return True if all(slot in slots for slot in expected) else None

    async def await_verdicts(self, it: int, finished: list[Microbatch]) -> None:
        """Before BEGIN: wait (at most `verdict_timeout`) until each finished microbatch is cleared or flagged.
        One flagged is left out of the aggregation for good; one still unverified at the timeout (a verifier
        that never answers, a relay that skipped its copy or a receiver its receipt) is left out and deferred
        to the next iteration: no stage aggregates a gradient computed from a tensor no verifier cleared.
        A verifier out of my membership view is gone: a microbatch that misses its verdict is not waited for.
        Per link I count the microbatches left out without its verdict, and report its verifier silent
        (`verifier_silent`) once it has given me none for SILENT_AFTER verdict timeouts while I waited on it."""
        start = self.now()
        deadline = start + self.verdict_timeout
        while (waiting := [mb for mb in finished if self.clearance(mb, it) is None]) and self.now() < deadline:
            members = set(self.transport.members())
            gone = {link for link, verifier in self.verifiers.items() if verifier not in members}
            if all(self.missing(mb, it) & gone for mb in waiting):
                break  # each waits on a verifier that is gone: no verdict will come
            self._verdict.clear()
            try:
                await asyncio.wait_for(self._verdict.wait(), deadline - self.now())
            except asyncio.TimeoutError:
                break
        waited: set[int] = set()
        for mb in finished:
            state = self.clearance(mb, it)
            if state is not True:
                mb.outcome = "unverified" if state is None else "flagged"
                links = sorted(self.missing(mb, it)) if state is None else []
                for link in links:
                    self.unverified[link] = self.unverified.get(link, 0) + 1
                waited.update(links)
                self.on_event({"kind": "unverified", "peer": self.me, "it": it, "mb": m.key_name(mb.key(self.me)),
                               "src": self.me, "seq": mb.seq, "att": mb.att, "flagged": state is False,
                               "links": links, "t0": self.now(), "t1": self.now()})
        self._report_silence(it, start, waited)
        for old in [k for k in self.verdicts if k[1] < it]:
            del self.verdicts[old]
        for old in [k for k in self.outputs if k[1] < it]:
            del self.outputs[old]

    def _report_silence(self, it: int, start: float, waited: set[int]) -> None:
        """Report each link's verifier that my microbatches waited on and that has been gone from my view, or
        given me no verdict for SILENT_AFTER verdict timeouts: once, until it gives a verdict again."""
        members = set(self.transport.members())
        now = self.now()
        for link in sorted(waited - self.silent):
            verifier = self.verifiers[link]
            since = self.heard.setdefault(link, start)
            gone = verifier not in members
            if gone or now - since >= SILENT_AFTER * self.verdict_timeout:
                self.silent.add(link)
                self.on_event({"kind": "verifier_silent", "peer": self.me, "it": it, "link": link, "verifier": verifier,
                               "gone": gone, "since": since, "unverified": self.unverified[link], "t0": now, "t1": now})

    def _choose_next(self, c: m.Carry, excluded: set[str]) -> str | None:
        candidates = [p for p in self.live(c.stage) if p not in excluded]
        return self.router.choose(c.stage, candidates, c.key[0], c.path[-1])

    def sentinel_ban(self, peer: str, it: int, keys: list[m.Key]) -> None:
        """Route around `peer`; restart my unfinished microbatches that went through it (rerouted)."""
        keys = keys + [k for k, h in self.held.items() if h.next_peer == peer]  # sent there by me directly
        super().sentinel_ban(peer, it, keys)
        self.suspects.add(peer)
        for key in keys:
            mb = self._live_mb(key)
            if mb is not None and mb.outcome == "pending":
                self.restart(mb, self.version)

    # --- broken backward ------------------------------------------------------------

    async def report_broken(self, carry: m.Carry) -> None:
        await self.handle_broken(carry.key, carry.stage, self.me)

    def _on_broken(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "broken report")
        key = m.parse_key(obj, sender)
        stage, lost, dead = obj.get("stage"), obj.get("lost", False), obj.get("to", "")
        if (type(stage) is not int or not 0 <= stage <= self.last or not isinstance(lost, bool)
                or not isinstance(dead, str)):
            raise RemoteError(Evidence(sender, "malformed", "broken report with a bad stage"))
        if stage == 0:  # the input gradient a stage-1 relay sent me did not arrive (a timeout, or I refused it)
            mb = self._live_mb(key)
            if mb is not None and not lost and mb.path[1:2] == (sender,):
                self.restart(mb, self.version)  # not wait out the microbatch timeout
            return
        if lost:
            # only from a relay of the stage before, about a peer of `stage`, once per departed peer and microbatch,
            # and once that peer is gone from my view too (views differ by seconds): another one is not evidence, and
            # acting on it would let any relay restart every microbatch it can name
            if (stage >= 2 and self.directory.get(sender) == stage - 1 and self.directory.get(dead) == stage
                    and self._live_mb(key) is not None and (key, dead) not in self.lost_seen):
                self.lost_seen.add((key, dead))  # a report about a key I do not run marks nothing (RP 6)
                if dead in self.transport.members():
                    self.spawn(self._lost_once_gone(key, stage, dead))
                else:
                    self.forward_lost(key, stage, dead)
        else:  # a backward breaks only after the loss, at the node of the path's next stage; one repair of a stage at once
            mb = self._live_mb(key)
            if (mb is not None and mb.t_loss is not None and mb.path[stage + 1:stage + 2] == (sender,)
                    and (key, stage) not in self.repairing):
                self.spawn(self.handle_broken(key, stage, sender))

    def check_paths(self) -> None:
        """After a microbatch's loss, a relay of its path that left my view may have died with its backward, and its
        upstream relay reports it lost only when pipeline traffic reaches it (or every `watch_period`): none may
        come. So I ask the node before it whether it still waits for that backward (PING: it holds the microbatch);
        if so, the stage is repaired when the node after it confirms it delivered the backward to the departed one
        (`_repair_delivered`); one that did not has yet to send it, fails, and reports BROKEN. When the node after it
        left too, nobody will report: the backward is lost there (`forward_lost`: restarted unless a repair makes
        progress). Once per departed peer and microbatch (again after a PING that got no answer), as a relay's lost
        report; stage 1's upstream is me (`check_next_peers`)."""
        members = set(self.transport.members())
        for mb in self.mbs.values():
            if mb.done.is_set() or mb.t_loss is None or len(mb.path) != self.last + 1:
                continue
            key = mb.key(self.me)
            for stage in range(2, self.last + 1):
                dead = mb.path[stage]  # (an upstream gone too is the departure one stage up)
                if dead not in members and mb.path[stage - 1] in members and (key, dead) not in self.lost_seen:
                    self.lost_seen.add((key, dead))
                    self.spawn(self._lost_if_held(mb, key, stage, dead))

    async def _lost_if_held(self, mb: Microbatch, key: m.Key, stage: int, dead: str) -> None:
        upstream = mb.path[stage - 1]
        word = await self._ask(upstream, m.PING, encode({"src": key[0], "seq": key[1], "att": key[2]}))
        if word is None:
            self.lost_seen.discard((key, dead))  # no answer (busy, or gone too): look again on my next pass
            return
        if word != m.OK or self._live_mb(key) is not mb or mb.path[stage] != dead:
            return
        holder = mb.path[stage + 1] if stage < self.last else self.me
        if holder != self.me and holder not in self.transport.members():
            self.forward_lost(key, stage, dead)
        else:
            await self._repair_delivered(mb, key, stage, dead)

    async def _lost_once_gone(self, key: m.Key, stage: int, dead: str) -> None:
        """A lost report about a peer I still see: act on it once it leaves my view, within a COMPLETE timeout."""
        deadline = self.now() + self.config.complete_timeout
        while dead in self.transport.members():
            if self.now() >= deadline:
                self.lost_seen.discard((key, dead))  # it did not leave: a later report about it counts again
                return
            await asyncio.sleep(self.config.complete_timeout / 10)
        self.forward_lost(key, stage, dead)

    async def report_lost(self, key: m.Key, stage: int, dead: str) -> None:
        self.forward_lost(key, stage, dead)

    def forward_lost(self, key: m.Key, stage: int, dead: str) -> None:
        """A node on the microbatch's path saw the peer it passed it to (`dead`, of `stage`) leave. Before the
        output came home the microbatch is lost: restart it. After, its backward may be stuck at the gone
        peer with nobody left to report it: repair the stage from the gradient delivered to it
        (`_repair_delivered`), and restart it unless a repair makes progress within a COMPLETE timeout."""
        mb = self._live_mb(key)
        if mb is None:
            return
        if mb.t_loss is None:
            self.restart(mb, self.version)
            return
        self.spawn(self._restart_unless_progress(mb, key[2], self.now(), mb.repairs))
        if dead:
            self.spawn(self._repair_delivered(mb, key, stage, dead))

    async def _repair_delivered(self, mb: Microbatch, key: m.Key, stage: int, dead: str) -> None:
        """`dead` took the microbatch's backward and left before passing its own on (had it not taken it, its sender
        would report the backward broken): the next node of the path keeps the gradient it delivered (`delivered`),
        so the stage is repaired from it as from a broken report. Only for a peer gone from my view, and only
        when that node confirms it delivered to that peer: a lost report alone repairs nothing."""
        if not 1 <= stage <= self.last or len(mb.path) != self.last + 1 or dead in self.transport.members():
            return
        holder = mb.path[stage + 1] if stage < self.last else self.me
        if holder == self.me:
            c = self.delivered.get(key)
            confirmed = c is not None and c.path[c.stage] == dead
        else:
            body = {"src": key[0], "seq": key[1], "att": key[2], "delivered_to": dead}
            confirmed = await self._ask(holder, m.PING, encode(body)) == m.OK
        if confirmed and self._live_mb(key) is mb:
            await self.handle_broken(key, stage, holder)

    def _on_repaired(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "repaired")
        key = m.parse_key(obj, sender)
        stage, prefix = obj.get("stage"), obj.get("path")
        if type(stage) is not int or not isinstance(prefix, list) or not all(isinstance(p, str) for p in prefix):
            raise RemoteError(Evidence(sender, "malformed", "bad repaired report"))
        self.repaired(sender, key, stage, tuple(prefix))

    async def tell_repaired(self, key: m.Key, stage: int, prefix: tuple[str, ...]) -> None:
        self.repaired(self.me, key, stage, prefix)  # I held the gradient (the last stage left)

    def repaired(self, holder: str, key: m.Key, stage: int, prefix: tuple[str, ...]) -> None:
        """The holder of a repair I started resumed it with `prefix`, the path up to the rebuilt `stage`: the path
        now runs through the nodes it put there (a broken report from one of them is heard, a later repair pings
        them), and each of them computed from what the node before it in `prefix` sent (`fed`: the verdicts wanted,
        even after a later repair replaces that sender). Only from the holder I named, once per repair, with the
        nodes before the one I asked to resend unchanged and each rebuilt node of its stage in my directory (or not
        known to it yet); else ignored (a report late for a restarted attempt). A resumed repair is progress: its
        backward gets a COMPLETE timeout of its own."""
        mb = self._live_mb(key)
        opened = mb.opened.get(stage) if mb is not None else None
        if opened is None or opened[0] != holder or len(prefix) != stage + 1:
            return
        live_at = opened[1]
        if prefix[: live_at + 1] != mb.path[: live_at + 1] or any(
                self.directory.get(p, j) != j for j, p in enumerate(prefix) if j > live_at):
            return
        del mb.opened[stage]
        for rebuilt in range(live_at + 1, stage + 1):
            mb.fed[(rebuilt - 1, prefix[rebuilt])] = prefix[rebuilt - 1]
        mb.path = prefix + mb.path[stage + 1:]
        mb.t_progress = self.now()
        self.spawn(self._restart_unless_progress(mb, key[2], mb.t_progress, mb.repairs))

    async def _restart_unless_progress(self, mb: Microbatch, att: int, since: float, repairs: int) -> None:
        """Restart the microbatch after a COMPLETE timeout unless it finished, made progress after `since`, or a
        repair began after the `repairs` it had (that one arms its own timeout)."""
        await asyncio.sleep(self.config.complete_timeout)
        if (mb.att == att and not mb.done.is_set() and mb.t_progress <= since and mb.repairs == repairs
                and self.mbs.get(mb.seq) is mb):
            self.restart(mb, self.version)

    async def handle_broken(self, key: m.Key, stage: int, holder: str) -> None:
        """The gradient of `stage`'s output is stuck at `holder`: repair the stage (GWTF) or restart (SWARM)."""
        mb = self._live_mb(key)
        if mb is None:
            return
        expected_stage = stage + 1 if stage < self.last else 0
        if holder != self.me and self.directory.get(holder) != expected_stage:
            return  # our views of its stage differ (a move not yet seen here): not evidence; the timeout restarts it
        if self.router.restart_on_backward_failure or len(mb.path) != self.last + 1:
            self.restart(mb, self.version)
            return
        self.repairing.add((key, stage))
        asyncio.get_running_loop().call_later(self.config.complete_timeout, self.repairing.discard, (key, stage))
        live_at, live_node = 0, self.me
        members = set(self.transport.members())
        for stage_index in range(stage - 1, 0, -1):
            if mb.path[stage_index] not in members:
                continue  # gone: do not wait out a timeout on it
            word = await self._ask(mb.path[stage_index], m.PING, encode({"src": key[0], "seq": key[1], "att": key[2]}))
            if word == m.OK:
                live_at, live_node = stage_index, mb.path[stage_index]
                break
        # the holder gives its gradient only to the node this repair goes to, along the chain from `live_node`
        if holder == self.me:
            word = m.OK if self.expect_resume(key, live_node) else m.UNKNOWN
        else:
            word = await self._ask(holder, m.RESENDS, encode({"src": key[0], "seq": key[1], "att": key[2], "from": live_node}))
        if self._live_mb(key) is not mb:
            return
        if word != m.OK:
            if word is None:  # the holder does not answer (gone): nothing to resume from
                self.restart(mb, self.version)
            return  # it keeps nothing of this microbatch (a false report, or a gradient already resumed): no repair
        mb.repairs += 1
        mb.t_progress = self.now()
        mb.opened[stage] = (holder, live_at)
        if live_node == self.me:
            ok = self.reforward(key, stage, holder)
        else:
            body = {"src": key[0], "seq": key[1], "att": key[2], "upto": stage, "holder": holder}
            ok = await self._ask(live_node, m.REFORWARD, encode(body)) == m.OK
        if not ok and self._live_mb(key) is mb:
            self.restart(mb, self.version)
        elif ok:  # a repair that dead-ends (its RESUME refused) costs a COMPLETE timeout, not the microbatch timeout
            self.spawn(self._restart_unless_progress(mb, key[2], mb.t_progress, mb.repairs))
