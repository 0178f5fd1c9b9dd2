"""Butterfly all-reduce over a transport (the data-parallel axis).

With a group of n peers, the flat vector is cut into n parts; peer j reduces
part j from everyone (scatter), then sends its result to everyone (gather).
Each peer moves O(d) bytes. Parts are pushed as one-way messages; a part that
has not arrived `pull_after` seconds into a phase is pulled with a request, so
lost messages are recovered and only silent peers are dropped from the step.

The reduction rule is pluggable: any function from a stack Tensor[k, m] to
Tensor[m] (mean here; robust aggregators from `phalanx.algorithms`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...algorithms.robust.reducers import REDUCERS, make_reducer
from ...core.errors import ConfigError, Evidence, PhalanxError, RemoteError
from ...core.serialization import check_tensor, decode, encode
from ...transport.base import Transport

log = logging.getLogger(__name__)

Reducer = Callable[[torch.Tensor], torch.Tensor]

PART, REDUCED = "part", "reduced"
TOPOLOGIES = ("butterfly", "server")


def mean_reducer(stack: torch.Tensor) -> torch.Tensor:
    return stack.mean(dim=0)


@dataclass(frozen=True)
class AllReduceConfig:
    timeout: float = 5.0  # seconds per phase before a silent peer is dropped from the step
    pull_after: float = 0.2  # seconds into a phase before missing parts are pulled (lost messages)
    pull_timeout: float = 0.25  # seconds per pull attempt, plus transfer time; the holder waits up to half of it
    pull_bandwidth: float = 20e6  # bytes/s assumed when sizing a pull's transfer time (slow links: lower it)
    window: int = 2  # accept messages for steps up to this far ahead of ours
    reducer: str = "mean"  # the rule each partition owner applies: any of phalanx.algorithms.robust.reducers.REDUCERS
    tau: float = 1.0  # CenteredClip radius (inf: the mean)
    eps: float = 1e-6  # CenteredClip stops when an update moves the aggregate by at most this
    max_iters: int = 1000  # CenteredClip iteration cap
    f: int = 0  # Byzantine count assumed by rules that take one (trimmed_mean, krum, bulyan, median_of_means)
    topology: str = "butterfly"  # butterfly | server: one trusted peer (peer 0) reduces whole vectors (BTARD's baselines)

    def __post_init__(self) -> None:
        for name in ("timeout", "pull_after", "pull_timeout", "pull_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"allreduce.{name}={getattr(self, name)!r} must be > 0")
        if self.window < 1:
            raise ConfigError(f"allreduce.window={self.window} must be >= 1")
        if self.reducer not in REDUCERS:
            raise ConfigError(f"allreduce.reducer={self.reducer!r} is not known; allowed: {', '.join(REDUCERS)}")
        if not self.tau > 0 or math.isnan(self.tau):
            raise ConfigError(f"allreduce.tau={self.tau!r} must be > 0 (inf: the mean)")
        if not 0 <= self.eps < float("inf"):
            raise ConfigError(f"allreduce.eps={self.eps!r} must be a finite number >= 0")
        if self.max_iters < 1:
            raise ConfigError(f"allreduce.max_iters={self.max_iters} must be >= 1")
        if self.f < 0:
            raise ConfigError(f"allreduce.f={self.f} must be >= 0")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"allreduce.topology={self.topology!r} is not known; allowed: {', '.join(TOPOLOGIES)}")

    def build_reducer(self) -> Reducer:
        """The reduction rule this config names."""
        return make_reducer(self.reducer, tau=self.tau, eps=self.eps, max_iters=self.max_iters, f=self.f)


@dataclass(frozen=True)
class AllReduceResult:
    vector: torch.Tensor
    group: tuple[str, ...]
    dropped_senders: tuple[str, ...]  # whose part of my partition never reached me
    missing_parts: tuple[str, ...]  # reducers whose result never reached me (those slices stay zero)


def part_bounds(dim: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of n nearly equal parts of a vector of length dim."""
    base, extra = divmod(dim, n)
    bounds, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class ButterflyAllReduce:
    """One peer's side of butterfly all-reduce; call it once per step."""

    def __init__(
        self,
        transport: Transport,
        dim: int,
        reducer: Reducer = mean_reducer,
        config: AllReduceConfig = AllReduceConfig(),
    ) -> None:
        self.transport = transport
        self.dim = dim
        self.reducer = reducer
        self.config = config
        self._step = -1
        self._group: dict[int, bytes] = {}  # step -> digest of the group this peer used
        self._inbox: dict[tuple[int, str], dict[str, tuple[torch.Tensor, bytes]]] = {}
        self._waiters: dict[tuple[int, str], tuple[set[str], asyncio.Future]] = {}
        self._given_up: dict[tuple[int, str], set[str]] = {}  # (step, kind) -> senders a collect no longer waits for
        self._outbox: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._ready: dict[tuple[int, str], asyncio.Event] = {}
        transport.add_message_handler("ar.part", self._on_part)
        transport.add_message_handler("ar.reduced", self._on_reduced)
        transport.add_request_handler("ar.pull", self._on_pull)

    async def __call__(self, step: int, vector: torch.Tensor, group: list[str]) -> AllReduceResult:
        me = self.transport.peer_id
        if me not in group:
            raise PhalanxError(f"peer {me[:8]} is not in its own all-reduce group; pass a group that includes it")
        vector = vector.detach().reshape(-1).to(torch.float32)
        g = group_digest(group)
        self._begin(step, g)
        bounds = part_bounds(self.dim, len(group))
        index = group.index(me)
        lo, hi = bounds[index]
        others = [p for p in group if p != me]

        parts = {peer: vector[a:b] for peer, (a, b) in zip(group, bounds)}
        self._publish(step, PART, parts)
        for peer in others:
            await self.transport.send(peer, "ar.part", encode({"step": step, "g": g, "t": parts[peer]}))
        received = await self._collect(step, PART, {p: (hi - lo,) for p in others})
        contributors = [me] + [p for p in others if p in received]
        own = parts[me] if parts[me].shape == (hi - lo,) else torch.zeros(hi - lo)  # an attack's vector may be short
        stack = torch.stack([own] + [received[p] for p in contributors[1:]])
        reduced = self.reducer(stack).to(torch.float32)
        self._publish(step, REDUCED, {peer: reduced for peer in group})
        message = encode({"step": step, "g": g, "t": reduced})
        for peer in others:
            await self.transport.send(peer, "ar.reduced", message)

        out = torch.empty(self.dim, dtype=torch.float32)
        out[lo:hi] = reduced
        gathered = {peer: bound for peer, bound in zip(group, bounds) if peer != me}
        results = await self._collect(step, REDUCED, {p: (b - a,) for p, (a, b) in gathered.items()})
        for peer, (a, b) in gathered.items():
            out[a:b] = results[peer] if peer in results else 0.0
        return AllReduceResult(
            out,
            tuple(group),
            tuple(p for p in others if p not in received),
            tuple(p for p in others if p not in results),
        )

    # --- phases -----------------------------------------------------------

    async def _collect(
        self, step: int, kind: str, shapes: dict[str, tuple[int, ...]], timeout: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Wait for each peer's tensor of (step, kind) up to `timeout` (the config's by default); pull
        what is late; drop who stays silent.

        A tensor sent for another group (the sender's membership view differed)
        is not evidence: it is treated as missing.
        """
        clock = self.transport.clock
        deadline = clock.now() + (self.config.timeout if timeout is None else timeout)
        peers = list(shapes)
        await self._wait(step, kind, peers, min(deadline, clock.now() + self.config.pull_after))
        box = self._inbox.setdefault((step, kind), {})
        mine = self._group[step]
        missing = [p for p in peers if p not in box or box[p][1] != mine]
        if missing:
            pulled = await asyncio.gather(
                *(self._pull(p, step, kind, deadline, 4 * math.prod(shapes[p])) for p in missing)
            )
            for peer, tensor in zip(missing, pulled):
                if tensor is not None:
                    box[peer] = (tensor, mine)
        valid = {}
        for peer in peers:
            if peer not in box or box[peer][1] != mine:
                continue
            try:
                valid[peer] = check_tensor(box[peer][0], peer, shape=shapes[peer], dtype=torch.float32, finite=False, step=step)
            except RemoteError as exc:
                self.transport.report(exc.evidence)
        if valid:
            for peer in _non_finite(list(valid.items())):
                self.transport.report(Evidence(peer, "non_finite", f"{kind} holds NaN or Inf", step))
                del valid[peer]
        return valid

    async def _wait(self, step: int, kind: str, peers: list[str], until: float) -> None:
        key = (step, kind)
        box = self._inbox.get(key, {})
        given_up = self._given_up.get(key, set())
        wanted = {p for p in peers if p not in box and p not in given_up}
        remaining = until - self.transport.clock.now()
        if not wanted or remaining <= 0:
            return
        done = asyncio.get_running_loop().create_future()
        self._waiters[key] = (wanted, done)
        try:
            await asyncio.wait_for(done, remaining)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.pop(key, None)

    async def _pull(self, peer: str, step: int, kind: str, deadline: float, nbytes: int) -> torch.Tensor | None:
        clock = self.transport.clock
        mine = self._group[step]
        request = encode({"step": step, "kind": kind, "g": mine, "wait": self.config.pull_timeout / 2})
        attempt = self.config.pull_timeout + nbytes / self.config.pull_bandwidth
        while (remaining := deadline - clock.now()) > 0 and peer not in self._given_up.get((step, kind), ()):
            held = self._inbox.get((step, kind), {}).get(peer)
            if held is not None and held[1] == mine:
                return held[0]
            try:
                response = await self.transport.request(peer, "ar.pull", request, min(remaining, attempt))
                tensor = self._tensor_of(peer, response, step)
            except RemoteError as exc:
                self.transport.report(exc.evidence)
                return None
            except PhalanxError as exc:
                log.debug("pull %s step %d from %s failed: %s", kind, step, peer[:8], exc)
                tensor = None
            if tensor is not None:
                return tensor
            # Not there yet (lost, or the holder is behind or saw another group): back off.
            await asyncio.sleep(min(max(deadline - clock.now(), 0), self.config.pull_timeout / 4))
        return None

    def _give_up(self, step: int, kind: str, peers: set[str]) -> None:
        """A running `_collect` of (step, kind) stops waiting for (and pulling from) `peers`."""
        key = (step, kind)
        self._given_up.setdefault(key, set()).update(peers)
        waiter = self._waiters.get(key)
        if waiter is not None:
            waiter[0].difference_update(peers)
            if not waiter[0] and not waiter[1].done():
                waiter[1].set_result(None)

    # --- bookkeeping ------------------------------------------------------

    def _begin(self, step: int, g: bytes) -> None:
        self._step = step
        self._group[step] = g
        for table in (self._inbox, self._outbox, self._ready, self._group, self._given_up):
            for key in [k for k in table if (k if isinstance(k, int) else k[0]) < step - 1]:
                del table[key]

    def _publish(self, step: int, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        self._outbox[(step, kind)] = tensors
        self._ready.setdefault((step, kind), asyncio.Event()).set()

    def _accepts(self, step: int) -> bool:
        return self._step - 1 <= step <= self._step + self.config.window

    def _tensor_of(self, sender: str, payload: bytes, step: int) -> torch.Tensor | None:
        """The tensor of a pull answer; None when the holder answered "not available"."""
        obj = decode(payload, sender, self.transport.limits)
        if not isinstance(obj, dict) or obj.get("step") != step:
            raise RemoteError(Evidence(sender, "malformed", "all-reduce answer for another step", step))
        tensor = obj.get("t")
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise RemoteError(Evidence(sender, "malformed", "all-reduce answer without tensor", step))
        return tensor

    def _store(self, sender: str, payload: bytes, kind: str) -> None:
        obj = decode(payload, sender, self.transport.limits)
        if not isinstance(obj, dict):
            raise RemoteError(Evidence(sender, "malformed", "all-reduce message is not a mapping"))
        step, g, tensor = obj.get("step"), obj.get("g"), obj.get("t")
        if type(step) is not int or not isinstance(g, bytes) or not isinstance(tensor, torch.Tensor):
            raise RemoteError(Evidence(sender, "malformed", "all-reduce message needs step, group digest and tensor"))
        if not self._accepts(step):
            log.debug("dropping %s for step %d from %s (at step %d)", kind, step, sender[:8], self._step)
            return
        self._deliver(sender, step, kind, tensor, g)

    def _deliver(self, sender: str, step: int, kind: str, tensor: torch.Tensor, g: bytes) -> None:
        """File `sender`'s tensor of (step, kind) for group `g`, waking a collect that waits for it."""
        key = (step, kind)
        box = self._inbox.setdefault(key, {})
        if sender not in box:
            box[sender] = (tensor, g)
            waiter = self._waiters.get(key)
            if waiter is not None and sender in waiter[0]:
                waiter[0].discard(sender)
                if not waiter[0] and not waiter[1].done():
                    waiter[1].set_result(None)

    def _on_part(self, sender: str, payload: bytes) -> None:
        self._store(sender, payload, PART)

    def _on_reduced(self, sender: str, payload: bytes) -> None:
        self._store(sender, payload, REDUCED)

    async def _on_pull(self, sender: str, payload: bytes) -> bytes:
        obj = decode(payload, sender, self.transport.limits)
        if not isinstance(obj, dict):
            raise RemoteError(Evidence(sender, "malformed", "all-reduce pull is not a mapping"))
        step, kind, g, wait = obj.get("step"), obj.get("kind"), obj.get("g"), obj.get("wait")
        if type(step) is not int or kind not in (PART, REDUCED) or not isinstance(g, bytes) or not isinstance(wait, (int, float)):
            raise RemoteError(Evidence(sender, "malformed", "bad all-reduce pull request"))
        key = (step, kind)
        if not self._accepts(step) and key not in self._outbox:
            return encode({"step": step})
        ready = self._ready.setdefault(key, asyncio.Event())
        try:
            wait_s = min(float(wait), self.config.timeout) if math.isfinite(wait) else 0.0
            await asyncio.wait_for(ready.wait(), max(0.0, wait_s))
        except (asyncio.TimeoutError, OverflowError):
            return encode({"step": step})
        tensor = self._outbox.get(key, {}).get(sender)
        if tensor is None or self._group.get(step) != g:
            return encode({"step": step})
        return encode({"step": step, "t": tensor})


class TrustedServerAllReduce(ButterflyAllReduce):
    """All-reduce through one trusted peer (a parameter server): BTARD's baselines.

    Every peer sends its whole vector to ``server``, which applies the
    reduction rule to the full stack (so CenteredClip and the geometric
    median act on whole gradients, not on partitions) and sends the result
    back. Nothing is verified: the server is trusted by construction.
    """

    def __init__(self, transport: Transport, dim: int, server: str, reducer: Reducer = mean_reducer, config: AllReduceConfig = AllReduceConfig()) -> None:
        super().__init__(transport, dim, reducer, config)
        self.server = server

    async def __call__(self, step: int, vector: torch.Tensor, group: list[str]) -> AllReduceResult:
        me = self.transport.peer_id
        if self.server not in group:
            raise PhalanxError(f"trusted server {self.server[:8]} is not in the group of step {step}")
        vector = vector.detach().reshape(-1).to(torch.float32)
        g = group_digest(group)
        self._begin(step, g)
        others = [p for p in group if p != me]
        if me != self.server:
            self._publish(step, PART, {self.server: vector})
            await self.transport.send(self.server, "ar.part", encode({"step": step, "g": g, "t": vector}))
            results = await self._collect(step, REDUCED, {self.server: (self.dim,)})
            out = results.get(self.server, torch.zeros(self.dim))
            return AllReduceResult(out, tuple(group), (), () if self.server in results else (self.server,))
        own = vector if vector.shape == (self.dim,) else torch.zeros(self.dim)  # an attack's vector may be short
        received = await self._collect(step, PART, {p: (self.dim,) for p in others})
        reduced = self.reducer(torch.stack([own] + [received[p] for p in others if p in received])).to(torch.float32)
        self._publish(step, REDUCED, {peer: reduced for peer in group})
        message = encode({"step": step, "g": g, "t": reduced})
        for peer in others:
            await self.transport.send(peer, "ar.reduced", message)
        return AllReduceResult(reduced, tuple(group), tuple(p for p in others if p not in received), ())


def _non_finite(tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Who sent a tensor holding NaN or Inf, checked with as few kernel calls as the sizes allow."""
    if sum(t.numel() for _, t in tensors) <= 1 << 20:
        # Many small parts (large swarms): one check over all of them, per part only if it fails.
        if bool(torch.isfinite(torch.cat([t.reshape(-1) for _, t in tensors])).all()):
            return []
        return [peer for peer, t in tensors if not bool(torch.isfinite(t).all())]
    # Few large parts: a part's sum is finite when all its entries are; only a
    # non-finite sum (NaN/Inf, or an overflow of finite values) needs the exact check.
    return [peer for peer, t in tensors if not (bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()))]


def group_digest(group: list[str]) -> bytes:
    """8 bytes naming a group: messages for another group are a view mismatch, not evidence."""
    return hashlib.sha256("\n".join(group).encode()).digest()[:8]
