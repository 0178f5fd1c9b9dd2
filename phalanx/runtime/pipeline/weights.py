"""Weight transfer: a node serves its stage's weights and optimizer state; a joiner, or a replica left
out of an aggregation or behind, downloads them (digest confirmed by a second peer) or catches up.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import check_tensor, decode, digest, encode
from . import messages as m

log = logging.getLogger(__name__)

class WeightTransfer:
    """Serving and fetching stage weights (a part of `PipelineNode`, node.py)."""

    def state_digest(self) -> bytes:
        return digest(b"".join(p.detach().cpu().numpy().tobytes() for p in self.params))

    async def _on_weights(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "weights request")
        version, full = obj.get("version"), obj.get("full")
        stage, wait = obj.get("stage", self.stage), obj.get("wait", True)
        if type(version) is not int or not isinstance(full, bool) or type(stage) is not int or not isinstance(wait, bool):
            raise RemoteError(Evidence(sender, "malformed", "bad weights request"))
        if stage != self.stage or not self.entered or sender in self.banned:
            return encode({"version": -1})  # not (or not yet) a replica of that stage, or a banned asker: not evidence
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
            peers = self.replicas(self.stage)  # a joiner serving from a later iteration has the weights too
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
