"""BTARD per pipeline stage: the replicas of a relay stage aggregate its parameters with BTARD's secure round.

Each replica of stage s runs one `SecureRound` (runtime/rounds/btard.py, unchanged in substance) per
iteration over its stage vector (`stages.contribution`). The round sees the node's transport
through a `StageView`:
- broadcasts (joins, commitments, aggregate commitments, metadata, reports, MPRNG) go only to the
  replicas of the iteration's stage group, on a board of their own that keeps envelopes from peers
  of this stage only, so that stage s's step-k messages never meet stage s'`s;
- the step's group is the BEGIN group (agreed: every node reads the same flooded BEGIN) less the
  replicas whose signed join did not come and those banned (`agreed_candidates`);
- requests and point-to-point messages go through the node's own transport.

What is checked: commitments, parts against them, CenteredClip (or the mean) per partition, each
owner's declaration, V1 (norms) and V2 (Σ s = 0 along MPRNG's direction) on every partition,
V3 / CHECKAVERAGING, equivocation and MPRNG cheating; ACCUSE / ELIMINATE as in data-parallel BTARD.

A replica's own vector (issue 18 item 2, with `btard.validators` > 0): a stage gradient is not a
function of public data, it depends on the activations and output gradients other relays sent.
So every sender seals what it sends (`messages.Seal`, checked on receipt), and each replica commits,
in its BTARD commitment, to the digest of its inputs (`StageInputs`): for every microbatch of the
BEGIN's finished list that it served, the activation and the output gradient it computed with, each
with its sender's seal. A validator drawn by MPRNG fetches them (`sbt.inputs`), checks them against
the commitment, that the microbatches are exactly those BEGIN says it served and that each seal is
its sender's per the microbatch's path, recomputes the stage gradient at that iteration's weights
(its own snapshot: honest replicas of a stage hold identical weights) and compares it with the
committed parts within BTARD's GRAD_RTOL (1e-4 of the recomputed norm). A mismatch is an ACCUSE
with the inputs and parts as proof, judged by every replica recomputing from them; inputs that prove
a lie by themselves (a bad seal, a microbatch it did not serve) are an ACCUSE "inputs"; inputs the
target will not give are the validator's ELIMINATE (only it saw the omission).

Bans: every honest replica of the stage resolves the same bans at the same point (the end of the
next iteration's round). Each one routes around the banned peer at once, records the ban as a
`ban` event (the run's one ledger, beside SENTINEL's) and reports it to every other node
(`STAGE_BAN`). A node outside the stage (data nodes, other stages) applies a reported ban once
more than half of the stage's latest BEGIN group has reported it, so one lying replica cannot
ban anyone; data nodes then leave the peer out of the next groups, and routers route around it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger
from ...algorithms.sentinel.statistics import BACKWARD as CHECK_BACKWARD
from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.envelope import SignedEnvelope
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ...transport.base import BOARD_TOPIC, BROADCAST_TOPIC, Transport
from ...transport.broadcast import BroadcastBoard
from ..rounds.btard import BTARDConfig, SecureRound
from ..rounds.butterfly import AllReduceConfig, AllReduceResult
from . import messages as m
from .stages import contribution, flat

if TYPE_CHECKING:
    from .node import PipelineNode

STAGE_BROADCAST = "sbt.broadcast"  # a stage round's signed broadcast (kept apart from the node's own board)
STAGE_BOARD = "sbt.board"  # a request for envelopes on a stage round's board
STAGE_BAN = "sbt.ban"  # a stage replica reports a ban its stage's round resolved
STAGE_INPUTS = "sbt.inputs"  # request: a replica's committed inputs of one iteration (validators)
KEPT_ITERATIONS = 3  # iterations whose weights and inputs are kept for validation (k is verified during k + 1)


class _StageBoard(BroadcastBoard):
    """A board that keeps only envelopes signed by peers of one stage."""

    def __init__(self, on_evidence, limits, member: Callable[[str], bool]) -> None:
        super().__init__(on_evidence, limits)
        self._member = member

    def add(self, envelope: SignedEnvelope) -> bool:
        return self._member(envelope.sender) and super().add(envelope)


class StageView(Transport):
    """The node's transport as one stage's BTARD round sees it (see the module docstring)."""

    def __init__(self, inner: Transport, member: Callable[[str], bool]) -> None:
        self._member = member
        self.inner = inner
        self.group: list[str] = []  # the iteration's candidates (its BEGIN group of this stage)
        super().__init__(inner.identity, inner.limits)
        self.clock = inner.clock
        inner.add_message_handler(STAGE_BROADCAST, lambda sender, payload: self.board.receive(sender, payload))
        inner.add_request_handler(STAGE_BOARD, self._serve_board)

    def reset_process_state(self) -> None:
        super().reset_process_state()
        self.board = _StageBoard(self.report, self.limits, self._member)

    def add_request_handler(self, topic: str, handler) -> None:
        self.inner.add_request_handler(topic, handler)

    def add_message_handler(self, topic: str, handler) -> None:
        self.inner.add_message_handler(topic, handler)

    async def request(self, peer: str, topic: str, payload: bytes, timeout: float) -> bytes:
        return await self.inner.request(peer, STAGE_BOARD if topic == BOARD_TOPIC else topic, payload, timeout)

    async def send(self, peer: str, topic: str, payload: bytes) -> None:
        await self.inner.send(peer, STAGE_BROADCAST if topic == BROADCAST_TOPIC else topic, payload)

    def members(self) -> list[str]:
        live = set(self.inner.members())
        return sorted(p for p in set(self.group) | {self.peer_id} if p in live or p == self.peer_id)

    async def charge_compute(self, flops: float) -> None:
        await self.inner.charge_compute(flops)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class StageRound:
    """A relay's stage all-reduce under BTARD; called like `ButterflyAllReduce` by `PipelineNode.aggregate`."""

    def __init__(self, node: PipelineNode, dim: int, allreduce: AllReduceConfig, btard: BTARDConfig,
                 policy: ProtocolPolicy | None) -> None:
        self.node = node
        self.ledger = BanLedger()
        self.view = StageView(node.transport, lambda p: node.directory.get(p) == node.stage)
        # recompute=None: a stage gradient is not a function of public data; with validators it is
        # recomputed from the inputs each replica commits to (StageInputs).
        self.inputs = StageInputs(node, btard.timeout) if btard.validators > 0 else None
        self.round = SecureRound(self.view, dim, allreduce, btard, self.ledger, None, policy, agreed_candidates=True,
                                 inputs=self.inputs)

    async def __call__(self, it: int, vector: torch.Tensor, group: list[str]) -> AllReduceResult:
        node = self.node
        if self.ledger.is_banned(node.me):  # this replica's own stage banned it: it takes no further round
            return AllReduceResult(torch.zeros_like(vector), (), (), ())
        self.view.group = list(group)
        self.view.board.prune(it - 2)  # broadcasts older than two iterations are settled
        if self.inputs is not None:
            self.inputs.record(it, group)
        result = await self.round(it, vector, group)
        for ban in result.bans:
            node.on_event({"kind": "ban", "peer": ban.peer, "step": ban.step, "reason": f"btard:{ban.reason}",
                           "by": node.me, "stage": node.stage, "accuser": ban.accuser, "t": node.now()})
            body = encode({"peer": ban.peer, "it": ban.step, "stage": node.stage})
            for peer in sorted(node.directory):
                if peer != node.me:
                    await node.transport.send(peer, STAGE_BAN, body)
            if ban.peer != node.me:
                exclude(node, ban.peer)
        return result

    def close(self) -> None:
        """The run is over: drop the last iteration's verification, which the stopping group cannot finish."""
        self.round.cancel_pending()


