"""Stage aggregation (GWTF V-E): BEGIN floods front to back, each replica contributes its stage vector
(`stages.contribution`) to the stage all-reduce (plain butterfly, or BTARD per stage: stage_btard.py),
steps, and CAN TAKE flows back to front.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from ...core.errors import Evidence, RemoteError
from ...core.serialization import decode, encode
from ...training.task import num_params
from . import messages as m
from .stages import clipped, contribution

log = logging.getLogger(__name__)

class Aggregation:
    """The stage all-reduce of each iteration (a part of `PipelineNode`, node.py)."""

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
        await self.weights_agreed(it)  # this round's kept weights (what validators recompute with) are the agreed ones
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
                step = clipped(result.vector, self.config.grad_clip)
                offset = 0
                for p in self.params:
                    p.grad = step[offset: offset + p.numel()].view_as(p).to(p.device).clone()
                    offset += p.numel()
                async with self.compute_lock:  # no forward or backward runs across a step
                    if self.version == it:  # a download may have caught it up while it waited for the lock
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            if self.secure and not behind and self.version == it and len(result.group) > 1:
                # the stage's weights stay one (validation needs it): checked off this path; forwards of the new
                # version wait for the check (`weights_agreed`), so none computes with weights about to be replaced
                self._agreeing[version] = asyncio.Event()
                self.spawn(self.agree_weights(version, result.group))
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
        self.delivered.clear()
        self.resends.clear()
        self.suspects.clear()
        self.rerouted.clear()
        self.backed.clear()
        self.forwarded_to.clear()
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
