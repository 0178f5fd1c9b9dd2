"""The deterministic simulator: every peer in one process, one event loop, virtual time.

Virtual time (`virtual_time.py`): `run_simulation(main)` runs one simulation on a `VirtualTimeLoop`,
an asyncio loop whose clock jumps to the next timer; a loop that can never wake raises `SimulationDeadlock`.

Network. `SimNetwork` holds the peers (one `SimTransport` each) and the links.
A message weighs `len(payload) + len(topic) + HEADER_BYTES` bytes (the header
stands for framing, addressing and the stream's crypto overhead). On the
directed link a->b it starts when the link is free, occupies it for
size / bandwidth seconds and arrives `latency` after that, so each link is a
FIFO queue as long as its profile is unchanged. Each message is dropped with
probability `loss`, drawn when it is sent from a stream seeded by the config
seed. A message is silently dropped, as on a real network, when its
destination is crashed or partitioned away when it is sent or when it arrives,
or when either end crashed while it was in flight; a requester sees a timeout.

Ownership. A peer owns every task it runs: its spawned mains, its request
handlers, and any task those create (ownership travels in a context variable).
`crash` cancels them all; `restart` starts the peer as a fresh process with the
same identity: handlers and broadcast board are cleared (evidence and its
listeners are kept, they are the run's record) and the spawned mains run again.
A crashed peer's `send` does nothing (it is best effort); its `request` raises
`PeerUnreachable` naming itself.

Failures. An exception escaping a spawned main or a request handler, or a
message handler raising anything but `RemoteError`, is a bug, not a network
event: the simulation stops and `run_simulation` raises that exception.

Determinism. No wall clock, no iteration over sets, no ordering by `id()` or
by hashes: peers are visited in sorted id order, tasks in creation order, and
timers by virtual time. The same seed and program give the same run, bit for bit.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..core.errors import (
    ConfigError,
    LocalError,
    PeerTimeout,
    PeerUnreachable,
    RequestFailed,
)
from ..core.identity import Identity
from ..core.rng import py_stream
from ..core.serialization import DEFAULT_LIMITS, Limits
from .base import Transport
from .virtual_time import (
    TASK_OWNER,
    SimulationDeadlock,
    VirtualTimeLoop,
    await_factory,
    run_simulation,
)

__all__ = [
    "HEADER_BYTES", "LinkProfile", "SimConfig", "SimNetwork", "SimTransport", "SimulationDeadlock", "TraceEntry",
    "VirtualTimeLoop", "run_simulation",
]  # the simulator's API: the network and its transports, and the virtual-time loop they run on

log = logging.getLogger(__name__)

T = TypeVar("T")

HEADER_BYTES = 64
"""Fixed per-message overhead added to len(payload) + len(topic)."""

TraceEntry = tuple[float, str, str, str, int]
"""(arrival time, sender, receiver, topic, size in bytes) of a delivered message."""


# --- configuration -----------------------------------------------------------


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link: `latency` in seconds, `bandwidth` in bytes per second."""

    latency: float = 0.005
    bandwidth: float = 125e6

    def __post_init__(self) -> None:
        if not (_finite(self.latency) and self.latency >= 0):
            raise ConfigError(f"LinkProfile.latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if not (_finite(self.bandwidth) and self.bandwidth > 0):
            raise ConfigError(
                f"LinkProfile.bandwidth must be a finite number of bytes per second > 0, got {self.bandwidth!r}"
            )


@dataclass(frozen=True)
class SimConfig:
    """The simulated network: default link, loss rate, crash detection delay, default compute speed."""

    seed: int = 0
    link: LinkProfile = field(default_factory=LinkProfile)
    loss: float = 0.0
    detection_delay: float = 2.0
    default_flops: float = 50e9

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"SimConfig.seed must be an int, got {self.seed!r}")
        if not isinstance(self.link, LinkProfile):
            raise ConfigError(f"SimConfig.link must be a LinkProfile, got {type(self.link).__name__}")
        if not (_finite(self.loss) and 0 <= self.loss <= 1):
            raise ConfigError(f"SimConfig.loss must be a probability in [0, 1], got {self.loss!r}")
        if not (_finite(self.detection_delay) and self.detection_delay >= 0):
            raise ConfigError(
                f"SimConfig.detection_delay must be a finite number of seconds >= 0, got {self.detection_delay!r}"
            )
        if not (_finite(self.default_flops) and self.default_flops > 0):
            raise ConfigError(f"SimConfig.default_flops must be a finite FLOP/s rate > 0, got {self.default_flops!r}")


