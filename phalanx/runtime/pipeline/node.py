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

`PipelineNode` holds the state every part shares and is made of one class per concept:
forward.py (the forward pass, `Held`), backward.py, links.py (verifier hops, seals, requests
that give up on a peer that leaves), repair.py (lost and broken microbatches), aggregation.py
(BEGIN, the stage all-reduce, CAN TAKE), weights.py (serving and fetching stage weights, catch-up),
membership.py (joining a stage, HELLO, bans on evidence and SENTINEL's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from ...algorithms.btard.attacks import ProtocolPolicy
from ...training.task import Task, num_params
from ...transport.base import Transport
from ..dp.peer import TrainConfig, make_optimizer
from ..rounds.btard import BTARDConfig
from ..rounds.butterfly import AllReduceConfig, ButterflyAllReduce, Reducer
from . import messages as m
from .aggregation import Aggregation
from .backward import Backward
from .config import PipelineConfig
from .forward import Forward, Held
from .gwtf import FlowDriver
from .links import Links
from .membership import Membership
from .repair import Repair
from .routing import Router
from .stage_btard import StageBanReports, StageRound
from .stages import StagedModel
from .verifier import BAN
from .weights import WeightTransfer

EventSink = Callable[[dict], None]


class PipelineNode(Forward, Backward, Links, Repair, Aggregation, WeightTransfer, Membership):
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
        off_path: bool = False,
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
        self.off_path = off_path and bool(self.verifiers)  # carries go straight to receivers, a copy to the verifier
        self._stopped = asyncio.Event()
        self.part = staged.parts[stage]
        self.params = list(self.part.parameters())
        self.optimizer = make_optimizer(train, self.params)
        self.groups: list[list[str]] = []  # the replica group of every stage, from the latest BEGIN
        secure = btard is not None and btard.enabled  # BTARD per relay stage (stage_btard.py); data nodes are trusted
        self.secure = secure
        # With validators every node signs the tensors it sends (a Seal), and relays keep what they received:
        # the inputs a stage gradient is recomputed from (issue 18 item 2).
        self.sealing = secure and btard.validators > 0
        self.received: dict[m.Key, tuple[m.Carry, m.Carry]] = {}  # key -> (forward carry, backward carry) it computed with
        self.finished_paths: dict[m.Key, list[str]] = {}  # the latest BEGIN's finished microbatches and their paths
        self.stage_bans = StageBanReports(self) if secure else None  # stage rounds' bans, applied on a stage majority
        self.stepped: dict[int, bytes] = {}  # version -> digest of the weights this replica stepped to (`agree_weights`)
        self._stepped_events: dict[int, asyncio.Event] = {}
        self._agreeing: dict[int, asyncio.Event] = {}  # version -> set once `agree_weights` is done with it
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
        self.delivered: dict[m.Key, m.Carry] = {}  # backward gradients this node delivered, until aggregation: a
        # repair resumes from one when its receiver left before passing its own gradient on
        self.resends: dict[m.Key, str] = {}  # kept gradients (pending or delivered) their data node repairs the stage
        # before me from, and the node that repair resends from (the first link of the chain a RESUME must prove)
        self.suspects: set[str] = set()
        self.banned: set[str] = set()  # peers we hold evidence against (or a relay told us it does)
        self.rerouted: set[m.Key] = set()  # microbatches dropped here (a verifier banned a peer on their path, a newer
        # attempt superseded them, no next peer took them): a late backward for one is STALE, not evidence
        self.backed: set[m.Key] = set()  # microbatches whose backward ran or runs here: a second one is STALE
        self.forwarded_to: dict[m.Key, set[str]] = {}  # key -> next-stage peers this node sent (or tried to send)
        # its output to, and the holder a repair resumes from: the only peers whose backward for it is accepted
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
        transport.add_request_handler(m.RESENDS, self._on_resends)
        transport.add_message_handler(m.DENY, self._on_deny)
        transport.add_message_handler(m.BEGIN, self._on_begin)
        transport.add_message_handler(m.CAN_TAKE, self._on_can_take)
        transport.add_request_handler(m.WEIGHTS, self._on_weights)
        if secure:
            transport.add_request_handler(m.STEPPED, self._on_stepped)
        transport.add_message_handler(m.HELLO, self._on_hello)
        transport.add_message_handler(BAN, self._on_ban)
        self.served = 0  # microbatches this node computed a forward for in this iteration
        self.last_served = 0

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

    def replicas(self, stage: int) -> list[str]:
        """Peers of `stage` in this node's directory and membership view, not banned, sorted: every holder of
        the stage's weights, including joiners that serve only from a later iteration (download sources)."""
        members = set(self.transport.members())
        return sorted(p for p, s in self.directory.items() if s == stage and p in members and p != self.me
                      and p not in self.banned)

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