class StageBanReports:
    """Bans that stage rounds resolved, as reported to this node; applied on a majority of the stage's group."""

    def __init__(self, node: PipelineNode) -> None:
        self.node = node
        self.reports: dict[str, set[str]] = {}  # banned peer -> replicas of its stage that reported it
        node.transport.add_message_handler(STAGE_BAN, self._on_ban)

    def _on_ban(self, sender: str, payload: bytes) -> None:
        node = self.node
        obj = m.parse_mapping(payload, sender, node.transport.limits, "stage ban")
        peer, it, stage = obj.get("peer"), obj.get("it"), obj.get("stage")
        if not (isinstance(peer, str) and type(it) is int and type(stage) is int):
            raise RemoteError(Evidence(sender, "malformed", "bad stage ban"))
        if node.directory.get(sender) != stage or node.directory.get(peer) != stage or stage < 1:
            return  # not a replica of the stage it reports on (or a view that lags): proves nothing
        self.reports.setdefault(peer, set()).add(sender)
        group = node.groups[stage] if len(node.groups) > stage else []
        reporters = self.reports[peer] & set(group)
        if len(reporters) > len(group) / 2 and peer != node.me:
            exclude(node, peer)


def exclude(node: PipelineNode, peer: str) -> None:
    """Route around `peer` and leave it out of aggregation groups from now on (as a SENTINEL ban does)."""
    if peer in node.banned:
        return
    node.banned.add(peer)
    if node.flow is not None:
        node.spawn(node.flow.send(node.flow.lost(peer)))



@dataclass
class _Iteration:
    """What a replica keeps of one iteration to validate its stage peers: the weights it computed with,
    the BEGIN's finished microbatches with their paths, and the group size and work that scale each vector."""

    part: torch.nn.Module
    paths: dict[m.Key, tuple[str, ...]]
    replicas: int
    work: int