# --- network -----------------------------------------------------------------


class _Link:
    """A directed link's profile and the virtual time its queue drains."""

    __slots__ = ("latency", "bandwidth", "free_at")

    def __init__(self, profile: LinkProfile) -> None:
        self.latency = profile.latency
        self.bandwidth = profile.bandwidth
        self.free_at = 0.0


class _Peer:
    """The network's record of one peer: liveness, owned tasks, outgoing links, counters."""

    __slots__ = (
        "id",
        "transport",
        "flops",
        "alive",
        "epoch",
        "crashed_at",
        "context",
        "mains",
        "tasks",
        "links",
        "messages_sent",
        "bytes_sent",
        "messages_received",
        "bytes_received",
        "restarts",
    )

    def __init__(self, transport: SimTransport, flops: float) -> None:
        self.id = transport.peer_id
        self.transport = transport
        self.flops = flops
        self.alive = True
        self.epoch = 0  # bumped by each crash; a message in flight across a crash is dropped
        self.crashed_at: float | None = None
        self.context = contextvars.Context()  # arrivals run here; tasks copy it and so belong to this peer
        self.context.run(TASK_OWNER.set, self)
        self.mains: list[Callable[[], Awaitable[object]]] = []
        self.tasks: dict[asyncio.Task, None] = {}
        self.links: dict[str, _Link] = {}
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bytes_received = 0
        self.restarts = 0

    def adopt(self, task: asyncio.Task) -> None:
        self.tasks[task] = None
        task.add_done_callback(self._release)

    def _release(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)

    def stats(self) -> dict[str, object]:
        return {
            "alive": self.alive,
            "restarts": self.restarts,
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "messages_received": self.messages_received,
            "bytes_received": self.bytes_received,
        }



