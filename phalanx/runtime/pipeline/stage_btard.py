"""BTARD per pipeline stage: the replicas of a relay stage aggregate its parameters with BTARD's secure round.

Each replica of stage s runs one `SecureRound` (runtime/rounds/btard.py, unchanged in substance) per
iteration over its stage vector (`node.contribution`). The round sees the node's transport
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
What is not: a replica's own vector. Validators recompute a peer's gradient from its public
batch, and a stage gradient is not a function of public data (it depends on the activations and
output gradients other relays sent), so stage rounds draw no validators (`recompute=None`): a
forged stage vector is bounded by the reducer (CenteredClip's tau), never banned (issue 18 item 2).

Bans: every honest replica of the stage resolves the same bans at the same point (the end of the
next iteration's round). Each one routes around the banned peer at once, records the ban as a
`ban` event (the run's one ledger, beside SENTINEL's) and reports it to every other node
(`STAGE_BAN`). A node outside the stage (data nodes, other stages) applies a reported ban once
more than half of the stage's latest BEGIN group has reported it, so one lying replica cannot
ban anyone; data nodes then leave the peer out of the next groups, and routers route around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger
from ...core.envelope import SignedEnvelope
from ...core.errors import Evidence, RemoteError
from ...core.serialization import encode
from ...transport.base import BOARD_TOPIC, BROADCAST_TOPIC, Transport
from ...transport.broadcast import BroadcastBoard
from ..rounds.btard import BTARDConfig, SecureRound
from ..rounds.butterfly import AllReduceConfig, AllReduceResult
from . import messages as m

if TYPE_CHECKING:
    from .node import PipelineNode

STAGE_BROADCAST = "sbt.broadcast"  # a stage round's signed broadcast (kept apart from the node's own board)
STAGE_BOARD = "sbt.board"  # a request for envelopes on a stage round's board
STAGE_BAN = "sbt.ban"  # a stage replica reports a ban its stage's round resolved


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
        # recompute=None: a stage gradient cannot be recomputed from public data (no validators; item 2).
        self.round = SecureRound(self.view, dim, allreduce, btard, self.ledger, None, policy, agreed_candidates=True)

    async def __call__(self, it: int, vector: torch.Tensor, group: list[str]) -> AllReduceResult:
        node = self.node
        if self.ledger.is_banned(node.me):  # this replica's own stage banned it: it takes no further round
            return AllReduceResult(torch.zeros_like(vector), (), (), ())
        self.view.group = list(group)
        self.view.board.prune(it - 2)  # broadcasts older than two iterations are settled
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