class StageInputs:
    """The inputs a replica's stage gradient is recomputed from (SecureRound's InputsHook; module docstring)."""

    def __init__(self, node: PipelineNode, timeout: float) -> None:
        self.node = node
        self.timeout = timeout
        self.mine: dict[int, bytes] = {}  # iteration -> my committed inputs (encoded records)
        self.kept: dict[int, _Iteration] = {}
        node.transport.add_request_handler(STAGE_INPUTS, self._serve)

    def record(self, it: int, group: list[str]) -> None:
        """Before iteration `it`'s round (weights not yet stepped): keep its weights and BEGIN, encode my inputs."""
        node = self.node
        paths = {k: tuple(p) for k, p in node.finished_paths.items() if len(p) > node.stage}
        work = sum(1 for p in paths.values() if p[node.stage] in group)
        self.kept[it] = _Iteration(copy.deepcopy(node.part), paths, len(group), work)
        behind = node.version != it  # holds no gradients of `it`: contributes zeros, commits no inputs
        served = [] if behind else sorted(k for k in node.grads if k in paths and paths[k][node.stage] == node.me)
        records = []
        for key in served:
            fwd, bwd = node.received[key]
            records.append({"src": key[0], "seq": key[1], "att": key[2], "x": fwd.tensor, "xs": fwd.seal.to_obj(),
                            "g": bwd.tensor, "gs": bwd.seal.to_obj()})
        self.mine[it] = encode(records)
        for old in [k for k in self.kept if k <= it - KEPT_ITERATIONS]:
            del self.kept[old]
            self.mine.pop(old, None)

    def commitment(self, step: int) -> bytes:
        return digest(self.mine[step])

    async def _serve(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.node.transport.limits, "inputs request")
        it = obj.get("it")
        if type(it) is not int:
            raise RemoteError(Evidence(sender, "malformed", "bad inputs request"))
        return encode({"it": it, "inputs": self.mine.get(it)})

    async def fetch(self, target: str, step: int, committed: bytes) -> bytes | None:
        """The target's inputs of `step` if they match its commitment (None otherwise); the device is
        charged for the recomputation that follows (a forward and a backward per microbatch)."""
        node = self.node
        try:
            answer = decode(await node.transport.request(target, STAGE_INPUTS, encode({"it": step}), self.timeout),
                            target, node.transport.limits)
        except RemoteError as exc:
            node.transport.report(exc.evidence)
            return None
        except PhalanxError:
            return None
        blob = answer.get("inputs") if isinstance(answer, dict) else None
        if not isinstance(blob, bytes) or digest(blob) != committed:
            return None
        kept = self.kept.get(step)
        served = sum(1 for p in kept.paths.values() if p[node.stage] == target) if kept is not None else 0
        async with node.compute_lock:
            await node.transport.charge_compute(3 * served * node.staged.forward_flops[node.stage] * node.config.flops_scale)
        return blob

    def recompute(self, target: str, step: int, inputs: bytes) -> torch.Tensor | None:
        """The target's stage vector of `step` recomputed from its committed inputs; None when the inputs
        prove a lie: not the microbatches BEGIN says it served, a tensor of the wrong shape, or a seal that
        is not its sender's. Raises KeyError when this replica kept no weights of `step` (it cannot judge)."""
        node, stage = self.node, self.node.stage
        kept = self.kept[step]
        records = decode(inputs, target, node.transport.limits)
        expected = sorted(k for k, p in kept.paths.items() if p[stage] == target)
        if not isinstance(records, list) or len(records) != len(expected):
            return None
        params = list(kept.part.parameters())
        total = torch.zeros(sum(p.numel() for p in params))
        for key, record in zip(expected, records):
            if not (isinstance(record, dict) and (record.get("src"), record.get("seq"), record.get("att")) == key):
                return None
            x, g = record.get("x"), record.get("g")
            shapes = (tuple(node.staged.input_shape(stage)), tuple(node.staged.out_shapes[stage]))
            if not (isinstance(x, torch.Tensor) and isinstance(g, torch.Tensor) and (tuple(x.shape), tuple(g.shape)) == shapes
                    and x.dtype == g.dtype == torch.float32 and bool(torch.isfinite(x).all()) and bool(torch.isfinite(g).all())):
                return None
            path = kept.paths[key]
            downstream = path[stage + 1] if stage < node.last else path[0]
            try:
                seals = (m.parse_seal(record.get("xs"), target), m.parse_seal(record.get("gs"), target))
            except RemoteError:
                return None
            fwd = m.Carry(key, step, stage, path[:stage], x, seal=seals[0])
            bwd = m.Carry(key, step, stage, path, g, seal=seals[1])
            if not (_sealed(node, CHECK_FORWARD, fwd, path[stage - 1]) and _sealed(node, CHECK_BACKWARD, bwd, downstream)):
                return None
            xin = x.clone().requires_grad_(True)
            with torch.enable_grad():
                grads = torch.autograd.grad(kept.part(xin), params, g, allow_unused=True)
            total += flat(list(grads), params)
        return contribution(total, kept.work, kept.replicas)


def _sealed(node: PipelineNode, direction: str, c: m.Carry, sender: str) -> bool:
    return c.seal is not None and c.seal.valid(c.key, c.it, direction, c.stage, c.tensor) and (
        c.seal.signer in node.sealers(direction, c, sender))