class SimNetwork:
    """Simulated peers and the links between them, with loss, partitions, crashes and restarts.

    Build it and add peers anywhere; everything that touches time (sending,
    spawning, crashing, `members`) must run inside `run_simulation`.
    """

    def __init__(self, config: SimConfig | None = None, *, record_trace: bool = False) -> None:
        self.config = config if config is not None else SimConfig()
        if not isinstance(self.config, SimConfig):
            raise ConfigError(f"SimNetwork takes a SimConfig, got {type(self.config).__name__}")
        self.trace: list[TraceEntry] | None = [] if record_trace else None
        self._peers: dict[str, _Peer] = {}
        self._ids: list[str] = []  # sorted
        self._groups: dict[str, int] | None = None  # partition: peer id -> group; unlisted peers are group -1
        self._loss = float(self.config.loss)
        self._rng = py_stream(self.config.seed, "sim", "loss")
        self._lost = 0
        self._dropped = 0
        self._loop: VirtualTimeLoop | None = None

    # --- membership and topology ---------------------------------------------

    def add_peer(self, identity: Identity, flops: float | None = None, limits: Limits = DEFAULT_LIMITS) -> SimTransport:
        """Add a live peer computing at `flops` FLOP/s (default: config.default_flops); return its transport."""
        if identity.peer_id in self._peers:
            raise LocalError(f"peer {identity.peer_id[:8]} is already in this network")
        speed = self.config.default_flops if flops is None else flops
        if not (_finite(speed) and speed > 0):
            raise ConfigError(f"flops of peer {identity.peer_id[:8]} must be a finite FLOP/s rate > 0, got {speed!r}")
        transport = SimTransport(self, identity, speed, limits)
        self._peers[transport.peer_id] = transport._peer
        bisect.insort(self._ids, transport.peer_id)
        return transport

    @property
    def peers(self) -> list[str]:
        """Every peer id ever added, sorted (crashed ones included)."""
        return list(self._ids)

    def set_link(self, src: str, dst: str, link: LinkProfile, *, both_ways: bool = False) -> None:
        """Give the link src->dst (and dst->src if `both_ways`) a profile; messages already queued keep theirs."""
        if not isinstance(link, LinkProfile):
            raise ConfigError(f"set_link takes a LinkProfile, got {type(link).__name__}")
        pairs = [(src, dst), (dst, src)] if both_ways else [(src, dst)]
        for a, b in pairs:
            self._peer(b)
            links = self._peer(a).links
            if b in links:
                links[b].latency, links[b].bandwidth = link.latency, link.bandwidth
            else:
                links[b] = _Link(link)

    def partition(self, groups: list[list[str]]) -> None:
        """Cut the network into `groups`; peers listed in none (and peers added later) form one more group."""
        assignment: dict[str, int] = {}
        for index, group in enumerate(groups):
            for peer in group:
                self._peer(peer)
                if peer in assignment:
                    raise LocalError(f"peer {peer[:8]} is listed in two partition groups")
                assignment[peer] = index
        self._groups = assignment

    def heal(self) -> None:
        """Remove the partition: every peer reaches every other again."""
        self._groups = None

    # --- faults and peer lifecycles -------------------------------------------

    def spawn(self, peer: str, main: Callable[[], Awaitable[object]]) -> asyncio.Task:
        """Run `main()` as a task owned by `peer`; a restart calls `main()` again."""
        state = self._peer(peer)
        if not state.alive:
            raise LocalError(f"peer {peer[:8]} is crashed: restart() it before spawning on it")
        state.mains.append(main)
        return self._start(state, main)

    def crash(self, peer: str) -> None:
        """Kill `peer` now: cancel its tasks and drop every message to or from it until it restarts."""
        state = self._peer(peer)
        if not state.alive:
            raise LocalError(f"peer {peer[:8]} is already crashed")
        now = self._running_loop().time()
        state.alive = False
        state.crashed_at = now
        state.epoch += 1
        for link in state.links.values():
            link.free_at = min(link.free_at, now)  # its send queue died with it
        self._cancel(list(state.tasks))

    def _cancel(self, tasks: list[asyncio.Task]) -> None:
        """Cancel a crashed peer's tasks, again on each loop turn until they are done.

        Python 3.11's `asyncio.wait_for` returns the awaited result and drops
        the cancellation when both land in the same turn, so one `cancel()`
        could leave a crashed peer training on.
        """
        running = [task for task in tasks if not task.done()]
        for task in running:
            task.cancel()
        if running:
            self._running_loop().call_soon(self._cancel, running)

    def restart(self, peer: str) -> None:
        """Bring a crashed peer back as a fresh process: state cleared, spawned mains run again."""
        state = self._peer(peer)
        if state.alive:
            raise LocalError(f"peer {peer[:8]} is alive: only a crashed peer can restart")
        state.alive = True
        state.crashed_at = None
        state.restarts += 1
        state.transport.reset_process_state()
        for main in state.mains:
            self._start(state, main)

    def schedule(self, at: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        """Call `callback()` at virtual time `at` (to inject faults); returns a cancellable handle."""
        loop = self._running_loop()
        if not _finite(at) or at < loop.time():
            raise LocalError(f"cannot schedule at {at!r}: it must be a finite time >= now ({loop.time()})")
        return loop.call_at(at, callback)

    # --- quiet points (checkpoints of a simulated run) ----------------------------

    def drained_at(self) -> float:
        """The virtual time at which the last message sent so far arrives (or would have, had it not been lost)."""
        return max((link.free_at + link.latency for p in self._peers.values() for link in p.links.values()), default=0.0)

    def pending_tasks(self) -> list[asyncio.Task]:
        """Every unfinished task some peer owns (mains, request handlers, what they started), in peer order."""
        return [task for pid in self._ids for task in self._peers[pid].tasks if not task.done()]

    def loss_state(self) -> object:
        """The state of the message-loss stream (to continue a run exactly)."""
        return self._rng.getstate()

    def set_loss_state(self, state: object) -> None:
        self._rng.setstate(state)

    # --- metrics ----------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Message and byte counters, in total and per peer (sorted by id); JSON-friendly."""
        peers = {pid: self._peers[pid].stats() for pid in self._ids}
        return {
            "messages_sent": sum(p.messages_sent for p in self._peers.values()),
            "messages_delivered": sum(p.messages_received for p in self._peers.values()),
            "messages_lost": self._lost,
            "messages_dropped": self._dropped,
            "bytes_sent": sum(p.bytes_sent for p in self._peers.values()),
            "bytes_delivered": sum(p.bytes_received for p in self._peers.values()),
            "peers": peers,
        }

    # --- what SimTransport calls ------------------------------------------------

    def _view(self, me: _Peer) -> list[str]:
        """Sorted ids `me` sees: itself, and reachable peers alive or crashed under detection_delay ago."""
        now = self._running_loop().time()
        delay = self.config.detection_delay
        view = []
        for pid in self._ids:
            peer = self._peers[pid]
            detected = not peer.alive and now - peer.crashed_at >= delay
            if peer is me or not (detected or self._separated(me.id, pid)):
                view.append(pid)
        return view

    def _transmit(
        self, src: _Peer, dst_id: str, topic: str, payload: bytes, arrive: Callable[..., None], *extra: object
    ) -> None:
        """Put one message on the link src->dst: queue, maybe lose, schedule `arrive` on the destination."""
        loop = self._running_loop()
        size = len(payload) + len(topic) + HEADER_BYTES
        src.messages_sent += 1
        src.bytes_sent += size
        dst = self._peers.get(dst_id)
        if dst is None or not dst.alive or self._separated(src.id, dst_id):
            self._dropped += 1
            return
        link = src.links.get(dst_id)
        if link is None:
            link = src.links[dst_id] = _Link(self.config.link)
        now = loop.time()
        start = link.free_at if link.free_at > now else now
        link.free_at = finish = start + size / link.bandwidth
        if self._loss and self._rng.random() < self._loss:
            self._lost += 1
            return
        arrival = finish + link.latency
        loop.call_at(arrival, arrive, src, dst, src.epoch, dst.epoch, topic, payload, size, *extra, context=dst.context)

    def _accept(self, src: _Peer, dst: _Peer, src_epoch: int, dst_epoch: int, topic: str, size: int) -> bool:
        """On arrival: deliverable unless an end crashed meanwhile or a partition now separates them."""
        if src.epoch != src_epoch or dst.epoch != dst_epoch or self._separated(src.id, dst.id):
            self._dropped += 1
            return False
        dst.messages_received += 1
        dst.bytes_received += size
        if self.trace is not None:
            self.trace.append((self._loop.time(), src.id, dst.id, topic, size))
        return True

    # The three arrival callbacks run on the destination's context (so tasks they start belong to it).

    def _arrive_message(
        self, src: _Peer, dst: _Peer, src_epoch: int, dst_epoch: int, topic: str, payload: bytes, size: int
    ) -> None:
        if self._accept(src, dst, src_epoch, dst_epoch, topic, size):
            dst.transport._deliver_message(src.id, topic, payload)

    def _arrive_request(
        self,
        src: _Peer,
        dst: _Peer,
        src_epoch: int,
        dst_epoch: int,
        topic: str,
        payload: bytes,
        size: int,
        reply: asyncio.Future,
    ) -> None:
        if self._accept(src, dst, src_epoch, dst_epoch, topic, size):
            task = self._loop.create_task(
                self._serve(src, dst, topic, payload, reply),
                name=f"peer {dst.id[:8]} serves {topic}",
                context=dst.context.copy(),
            )
            task.add_done_callback(self._root_done)

    def _arrive_response(
        self,
        src: _Peer,
        dst: _Peer,
        src_epoch: int,
        dst_epoch: int,
        topic: str,
        payload: bytes,
        size: int,
        reply: asyncio.Future,
        ok: bool,
    ) -> None:
        if self._accept(src, dst, src_epoch, dst_epoch, topic, size) and not reply.done():
            reply.set_result((ok, payload))

    async def _serve(self, requester: _Peer, server: _Peer, topic: str, payload: bytes, reply: asyncio.Future) -> None:
        ok, answer = await server.transport._serve_request(requester.id, topic, payload)
        if not isinstance(answer, bytes):
            what = type(answer).__name__
            raise LocalError(f"the request handler for {topic!r} returned {what}; a handler must return bytes")
        self._transmit(server, requester.id, topic, answer, self._arrive_response, reply, ok)

    # --- helpers ----------------------------------------------------------------

    def _start(self, state: _Peer, main: Callable[[], Awaitable[object]]) -> asyncio.Task:
        task = self._running_loop().create_task(
            await_factory(main), name=f"peer {state.id[:8]} main", context=state.context.copy()
        )
        task.add_done_callback(self._root_done)
        return task

    def _root_done(self, task: asyncio.Task) -> None:
        """A peer's main or request handler ended: an escaped exception is a bug that stops the run."""
        if not task.cancelled() and task.exception() is not None:
            self._loop.fail(task.exception())

    def _separated(self, a: str, b: str) -> bool:
        groups = self._groups
        return groups is not None and groups.get(a, -1) != groups.get(b, -1)

    def _peer(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            raise LocalError(f"peer {peer[:8]} is not in this network: add_peer() it first")
        return state

    def _running_loop(self) -> VirtualTimeLoop:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise LocalError("SimNetwork needs its running loop: call this from inside run_simulation(main)") from None
        if loop is not self._loop:
            if not isinstance(loop, VirtualTimeLoop):
                raise LocalError("SimNetwork runs only on a VirtualTimeLoop: start it with run_simulation(main)")
            if self._loop is not None:
                raise LocalError("this SimNetwork already ran on another event loop: build a new one per simulation")
            self._loop = loop
        return loop


# --- transport -----------------------------------------------------------------


def _expire(reply: asyncio.Future) -> None:
    if not reply.done():
        reply.set_result(None)  # a result, not an exception: nothing to leave unretrieved


class SimTransport(Transport):
    """One simulated peer's endpoint; made by `SimNetwork.add_peer`."""

    def __init__(self, network: SimNetwork, identity: Identity, flops: float, limits: Limits = DEFAULT_LIMITS) -> None:
        super().__init__(identity, limits)
        self._network = network
        self._peer = _Peer(self, flops)

    async def send(self, peer: str, topic: str, payload: bytes) -> None:
        """Best effort: lost, undeliverable, or sent while this peer is crashed, the message just vanishes."""
        if not isinstance(payload, bytes):
            raise LocalError(f"payload must be bytes, got {type(payload).__name__}: convert it with bytes(...)")
        if self._peer.alive:
            self._network._transmit(self._peer, peer, topic, payload, self._network._arrive_message)

    async def request(self, peer: str, topic: str, payload: bytes, timeout: float) -> bytes:
        network = self._network
        if peer not in network._peers:
            raise PeerUnreachable(peer, "no such peer in this simulated network")
        if not self._peer.alive:
            raise PeerUnreachable(self.peer_id, "this peer has crashed and cannot send")
        if not isinstance(payload, bytes):
            raise LocalError(f"payload must be bytes, got {type(payload).__name__}: convert it with bytes(...)")
        if not (_finite(timeout) and timeout > 0):
            raise LocalError(f"request timeout must be a finite number of seconds > 0, got {timeout!r}")
        loop = network._running_loop()
        reply: asyncio.Future = loop.create_future()
        network._transmit(self._peer, peer, topic, payload, network._arrive_request, reply)
        timer = loop.call_at(loop.time() + timeout, _expire, reply)
        try:
            answer = await reply
        finally:
            timer.cancel()
        if answer is None:
            raise PeerTimeout(peer, f"no answer to {topic!r} within {timeout} s")
        ok, data = answer
        if not ok:
            raise RequestFailed(peer, data.decode("utf-8", "replace"))
        return data

    def members(self) -> list[str]:
        return self._network._view(self._peer)

    async def charge_compute(self, flops: float) -> None:
        """Sleep flops / this peer's FLOP/s virtual seconds."""
        if not (_finite(flops) and flops >= 0):
            raise LocalError(f"charge_compute takes a finite FLOP count >= 0, got {flops!r}")
        await asyncio.sleep(flops / self._peer.flops)

    async def start(self) -> None:
        """Nothing to do: a simulated peer is reachable from the moment it is added."""

    async def stop(self) -> None:
        """Nothing to do: use SimNetwork.crash to take a peer down."""
