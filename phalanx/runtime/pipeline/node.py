"""What every pipeline node does, data node or relay: compute, route, repair, aggregate.

A node serves one stage (data nodes serve stage 0). Forward: an activation
arrives as a FORWARD request; the node checks it, computes, keeps what backward
needs, answers COMPLETE, and routes its output to a next-stage peer chosen by
its router, trying another on DENY or timeout and sending DENY upstream when
none is left. Backward: a BACKWARD request carries the gradient of the node's
output; the node computes its parameter gradient for that microbatch (kept
apart until aggregation, so only microbatches that finished count), answers
COMPLETE and sends its input gradient to the previous node of the path. When
that fails, the node keeps the gradient and tells the data node (BROKEN).

Aggregation (GWTF V-E): BEGIN AGGREGATION floods front to back with the list
of finished microbatches and the replica group of every stage; each replica
contributes one gradient vector, its mean gradient over the finished
microbatches it served times its share of the stage's work (`contribution`),
the group reduces them with butterfly all-reduce and the configured reducer
(`allreduce.reducer`: the mean gives exactly the mean gradient over all
finished microbatches; a robust rule bounds a lying replica), and every
replica steps with the result. CAN TAKE then flows back to front and opens
the next iteration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.sentinel.attacks import ACTIVATION, GRADIENT
from ...algorithms.sentinel.statistics import BACKWARD as CHECK_BACKWARD
from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.errors import (
    Evidence,
    PeerTimeout,
    PeerUnreachable,
    PhalanxError,
    RemoteError,
)
from ...core.serialization import check_tensor, decode, digest, encode
from ...training.task import Task, num_params
from ...transport.base import Transport
from ..dp.peer import TrainConfig, make_optimizer
from ..rounds.btard import BTARDConfig
from ..rounds.butterfly import AllReduceConfig, ButterflyAllReduce, Reducer
from . import messages as m
from .config import PipelineConfig
from .gwtf import FlowDriver
from .routing import Router
from .stage_btard import StageBanReports, StageRound
from .stages import StagedModel, contribution, flat
from .verifier import BAN, parse_ban, via_bytes
from .verifier import VIA as VIA_TOPIC

log = logging.getLogger(__name__)

EventSink = Callable[[dict], None]


@dataclass
class Held:
    """A microbatch between its forward and its backward on this node."""

    carry: m.Carry  # as it arrived (path up to the previous stage)
    x: torch.Tensor | None  # input with requires_grad (None where the input is data)
    out: torch.Tensor
    excluded: set[str] = field(default_factory=set)
    next_peer: str | None = None
    recomputed: tuple[int, ...] = ()
    sent: torch.Tensor | None = None  # what goes forward (the output, unless the node's policy tampers)
    lost_reported: bool = False  # its next peer left the membership view and the data node was told
    refusals: int = 0  # next peers that refused it (routers that do not remember refusals)


class PipelineNode:
    """One node of the pipeline serving `stage`; subclasses add the data node's and relay's loops."""

    def __init__(
        self,
        transport: Transport,
        task: Task,
        staged: StagedModel,
        stage: int,
        train: TrainConfig,
        config: PipelineConfig,
        directory: dict[str, int],
        run_seed: int,
        router: Router,
        *,
        capacity: int | None = None,
        allreduce: AllReduceConfig = AllReduceConfig(),
        reducer: Reducer | None = None,
        on_event: EventSink | None = None,
        flow: FlowDriver | None = None,
        verifiers: dict[int, str] | None = None,
        client_routed: bool = False,
        btard: BTARDConfig | None = None,
        policy: ProtocolPolicy | None = None,
    ) -> None:
        self.transport = transport
        self.me = transport.peer_id
        self.task = task
        self.staged = staged
        self.stage = stage
        self.last = config.stages  # index of the last relay stage
        self.train = train
        self.config = config
        self.directory = dict(directory)
        self.directory[self.me] = stage
        self.run_seed = run_seed
        self.router = router
        self.capacity = capacity if capacity is not None else config.capacity
        self.on_event = on_event or (lambda event: None)
        self.flow = flow
        self.verifiers = dict(verifiers or {})  # link -> the boundary verifier all its traffic goes through
        self.client_routed = client_routed  # relays hand outputs and gradients to the data node, which routes
        self._stopped = asyncio.Event()
        self.part = staged.parts[stage]
        self.params = list(self.part.parameters())
        self.optimizer = make_optimizer(train, self.params)
        self.groups: list[list[str]] = []  # the replica group of every stage, from the latest BEGIN
        secure = btard is not None and btard.enabled  # BTARD per relay stage (stage_btard.py); data nodes are trusted
        # With validators every node signs the tensors it sends (a Seal), and relays keep what they received:
        # the inputs a stage gradient is recomputed from (issue 18 item 2).
        self.sealing = secure and btard.validators > 0
        self.received: dict[m.Key, tuple[m.Carry, m.Carry]] = {}  # key -> (forward carry, backward carry) it computed with
        self.finished_paths: dict[m.Key, list[str]] = {}  # the latest BEGIN's finished microbatches and their paths
        self.stage_bans = StageBanReports(self) if secure else None  # stage rounds' bans, applied on a stage majority
        if secure and stage > 0:
            self.allreduce = StageRound(self, num_params(self.part), allreduce, btard, policy)
        else:
            self.allreduce = ButterflyAllReduce(transport, num_params(self.part), reducer or allreduce.build_reducer(), allreduce)
        self.version = 0  # optimizer steps applied = the iteration this node accepts microbatches for
        self.entered = True  # a joiner is not until its download is done (`enter`)
        self._catching_up = False
        self.serving_from = 0  # the first iteration this node takes microbatches for (a joiner: after its download)
        self.membership: dict[str, int] = {}  # peer -> sequence number of the latest HELLO applied (versioned membership)
        self.since: dict[str, int] = {}  # joiner -> the first iteration it serves (from its HELLO)
        self.held: dict[m.Key, Held] = {}
        self.slots: set[m.Key] = set()  # microbatches admitted in this iteration (capacity_mode=iteration)
        self.refused: set[str] = set()  # next peers that refused a microbatch in this iteration (their slots are
        # used up: GWTF V-D, "nodes that send DENY are excluded until they free memory"; capacity_mode=iteration)
        self.sent_to: dict[tuple[str, str], int] = {}  # (data node, next peer) -> microbatches placed there this iteration
        self.grads: dict[m.Key, torch.Tensor] = {}  # key -> this node's parameter gradient for that microbatch
        self.pending: dict[m.Key, m.Carry] = {}  # backward gradients waiting for a repaired stage
        self.suspects: set[str] = set()
        self.banned: set[str] = set()  # peers we hold evidence against (or a relay told us it does)
        self.rerouted: set[m.Key] = set()  # microbatches dropped here because a verifier banned a peer on their path
        transport.on_evidence(self._on_evidence)
        self.compute_lock = asyncio.Lock()
        self._ready: dict[int, asyncio.Event] = {}
        self._begun: set[int] = set()
        self._can_take: dict[int, asyncio.Event] = {}
        self._aggregated: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        transport.add_request_handler(m.FORWARD, self._on_forward)
        transport.add_request_handler(m.BACKWARD, self._on_backward)
        transport.add_request_handler(m.PING, self._on_ping)
        transport.add_request_handler(m.REFORWARD, self._on_reforward)
        transport.add_request_handler(m.RESUME, self._on_resume)
        transport.add_message_handler(m.DENY, self._on_deny)
        transport.add_message_handler(m.BEGIN, self._on_begin)
        transport.add_message_handler(m.CAN_TAKE, self._on_can_take)
        transport.add_request_handler(m.WEIGHTS, self._on_weights)
        transport.add_message_handler(m.HELLO, self._on_hello)
        transport.add_message_handler(BAN, self._on_ban)
        self.served = 0  # microbatches this node computed a forward for in this iteration
        self.last_served = 0

    # --- helpers ------------------------------------------------------------

    def start_background(self) -> None:
        """Start what runs beside training (the flow algorithm under gwtf routing)."""
        if self.flow is not None:
            self.spawn(self.flow.loop(lambda: {p: s for p, s in self.directory.items() if p not in self.banned},
                                      self._stopped))
        if self.config.watch_period > 0:
            self.spawn(self._watch_next_peers())

    async def _watch_next_peers(self) -> None:
        """`check_next_peers` every `watch_period` seconds, so that a microbatch whose next peer died while
        nothing else reaches this node (a gradient lost in flight) is reported, not left to its timeout."""
        while not self._stopped.is_set():
            await asyncio.sleep(self.config.watch_period)
            self.check_next_peers()

    def stop(self) -> None:
        self._stopped.set()

    def check_next_peers(self) -> None:
        """A microbatch I passed on is lost when the peer I passed it to leaves before its output came
        home: tell its data node (it restarts the microbatch, or watches its backward) instead of
        letting it wait out the microbatch timeout. Checked whenever pipeline traffic wakes the node
        (no timer of its own, so that a run without churn is scheduled exactly as before)."""
        members = set(self.transport.members())
        for key, h in list(self.held.items()):
            if h.next_peer is not None and h.next_peer not in members and not h.lost_reported:
                h.lost_reported = True
                self.spawn(self.report_lost(key, self.stage + 1))

    async def report_lost(self, key: m.Key, stage: int) -> None:
        body = {"src": key[0], "seq": key[1], "att": key[2], "stage": stage, "lost": True}
        await self.transport.send(key[0], m.BROKEN, encode(body))

    async def close(self) -> None:
        """Stop and cancel everything this node still runs (before its transport stops)."""
        self.stop()
        if isinstance(self.allreduce, StageRound):
            self.allreduce.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def now(self) -> float:
        return self.transport.clock.now()

    def live(self, stage: int) -> list[str]:
        """Peers of `stage` in this node's directory and membership view, not banned, serving by the
        iteration this node is at, sorted."""
        members = set(self.transport.members())
        return sorted(p for p, s in self.directory.items() if s == stage and p in members and p != self.me
                      and p not in self.banned and self.since.get(p, 0) <= self.version)

    def _on_evidence(self, evidence: Evidence) -> None:
        """A peer sent us something it must not have: route around it from now on and tell the data nodes."""
        if evidence.peer in self.banned or self.directory.get(evidence.peer) == 0:
            return
        self.banned.add(evidence.peer)
        if self.flow is not None:  # a banned peer leaves the flow at once
            self.spawn(self.flow.send(self.flow.lost(evidence.peer)))
        body = encode({"peer": evidence.peer, "evidence": True})
        for node in self.data_nodes():
            if node != self.me:
                self.spawn(self.transport.send(node, m.SUSPECT, body))

    def data_nodes(self) -> list[str]:
        members = set(self.transport.members())
        return sorted(p for p, s in self.directory.items() if s == 0 and (p in members or p == self.me))

    def ready_event(self, version: int) -> asyncio.Event:
        return self._ready.setdefault(version, asyncio.Event())

    async def wait_version(self, it: int, timeout: float) -> bool:
        if self.version >= it:
            return True
        try:
            await asyncio.wait_for(self.ready_event(it).wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _emit(self, kind: str, key: m.Key, it: int, t0: float, **extra) -> None:
        self.on_event({"kind": kind, "peer": self.me, "stage": self.stage, "mb": m.key_name(key), "src": key[0],
                       "seq": key[1], "att": key[2], "it": it, "t0": t0, "t1": self.now(), **extra})

    async def _compute(self, flops: float) -> None:
        t0 = self.now()
        await self.transport.charge_compute(flops * self.config.flops_scale)
        if self.flow is not None:
            self.flow.measured_compute(self.now() - t0, self.config.ema)

    # --- forward --------------------------------------------------------------

    async def _on_forward(self, sender: str, payload: bytes) -> bytes:
        self.check_next_peers()
        c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
        if len(c.path) != c.stage or c.stage < 1 or c.path[-1] != sender and not self.relayed_by(sender, c):
            raise RemoteError(Evidence(sender, "false_stage", "forward sender is not the last node of its path", c.it))
        sender = c.path[-1]  # through a verifier hop: the peer it verified for
        claimed = self.directory.get(sender)
        if claimed is not None and claimed != c.stage - 1:
            if claimed == 0 or c.stage == 1:  # data nodes never move: a relay posing as one (or the reverse) lies
                raise RemoteError(Evidence(sender, "false_stage", f"claims stage {c.stage - 1}, serves {claimed}", c.it))
            return m.answer(m.DENIED)  # a relay that moved or rejoined, our views differ: not evidence
        if c.stage == self.last + 1 and self.stage == 0:
            return await self.take_output(sender, c)
        if c.stage != self.stage or not self.entered or c.it < self.serving_from:
            return m.answer(m.DENIED)  # misrouted (views differ), or a joiner before its first iteration
        check_tensor(c.tensor, sender, shape=self.staged.input_shape(self.stage), dtype=torch.float32, step=c.it)
        if self.sealing:
            self.check_seal(CHECK_FORWARD, c, sender)
        if c.it < self.version:
            return m.answer(m.STALE)
        if self.sealing:  # two sealed activations for one microbatch (held, or computed with): their signer equivocates
            earlier = self.held[c.key].carry if c.key in self.held else self.received.get(c.key, (None, None))[0]
            if earlier is not None and earlier.seal is not None and m.tensor_digest(earlier.tensor) != m.tensor_digest(c.tensor):
                raise RemoteError(Evidence(c.seal.signer, "equivocation", f"two sealed activations for {m.key_name(c.key)}", c.it))
        if c.key in self.held:
            return m.answer(m.OK)  # a resend of what we already hold
        if self.full():
            return m.answer(m.DENIED)
        self.held[c.key] = Held(c, None, c.tensor)  # reserve the slot before waiting
        self.slots.add(c.key)
        # Our aggregation may end just after the sender's; a replica further behind is catching up: deny
        # long before the sender's COMPLETE timeout, so that it tries another peer instead of suspecting us.
        if not await self.wait_version(c.it, min(self.config.aggregation_timeout, self.config.complete_timeout / 2)):
            if c.it == self.version + 1 and not self._catching_up:  # behind (a missed BEGIN): catch up
                self._catching_up = True
                self.spawn(self.catch_up(c.it, unstepped=False)).add_done_callback(self._caught_up)
            self.release(c.key)
            return m.answer(m.DENIED)
        t0 = self.now()
        async with self.compute_lock:
            if c.it != self.version:
                self.release(c.key)
                return m.answer(m.STALE)
            x = c.tensor.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                out = self.part(x)
            await self._compute(self.staged.forward_flops[self.stage])
        if c.key not in self.held:
            return m.answer(m.DENIED)  # the iteration ended while we computed
        recomputed = c.recomputed + ((self.stage,) if c.repair >= 0 else ())
        sent = self.tamper(ACTIVATION, c.it, c.key, out.detach())
        self.held[c.key] = Held(c, x, out, recomputed=recomputed, sent=sent)
        self._emit("fwd", c.key, c.it, t0, recompute=c.repair >= 0)
        self.served += 1
        if self.flow is not None:
            self.flow.pause(True)  # routes stay put while this iteration's microbatches run
        if c.repair == self.stage:
            self.spawn(self._resume(c.key))
        else:
            self.spawn(self.send_forward(c.key))
        return m.answer(m.OK)

    async def send_forward(self, key: m.Key) -> None:
        """Route a held output to the next stage: retry on failure, DENY upstream when nobody is left."""
        h = self.held.get(key)
        if h is None:
            return
        nxt = self.stage + 1
        path = h.carry.path + (self.me,)
        while key in self.held:
            if nxt == self.last + 1:
                candidates = [key[0]] if key[0] not in h.excluded else []
            else:
                candidates = [p for p in self.live(nxt) if p not in h.excluded and p not in self.refused]
            load: dict[str, int] = {}
            if self.config.capacity_mode == "iteration":  # slots used this iteration, for this data node's flow
                load = {p: n for (sink, p), n in self.sent_to.items() if sink == key[0]}
            else:
                for other in self.held.values():
                    if other.next_peer is not None:
                        load[other.next_peer] = load.get(other.next_peer, 0) + 1
            upstream = h.carry.path[-1] if h.carry.path else ""
            client = self.client_routed and 0 < self.stage < self.last
            peer = key[0] if client else self.router.choose(nxt, candidates, key[0], upstream, load)
            if peer is None:
                await self.give_up(key)
                return
            tensor = h.sent if h.sent is not None else h.out.detach()
            carry = m.Carry(key, h.carry.it, nxt, path, tensor, h.carry.repair, h.carry.holder, h.recomputed,
                            seal=self.seal(CHECK_FORWARD, key, h.carry.it, nxt, tensor))
            carry = self.signed(CHECK_FORWARD, carry, h.carry, peer)
            t0 = self.now()
            word = await self.deliver("" if client else peer, CHECK_FORWARD, carry)
            if client and word == m.DENIED:  # the data node found no next peer: it restarts the microbatch
                self.held.pop(key, None)
                return
            self._emit("send", key, h.carry.it, t0, to=peer, answer=word,
                       branch="client" if client else self.router.last_branch)
            if word == m.OK:
                self.router.observe(peer, self.now() - t0)
                if self.flow is not None:
                    await self.flow.send(self.flow.measured_rtt(peer, self.now() - t0, self.config.ema))
                h.next_peer = peer
                self.sent_to[(key[0], peer)] = self.sent_to.get((key[0], peer), 0) + 1
                return
            if word == m.STALE:
                return
            self.router.failed(peer)
            if word is None and self.flow is not None:  # timed out or unreachable: its cost goes up
                await self.flow.send(self.flow.failed(peer, 4 * self.config.complete_timeout, self.config.ema))
            if word == m.DENIED and self.router.remembers_refusals and self.config.capacity_mode == "iteration":
                self.refused.add(peer)  # full until the next iteration, for every microbatch
            if word is None or self.router.remembers_refusals:
                h.excluded.add(peer)
            else:  # a refusal not remembered (SWARM knows no memory): the peer may be drawn again, within a bound
                h.refusals += 1
                if h.refusals >= 2 * len(candidates):
                    h.excluded.update(candidates)

    def full(self) -> bool:
        """No room for another microbatch: `capacity` held at once, or (capacity_mode=iteration)
        `capacity` admitted in this iteration (a slot frees only at aggregation, or when given up)."""
        used = len(self.slots) if self.config.capacity_mode == "iteration" else len(self.held)
        return used >= self.capacity

    def release(self, key: m.Key) -> Held | None:
        """Drop a microbatch this node will not pass on, and its slot."""
        self.slots.discard(key)
        return self.held.pop(key, None)

    def relayed_by(self, sender: str, c: m.Carry) -> bool:
        """Whether `sender` is a verifier hop trusted to deliver carries for other peers: a boundary
        verifier, or (client-routed) the microbatch's data node."""
        if sender in self.verifiers.values():
            return True
        return self.client_routed and sender == c.key[0] and self.directory.get(sender) == 0

    def hop(self, direction: str, c: m.Carry, to: str) -> str | None:
        """The verifier hop a carry goes through, or None to send it straight to `to`."""
        if self.verifiers:
            link = c.stage - 1 if direction == CHECK_FORWARD else c.stage
            return self.verifiers.get(link)
        if self.client_routed and self.stage > 0 and to != c.key[0]:
            return c.key[0]
        return None

    async def deliver(self, to: str, direction: str, c: m.Carry) -> str | None:
        """Send a forward or backward carry to `to`, through its verifier hop if there is one."""
        topic = m.FORWARD if direction == CHECK_FORWARD else m.BACKWARD
        via = self.hop(direction, c, to)
        if via is None:
            pad = self.config.activation_bytes - c.tensor.numel() * c.tensor.element_size()
            return await self._ask(to, topic, c.to_bytes(pad))
        return await self._ask(via, VIA_TOPIC, via_bytes(direction, to, c), 3 * self.config.complete_timeout)

    def signed(self, direction: str, out: m.Carry, received: m.Carry, to: str) -> m.Carry:
        """`out` with this node's signed hop record appended to the records that came with `received`
        (through boundary verifiers only; SENTINEL blames upstream workers along these signatures)."""
        if not self.verifiers:
            return out
        link = out.stage - 1 if direction == CHECK_FORWARD else out.stage
        hop = m.Hop.signed(self.transport.identity, out.key, out.it, direction, link, "",
                           m.tensor_digest(received.tensor), m.tensor_digest(out.tensor), to)
        return dataclasses.replace(out, hops=received.hops + (hop,))

    def seal(self, direction: str, key: m.Key, it: int, stage: int, tensor: torch.Tensor) -> m.Seal | None:
        """This node's signature on a tensor it sends (only when stage gradients are validated)."""
        return m.Seal.make(self.transport.identity, key, it, direction, stage, tensor) if self.sealing else None

    def check_seal(self, direction: str, c: m.Carry, sender: str) -> None:
        """A carry must come sealed by its sender (or by the verifier hop or data node that delivered it
        in its place): the receiving replica commits to it, and an unsealed input would make an honest
        replica's stage gradient look forged. Evidence against the sender otherwise."""
        if c.seal is None or not c.seal.valid(c.key, c.it, direction, c.stage, c.tensor) or (
                c.seal.signer not in self.sealers(direction, c, sender)):
            raise RemoteError(Evidence(sender, "bad_seal", f"{direction} of {m.key_name(c.key)} without its sender's seal", c.it))

    def sealers(self, direction: str, c: m.Carry, sender: str) -> set[str]:
        """Who may seal a carry that `sender` sent over its link: the sender, the link's verifier, the
        microbatch's data node when it routes for relays."""
        link = c.stage - 1 if direction == CHECK_FORWARD else c.stage
        allowed = {sender}
        if link in self.verifiers:
            allowed.add(self.verifiers[link])
        if self.client_routed:
            allowed.add(c.key[0])
        return allowed

    def tamper(self, kind: str, it: int, key: m.Key, tensor: torch.Tensor) -> torch.Tensor:
        """What this node sends for an outgoing activation or input gradient; honest nodes send it as it is."""
        return tensor

    def _on_ban(self, sender: str, payload: bytes) -> None:
        """A verifier banned a relay: route around it and leave it out of aggregation groups."""
        peer, it, keys = parse_ban(payload, sender, self.transport)
        trusted = sender in self.verifiers.values() or self.client_routed and self.directory.get(sender) == 0
        if not trusted and self.directory.get(sender, 0) > 0:
            raise RemoteError(Evidence(sender, "false_stage", "a relay sent a verifier's ban", it))
        if not trusted or peer == self.me or self.directory.get(peer) == 0:
            return
        self.sentinel_ban(peer, it, keys)

    def sentinel_ban(self, peer: str, it: int, keys: list[m.Key]) -> None:
        """Apply a verifier's ban of `peer` (again: a no-op) and drop the listed microbatches, which
        their data nodes restart around it; data nodes also reroute them."""
        for key in keys:  # free the slots
            self.held.pop(key, None)
            self.pending.pop(key, None)
            self.rerouted.add(key)
        if peer in self.banned:
            return
        self.banned.add(peer)
        if self.flow is not None:
            self.spawn(self.flow.send(self.flow.lost(peer)))

    async def _request(self, peer: str, topic: str, payload: bytes, timeout: float) -> bytes:
        """A request that gives up as soon as `peer` leaves the membership view (PeerUnreachable),
        instead of waiting out the whole timeout on a peer that is gone."""
        task = asyncio.ensure_future(self.transport.request(peer, topic, payload, timeout))
        poll = self.config.complete_timeout / 10
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll)
                if done:
                    return task.result()
                if peer not in self.transport.members():
                    raise PeerUnreachable(peer, "left the membership view while we waited")
        finally:
            if not task.done():
                task.cancel()

    async def _ask(self, peer: str, topic: str, payload: bytes, timeout: float | None = None) -> str | None:
        """Send a request and return the answer word; None when the peer timed out, failed or was unreachable."""
        try:
            response = await self._request(peer, topic, payload, timeout or self.config.complete_timeout)
            return m.parse_answer(response, peer, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
        except PeerTimeout:
            await self.suspect(peer)
        except PeerUnreachable:
            await self.suspect(peer)
        except PhalanxError as exc:
            log.debug("%s to %s failed: %s", topic, peer[:8], exc)
        return None

    async def suspect(self, peer: str) -> None:
        """`peer` did not answer: leave it out of this iteration's aggregation (data nodes decide groups)."""
        if peer in self.suspects:
            return
        self.suspects.add(peer)
        if self.flow is not None:
            await self.flow.send(self.flow.lost(peer))
        if self.stage > 0:
            for node in self.data_nodes():
                await self.transport.send(node, m.SUSPECT, encode({"peer": peer, "evidence": False}))

    async def give_up(self, key: m.Key) -> None:
        """No next-stage peer takes this microbatch: tell upstream (DENY) and free the slot."""
        h = self.release(key)
        if h is not None:
            await self.transport.send(h.carry.path[-1], m.DENY, encode({"src": key[0], "seq": key[1], "att": key[2]}))

    def _on_deny(self, sender: str, payload: bytes) -> None:
        key = m.parse_key(m.parse_mapping(payload, sender, self.transport.limits, "deny"), sender)
        h = self.held.get(key)
        if h is None or h.next_peer != sender:
            return  # about a microbatch we no longer route through that peer
        h.next_peer = None
        h.excluded.add(sender)
        self.router.failed(sender)
        self.spawn(self.send_forward(key))

    async def take_output(self, sender: str, c: m.Carry) -> bytes:
        """Data nodes only: the last stage's output comes home for the loss."""
        raise RemoteError(Evidence(sender, "false_stage", "sent a last-stage output to a relay", c.it))

    # --- backward -------------------------------------------------------------

    async def _on_backward(self, sender: str, payload: bytes) -> bytes:
        self.check_next_peers()
        c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
        if c.stage != self.stage or len(c.path) != self.last + 1 or c.path[self.stage] != self.me:
            raise RemoteError(Evidence(sender, "unknown_microbatch", "backward for a stage or path I do not serve", c.it))
        expected = c.path[self.stage + 1] if self.stage < self.last else c.path[0]
        if sender != expected and not self.relayed_by(sender, c):
            raise RemoteError(Evidence(sender, "false_stage", "backward sender is not the next node of the path", c.it))
        sender = expected  # through a verifier hop: the peer it verified for
        h = self.held.get(c.key)
        if h is None or h.x is None and self.stage > 0 or c.path[: self.stage] != h.carry.path:
            if c.it < self.version or c.key in self.rerouted:
                return m.answer(m.STALE)
            raise RemoteError(Evidence(sender, "unknown_microbatch", f"never held {m.key_name(c.key)}", c.it))
        check_tensor(c.tensor, sender, shape=tuple(h.out.shape), dtype=torch.float32, step=c.it)
        if self.sealing and self.stage > 0:
            self.check_seal(CHECK_BACKWARD, c, sender)
        grad_out = await self.inbound(CHECK_BACKWARD, c)
        if grad_out is None:
            return m.answer(m.STALE)  # a verifying data node refused it: the attempt is being rerouted
        del self.held[c.key]  # a second backward for it (a resend) finds nothing to do
        t0 = self.now()
        async with self.compute_lock:
            if c.it != self.version:
                return m.answer(m.STALE)  # aggregation stepped the weights while this waited
            inputs = ([h.x] if h.x is not None else []) + self.params
            grads = torch.autograd.grad(h.out, inputs, grad_out, allow_unused=True)
            await self._compute(2 * self.staged.forward_flops[self.stage])
        gx = grads[0] if h.x is not None else None
        self.grads[c.key] = flat(list(grads[len(grads) - len(self.params):]), self.params)
        if self.sealing and self.stage > 0:
            self.received[c.key] = (h.carry, c)
        self._emit("bwd", c.key, c.it, t0)
        recomputed = tuple(sorted(set(c.recomputed) | set(h.recomputed)))
        if self.stage == 0:
            self.finished(c.key, m.Carry(c.key, c.it, 0, c.path, c.tensor, recomputed=recomputed))
        else:
            sent = self.tamper(GRADIENT, c.it, c.key, gx.detach())
            back = m.Carry(c.key, c.it, self.stage - 1, c.path, sent, recomputed=recomputed,
                           seal=self.seal(CHECK_BACKWARD, c.key, c.it, self.stage - 1, sent))
            back = self.signed(CHECK_BACKWARD, back, c, c.path[self.stage - 1])
            self.spawn(self.send_backward(back))
        return m.answer(m.OK)

    async def send_backward(self, carry: m.Carry) -> None:
        """Send an input gradient to the node serving carry.stage; on failure keep it and report BROKEN."""
        target = carry.path[carry.stage]
        word = await self.deliver(target, CHECK_BACKWARD, carry)
        if word in (m.OK, m.STALE):
            return
        self.router.failed(target)
        self.pending[carry.key] = carry
        await self.report_broken(carry)

    async def report_broken(self, carry: m.Carry) -> None:
        body = {"src": carry.key[0], "seq": carry.key[1], "att": carry.key[2], "stage": carry.stage}
        await self.transport.send(carry.key[0], m.BROKEN, encode(body))

    def finished(self, key: m.Key, carry: m.Carry) -> None:
        """Data nodes only: a microbatch's backward reached stage 0."""

    async def inbound(self, direction: str, c: m.Carry) -> torch.Tensor | None:
        """The tensor a node works on for a carry that came to it directly (a verifying data node
        judges it here; None: refused); relays take it as it is."""
        return c.tensor

    # --- repair (GWTF V-D, backward crash) --------------------------------------

    async def _on_ping(self, sender: str, payload: bytes) -> bytes:
        key = m.parse_key(m.parse_mapping(payload, sender, self.transport.limits, "ping"), sender)
        return m.answer(m.OK if key in self.held else m.UNKNOWN)

    async def _on_reforward(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "reforward")
        key = m.parse_key(obj, sender)
        upto, holder = obj.get("upto"), obj.get("holder")
        if sender != key[0] or type(upto) is not int or not self.stage < upto <= self.last or not isinstance(holder, str):
            raise RemoteError(Evidence(sender, "malformed", "bad reforward request"))
        return m.answer(m.OK if self.reforward(key, upto, holder) else m.UNKNOWN)

    def reforward(self, key: m.Key, upto: int, holder: str) -> bool:
        """Resend my stored output to a new peer of the next stage, which recomputes up to `upto`."""
        h = self.held.get(key)
        if h is None:
            return False
        dead = h.next_peer
        c = h.carry
        h.carry = dataclasses.replace(c, repair=upto, holder=holder)
        if dead is not None:
            h.excluded.add(dead)
        h.next_peer = None
        self.spawn(self.send_forward(key))
        return True

    async def _resume(self, key: m.Key) -> None:
        """I rebuilt the last broken stage: ask the holder to send its stored gradient to me."""
        h = self.held[key]
        body = {"src": key[0], "seq": key[1], "att": key[2], "path": [*h.carry.path, self.me], "rec": list(h.recomputed)}
        if h.carry.holder == self.me:
            return
        word = await self._ask(h.carry.holder, m.RESUME, encode(body))
        if word != m.OK:
            log.debug("resume of %s at %s failed", m.key_name(key), h.carry.holder[:8])

    async def _on_resume(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "resume")
        key = m.parse_key(obj, sender)
        prefix, rec = obj.get("path"), obj.get("rec")
        carry = self.pending.get(key)
        if carry is None:
            return m.answer(m.UNKNOWN)
        ok = (
            isinstance(prefix, list) and len(prefix) == carry.stage + 1 and all(isinstance(p, str) for p in prefix)
            and prefix[-1] == sender and prefix[0] == key[0]
            and isinstance(rec, list) and all(type(s) is int for s in rec)
        )
        if not ok:
            raise RemoteError(Evidence(sender, "malformed", "bad resume request"))
        if self.directory.get(sender, carry.stage) != carry.stage:
            return m.answer(m.UNKNOWN)  # our views of its stage differ (a move not yet seen here): not evidence
        del self.pending[key]
        path = tuple(prefix) + carry.path[carry.stage + 1:]
        recomputed = tuple(sorted(set(carry.recomputed) | set(rec)))
        self.spawn(self.send_backward(dataclasses.replace(carry, path=path, recomputed=recomputed)))
        return m.answer(m.OK)

    # --- aggregation (GWTF V-E) ---------------------------------------------------

    def _on_begin(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "begin aggregation")
        it, done, groups = obj.get("it"), obj.get("done"), obj.get("groups")
        valid = (
            type(it) is int and isinstance(done, list) and isinstance(groups, list) and len(groups) == self.last + 1
            and all(isinstance(g, list) and all(isinstance(p, str) for p in g) for g in groups)
            and all(isinstance(d, list) and len(d) == 4 and isinstance(d[3], list) for d in done)
        )
        if not valid:
            raise RemoteError(Evidence(sender, "malformed", "bad BEGIN AGGREGATION"))
        if it < self.version or it in self._begun or not self.entered:
            return
        self._begun.add(it)
        self.spawn(self.aggregate(it, payload, done, groups))

    async def aggregate(self, it: int, payload: bytes, done: list, groups: list[list[str]]) -> None:
        """Flood BEGIN on, all-reduce this stage's gradients of the finished microbatches, step, pass CAN TAKE back."""
        if it - 1 in self._begun:  # the previous aggregation is still running here: let it finish first
            await self.wait_version(it, self.config.aggregation_timeout)
        if self.flow is not None:
            self.flow.pause(False)  # between iterations the flow may optimise again
        if self.stage >= 1 and self.stage < self.last:
            for peer in self.live(self.stage + 1):
                await self.transport.send(peer, m.BEGIN, payload)
        t0 = self.now()
        self.groups = groups
        group = sorted(groups[self.stage])
        finished = {(d[0], d[1], d[2]): d[3] for d in done}
        self.finished_paths = finished
        total = torch.zeros(num_params(self.part))
        count = 0
        for key, grad in self.grads.items():
            path = finished.get(key)
            if path is not None and len(path) > self.stage and path[self.stage] == self.me:
                total += grad
                count += 1
        version = it + 1
        missing, norm = 0, 0.0  # norm: of the reduced vector this replica stepped with
        behind = self.version != it  # missed an aggregation (cut off, or a joiner): holds no gradients of `it`
        work = sum(1 for path in finished.values() if len(path) > self.stage and path[self.stage] in group)
        if self.me in group:
            # A behind replica (and one that served nothing) still takes its part with zeros, so that
            # the group neither waits out a timeout on it nor loses its slice; a behind one then downloads.
            vector = torch.zeros_like(total) if behind else contribution(total, work, len(group))
            vector = self.contribute(it, vector)
            result = await self.allreduce(it, vector, group)
            missing = len(result.missing_parts)
            if work > 0 and not behind and self.version == it:
                norm = float(result.vector.norm())
                offset = 0
                for p in self.params:
                    p.grad = result.vector[offset: offset + p.numel()].view_as(p).to(p.device).clone()
                    offset += p.numel()
                async with self.compute_lock:  # no forward or backward runs across a step
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
        fetched = behind or self.me not in group
        if self.version > it:
            # Caught up meanwhile (this all-reduce waited out a member that died, and a forward for a later
            # iteration found this replica behind): this result is stale. Applying it put the version back
            # (5 -> 2 over hivemind), so the stage's only replica refused every joiner for 70 s.
            self.on_event({"kind": "aggregate", "peer": self.me, "stage": self.stage, "it": it, "t0": t0,
                           "t1": self.now(), "group": len(group), "count": count, "in_group": self.me in group,
                           "version": self.version, "fetched": False, "missing": missing, "norm": 0.0, "stale": True})
            self.aggregated_event(it).set()
            return
        if fetched:
            # Left out (suspected) or behind: take the stepped weights from the group; failing that,
            # catch up in the background from any stage peer (serving nothing until then).
            version = await self.fetch_weights(it + 1, [p for p in group if p != self.me]) or self.version
            if version < it + 1:
                self.spawn(self.catch_up(it + 1))
        self.on_event({"kind": "aggregate", "peer": self.me, "stage": self.stage, "it": it, "t0": t0, "t1": self.now(),
                       "group": len(group), "count": count, "in_group": self.me in group, "version": version,
                       "fetched": fetched, "missing": missing, "norm": norm})
        self.version = version
        self.last_served, self.served = self.served, 0
        self.held.clear()
        self.slots.clear()
        self.refused.clear()
        self.sent_to.clear()
        self.grads.clear()
        self.received.clear()
        self.pending.clear()
        self.suspects.clear()
        self.rerouted.clear()
        self.ready_event(version).set()
        if self.stage < self.last:
            try:
                await asyncio.wait_for(self.can_take_event(it).wait(), self.config.aggregation_timeout)
            except asyncio.TimeoutError:
                log.info("%s: no CAN TAKE from stage %d for iteration %d", self.me[:8], self.stage + 1, it)
        if self.stage > 0:
            upstream = groups[self.stage - 1] if self.stage > 1 else self.data_nodes()
            for peer in upstream:
                if peer != self.me:
                    await self.transport.send(peer, m.CAN_TAKE, encode(it))
        self.aggregated_event(it).set()

    def contribute(self, it: int, vector: torch.Tensor) -> torch.Tensor:
        """What this replica sends as its part of the stage all-reduce (an honest replica: its contribution)."""
        return vector

    def aggregated_event(self, it: int) -> asyncio.Event:
        return self._aggregated.setdefault(it, asyncio.Event())

    def can_take_event(self, it: int) -> asyncio.Event:
        return self._can_take.setdefault(it, asyncio.Event())

    def _on_can_take(self, sender: str, payload: bytes) -> None:
        it = decode(payload, sender, self.transport.limits)
        if type(it) is not int:
            raise RemoteError(Evidence(sender, "malformed", "CAN TAKE without an iteration"))
        if self.directory.get(sender) == self.stage + 1:
            self.can_take_event(it).set()

    # --- weights (joiners, and replicas left out of an aggregation) ---------------------

    def state_digest(self) -> bytes:
        return digest(b"".join(p.detach().cpu().numpy().tobytes() for p in self.params))

    async def _on_weights(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "weights request")
        version, full = obj.get("version"), obj.get("full")
        stage, wait = obj.get("stage", self.stage), obj.get("wait", True)
        if type(version) is not int or not isinstance(full, bool) or type(stage) is not int or not isinstance(wait, bool):
            raise RemoteError(Evidence(sender, "malformed", "bad weights request"))
        if stage != self.stage or not self.entered:
            return encode({"version": -1})  # not (or not yet) a replica of that stage: not evidence
        if version > self.version and wait:
            await self.wait_version(version, self.config.aggregation_timeout)
        if version > self.version or full and not self.ready_event(self.version).is_set():
            return encode({"version": self.version})
        version = self.version  # a newer version is as good: the asker takes the latest stepped weights
        body: dict = {"version": version, "digest": self.state_digest()}
        if full:
            body["params"] = [p.detach() for p in self.params]
            state = self.optimizer.state_dict()["state"]
            body["state"] = {str(i): dict(v) for i, v in state.items()}
        return encode(body)

    async def catch_up(self, version: int, unstepped: bool = True) -> None:
        """A replica behind after an aggregation: fetch `version` (or later) from any live stage peer,
        digest confirmed, retrying until it has; it serves nothing until then. When no live stage peer
        reaches `version` within the aggregation timeout, the stepped weights died with the group that
        made them: the replicas left keep their weights and take the version unstepped (all of them
        alike, so they still agree)."""
        started = self.now()
        while self.version < version and not self._stopped.is_set():
            peers = self.live(self.stage)
            versions = [await self._version_of(p) for p in peers]
            ahead = [p for p, v in sorted(zip(peers, versions), key=lambda pv: -pv[1]) if v >= version]
            got = await self.fetch_weights(version, ahead) if ahead else None
            if self.version >= version:
                return  # an aggregation caught us up meanwhile
            if got is not None:
                self.adopt(got, "catch_up")
                return
            if not ahead and all(v < 0 for v in versions):  # no live stage peer: nothing newer exists anywhere
                self.adopt(version, "unstepped")
                return
            if not ahead and not unstepped:
                return
            if not ahead and self.now() - started >= self.config.aggregation_timeout and all(
                    v <= self.version for v in versions):
                self.adopt(version, "unstepped")
                return
            await asyncio.sleep(self.config.complete_timeout / 5)

    def _caught_up(self, task: asyncio.Task) -> None:
        self._catching_up = False

    def adopt(self, version: int, how: str) -> None:
        """Serve from `version` on (after a catch-up)."""
        self.on_event({"kind": "catch_up", "peer": self.me, "stage": self.stage, "it": version - 1, "t0": self.now(),
                       "t1": self.now(), "version": version, "how": how})
        self.version = version
        self.ready_event(version).set()

    async def _version_of(self, peer: str) -> int:
        """A stage peer's current version, asked without waiting (-1: no answer)."""
        try:
            response = await self.transport.request(
                peer, m.WEIGHTS, encode({"version": 0, "full": False, "stage": self.stage, "wait": False}),
                self.config.complete_timeout)
            body = decode(response, peer, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
            return -1
        except PhalanxError:
            return -1
        return body["version"] if isinstance(body, dict) and type(body.get("version")) is int else -1

    async def fetch_weights(self, version: int, sources: list[str]) -> int | None:
        """Download this stage's parameters and optimizer state at `version` or later from one source,
        with the digest confirmed by a second source when there is one; the version got, or None."""
        for index, source in enumerate(sources):
            body = await self._weights_from(source, version, True)
            if body is None:
                continue
            got_version = body["version"]
            try:
                params, state = self._check_weights(source, body)
            except RemoteError as exc:
                self.transport.report(exc.evidence)
                continue
            got = digest(b"".join(p.numpy().tobytes() for p in params))
            if got != body["digest"]:
                self.transport.report(Evidence(source, "bad_digest", "weights do not match their digest"))
                continue
            others = [p for p in sources if p != source]
            confirmations = [await self._weights_from(p, got_version, False) for p in others[:1]]
            if any(c is not None and (c["version"], c["digest"]) != (got_version, got) for c in confirmations):
                continue  # two stage peers disagree: try the next source
            with torch.no_grad():
                for p, value in zip(self.params, params):
                    p.copy_(value)
            sd = self.optimizer.state_dict()
            sd["state"] = state
            self.optimizer.load_state_dict(sd)
            return got_version
        log.info("%s: could not fetch stage %d weights at version %d", self.me[:8], self.stage, version)
        return None

    async def _weights_from(self, source: str, version: int, full: bool) -> dict | None:
        try:
            response = await self.transport.request(
                source, m.WEIGHTS, encode({"version": version, "full": full, "stage": self.stage}),
                self.config.aggregation_timeout)
            body = decode(response, source, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
            return None
        except PhalanxError:
            return None
        if not isinstance(body, dict) or type(body.get("version")) is not int or body["version"] < version:
            return None
        if not isinstance(body.get("digest"), bytes):
            return None
        return body

    def _check_weights(self, source: str, body: dict) -> tuple[list[torch.Tensor], dict]:
        params, state = body.get("params"), body.get("state")
        if not isinstance(params, list) or len(params) != len(self.params) or not isinstance(state, dict):
            raise RemoteError(Evidence(source, "malformed", "weights answer without parameters and state"))
        checked = [check_tensor(t, source, shape=tuple(p.shape), dtype=p.dtype) for t, p in zip(params, self.params)]
        loaded: dict[int, dict] = {}
        for name, entry in state.items():
            if not (name.isdigit() and int(name) < len(self.params) and isinstance(entry, dict)):
                raise RemoteError(Evidence(source, "malformed", "optimizer state for an unknown parameter"))
            shape = tuple(self.params[int(name)].shape)
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    check_tensor(value, source, shape=shape, dtype=torch.float32)
                elif not isinstance(value, (int, float, torch.Tensor)):
                    raise RemoteError(Evidence(source, "malformed", f"optimizer state {key!r} is not a number"))
            loaded[int(name)] = entry
        return checked, loaded

    # --- joining (GWTF V-B) ------------------------------------------------------------

    async def enter(self, version: int, attempts: int = 5) -> bool:
        """A joiner: download this stage's weights at `version` or later (digest confirmed by a second
        peer), then tell every member that it serves the stage from the next iteration on. Until then it
        takes no microbatch and no part in aggregation. False if no stage peer delivered in `attempts` tries."""
        self.entered = False
        got = None
        for _ in range(attempts):
            got = await self.fetch_weights(version, self.live(self.stage))
            if got is not None:
                break
            await asyncio.sleep(self.config.complete_timeout / 5)
        if got is None:
            return False
        self.version = got
        self.serving_from = got + 1  # the iteration under way started without us: serve from the next
        self.entered = True
        self.ready_event(got).set()
        self.announce()
        return True

    def announce(self) -> None:
        """HELLO to every member: my stage, from which iteration, under a fresh membership sequence number."""
        seq = int(self.now() * 1000)
        hello = encode({"stage": self.stage, "version": self.version, "since": self.serving_from,
                        "capacity": self.capacity, "seq": seq})
        for peer in self.transport.members():
            if peer != self.me:
                self.spawn(self.transport.send(peer, m.HELLO, hello))

    def _on_hello(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "hello")
        stage = obj.get("stage")
        if type(stage) is not int or not 1 <= stage <= self.last:
            raise RemoteError(Evidence(sender, "false_stage", f"claims relay stage {stage!r}"))
        if self.directory.get(sender) == 0:
            raise RemoteError(Evidence(sender, "false_stage", "a data node claims a relay stage"))
        seq = obj.get("seq", 0)
        if type(seq) is not int:
            raise RemoteError(Evidence(sender, "malformed", "hello with a bad sequence number"))
        if seq < self.membership.get(sender, -1):
            return  # an older announcement than one already applied
        since = obj.get("since", 0)
        if type(since) is not int:
            raise RemoteError(Evidence(sender, "malformed", "hello with a bad first iteration"))
        self.membership[sender] = seq
        self.directory[sender] = stage
        self.since[sender] = since
