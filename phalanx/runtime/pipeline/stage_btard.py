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
target will not give are the validator's ELIMINATE (only it saw the omission). What a stage-gradient
claim found is written down: the validator's own claim is a `claim` event, and each `ban` event of a
gradient claim (the target's, the slanderer's, a covering approver's) carries, as this replica recomputed
it, which partitions and parameter tensors differ, the max abs difference, the gap against the
tolerance, each microbatch's share of the difference, and the weights (digest, version) it recomputed with
(`StageInputs.explain`).

Departures (App. F): a replica that is silent through its stage's verification of an iteration (no
report of it reached anyone: it crashed or left while the round was open) departs instead of being
banned for what it left undone: omission claims against it (no metadata, no MPRNG reveal, no parts,
not validating) ban nobody, neither it nor who eliminated it (`StageAdmission`, SecureRound's
admission path). A departure never excuses a lie: every claim with evidence (a declaration, a
judgeable sum, equivocation, an MPRNG cheat, false metadata, a forged vector whose inputs were
fetched) bans a replica that departs after it. Two things a departure can leave unjudged: the sum of
a departed owner's partition when a departed contributor's (often its own) metadata is missing, and
the stage vector of a departed validation target whose inputs no validator got. Either would let a
liar escape by leaving, so such a replica is retired (`retire` event, reason `departed:unverifiable`):
out of the stage's ledger and groups for good and refused when it asks to join, as a ban would, but
not counted as a ban (nothing proves it lied). A replica that departs with nothing unjudged comes back
through the join path with its identity.

A partition's aggregate that missed this replica while other replicas applied it (its owner left while
sending it: churn over hivemind) would leave this replica's step, and its weights, different from the
stage's for good; it then recomputes its peers' stage gradients with other weights than theirs and
accuses honest replicas (measured: an honest `gradient` / `slander:gradient` pair, notes of issue 18).
So before it steps, a replica fetches each missing aggregate from the group's other replicas and applies it
once it matches the hash its owner signed in its aggregate commitment (`StageRound.fill_missing`); a
partition nobody applied (its owner passed over) stays out everywhere alike.

Bans: every honest replica of the stage resolves the same bans at the same point (the end of the
next iteration's round). Each one routes around the banned peer at once, records the ban as a
`ban` event (the run's one ledger, beside SENTINEL's) and reports it to every other node
(`STAGE_BAN`). A node outside the stage (data nodes, other stages) applies a reported ban once
more than half of the stage's latest BEGIN group has reported it, so one lying replica cannot
ban anyone; data nodes then leave the peer out of the next groups, and routers route around it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...algorithms.btard.admission import Roles
from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger, BanRecord
from ...algorithms.btard.checks import ACCUSE, GRAD_ATOL, GRAD_RTOL, Claim, passed_over, tensor_hash
from ...algorithms.sentinel.statistics import BACKWARD as CHECK_BACKWARD
from ...algorithms.sentinel.statistics import FORWARD as CHECK_FORWARD
from ...core.envelope import SignedEnvelope
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ...transport.base import BOARD_TOPIC, BROADCAST_TOPIC, Transport
from ...transport.broadcast import BroadcastBoard
from ..rounds.btard import BTARDConfig, SecureRound
from ..rounds.btard_messages import decoded, group_in, parts_in, rcommit_in
from ..rounds.btard_state import CannotJudge, StepState
from ..rounds.butterfly import AllReduceConfig, AllReduceResult, group_digest, part_bounds
from . import messages as m
from .stages import contribution, flat

if TYPE_CHECKING:
    from .node import PipelineNode

STAGE_BROADCAST = "sbt.broadcast"  # a stage round's signed broadcast (kept apart from the node's own board)
STAGE_BOARD = "sbt.board"  # a request for envelopes on a stage round's board
STAGE_BAN = "sbt.ban"  # a stage replica reports a ban (or a retirement) its stage's round resolved
STAGE_INPUTS = "sbt.inputs"  # request: a replica's committed inputs of one iteration (validators)
STAGE_AGGREGATE = "sbt.aggregate"  # request: a partition's aggregate a replica applied (one that missed it)
KEPT_ITERATIONS = 3  # iterations whose weights and inputs are kept for validation (k is verified during k + 1)
RETIRED = "departed:unverifiable"  # the ledger reason of a departed replica that left a check unjudged
DEPARTED_INPUTS = b""  # what `StageInputs.fetch` returns for a target that left: its validator cannot judge


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
        self.fresh = False  # this replica ran no round of the previous iteration (a joiner): see collect_broadcasts
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

    async def collect_broadcasts(self, topic: str, step: int, senders: list[str], timeout: float, relays: int = 2,
                                 enough=None, patience: float | None = None) -> dict[str, SignedEnvelope]:
        """The round's collection; a replica that ran no round of the previous iteration (a joiner) asks for the
        step's joins after a twentieth of the timeout, not a quarter: its peers broadcast them during that round,
        before it was in their group, so they never come by themselves (it waited 1.26 s, and its peers as long
        for its commitments, in each iteration a joiner entered a stage)."""
        if topic == "bt.join" and patience is None and self.fresh:
            patience = timeout / 20
        return await super().collect_broadcasts(topic, step, senders, timeout, relays, enough, patience)

    def members(self) -> list[str]:
        live = set(self.inner.members())
        return sorted(p for p in set(self.group) | {self.peer_id} if p in live or p == self.peer_id)

    async def charge_compute(self, flops: float) -> None:
        await self.inner.charge_compute(flops)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class StageSecureRound(SecureRound):
    """The secure round of a stage group: SecureRound with the departures of the module docstring.

    After the verification of a step it notes what a departure could leave unjudged: a failed sum of a
    partition whose owner is silent and one of whose contributors' metadata is missing with its sender
    silent (no claim then: nobody can judge it, and the owner is retired, `StageAdmission`), and the
    targets that their validator reported unverified (retired if they depart in that step or the next).
    """

    fills_missing = True  # `StageRound.fill_missing` takes every partition another replica applied and I lack
    echoes_commitments = True  # a stage group is a few replicas

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.unjudged: dict[int, set[str]] = {}  # step -> silent owners whose sum nobody can judge
        self.unvalidated: dict[int, set[str]] = {}  # step -> targets their validator could not judge
        self.on_claims: Callable[[StepState, list[Claim]], None] | None = None  # every claim of a verified step

    async def _verify(self, st, parts: list[torch.Tensor], draw) -> list[Claim]:
        claims = await super()._verify(st, parts, draw)
        if self.on_claims is not None:
            self.on_claims(st, claims)
        unjudged = {o for o in st.sum_failed if o in st.silent and any(
            p in st.silent and o not in st.meta.get(p, ({}, {}))[1] for p in st.contributors(o))}
        self.unjudged[st.step] = unjudged
        # A target with no agreed commitment, or one that no applied partition aggregated (every other owner dropped
        # it, its own partition passed over: late against the group), contributed nothing to verify.
        # (on the agreed declarations, not on my gather's own cut `st.passed`: review s23-RE LOW 6)
        passed = passed_over(st.group, {o: c[2] for o, c in st.rcommits.items()}) or set()
        used = {p for o in st.group if o not in passed and o in st.rcommits for p in st.contributors(o)}
        self.unvalidated[st.step] = {t for v, t in st.pairs
                                     if t in used and t in st.reports.get(v, {}).get("unverified", [])}
        return [c for c in claims if not (c.reason == "v2_sum" and c.accuser == "" and c.target in unjudged)]


class StageAdmission:
    """SecureRound's admission hook for a stage group: every member trusted (a joiner too, as before), and
    each settled step's departures recorded. A departed member is retired when it left a check unjudged:
    its sum, or its validation (it departs in the step it was unverified in, or in the next one, or is
    no longer in the next one's group: a target can send its report and leave before its validator
    fetches its inputs)."""

    def __init__(self, stage_round: StageRound) -> None:
        self.stage_round = stage_round
        self.carried: dict[int, set[str]] = {}  # step -> unverified targets of the step before, still here

    async def roles(self, step: int, group: list[str]) -> Roles:
        return Roles(tuple(group), tuple(group))

    async def settle(self, step: int, approved: tuple[str, ...], departed: tuple[str, ...] = ()) -> None:
        secure, groups = self.stage_round.round, self.stage_round.groups
        unverified = secure.unvalidated.pop(step, set())
        owed = secure.unjudged.pop(step, set()) | unverified | self.carried.pop(step, set())
        if step in groups:  # an earlier unverified target that is not in this step's group has left
            for peer in sorted(owed - set(groups[step]) - set(departed)):
                await self.retire(peer, step)
        self.carried[step + 1] = {p for p in unverified if p not in departed}
        for table in (secure.unjudged, secure.unvalidated, groups, self.carried):
            for old in [k for k in table if k < step]:
                del table[old]
        for peer in departed:
            if peer in owed:
                await self.retire(peer, step)
            else:
                await self.stage_round.record(peer, step, "departed", False)

    async def retire(self, peer: str, step: int) -> None:
        ledger = self.stage_round.ledger
        if not ledger.is_banned(peer):
            ledger.apply([BanRecord(step, peer, RETIRED)])
            await self.stage_round.record(peer, step, RETIRED, True)

    def checkpoint_state(self) -> dict:
        return {}  # pipelines take no checkpoints

    def load_checkpoint_state(self, saved: dict) -> None:
        return None


class StageRound:
    """A relay's stage all-reduce under BTARD; called like `ButterflyAllReduce` by `PipelineNode.aggregate`."""

    def __init__(self, node: PipelineNode, dim: int, allreduce: AllReduceConfig, btard: BTARDConfig,
                 policy: ProtocolPolicy | None) -> None:
        self.node = node
        self.ledger = BanLedger()
        self.groups: dict[int, list[str]] = {}  # iteration -> its BEGIN group of this stage (agreed)
        # A stage peer: one my directory places in my stage, or one an agreed BEGIN group of my stage names (kept for
        # the iterations not yet settled). My directory lags a relay that rejoined in my stage from another one (its
        # HELLO missed me): its joins, commitments and declarations were dropped here, I waited btard.timeout for its
        # join every iteration (all/1, seed 1: 5 s in iterations 18 and 19) and could drop its commitment as late_commit.
        self.view = StageView(node.transport, lambda p: node.directory.get(p) == node.stage
                              or any(p in g for g in self.groups.values()))
        # recompute=None: a stage gradient is not a function of public data; with validators it is
        # recomputed from the inputs each replica commits to (StageInputs).
        self.inputs = StageInputs(node, btard.timeout) if btard.validators > 0 else None
        self.round = StageSecureRound(self.view, dim, allreduce, btard, self.ledger, None, policy,
                                      agreed_candidates=True, inputs=self.inputs)
        self.round.admission = StageAdmission(self)
        self.round.on_claims = self._note_claims
        self.gradient_claims: dict[int, tuple[StepState, list[Claim]]] = {}  # step -> its stage-gradient accusations
        self.applied: dict[int, AllReduceResult] = {}  # iteration -> the update this replica stepped with
        node.transport.add_request_handler(STAGE_AGGREGATE, self._serve_aggregate)
        # One round at a time: a round that outlives the aggregation timeout (it waits out departed
        # members) must settle before the next one starts, or both would settle the same step.
        self.lock = asyncio.Lock()

    async def __call__(self, it: int, vector: torch.Tensor, group: list[str]) -> AllReduceResult:
        node = self.node
        async with self.lock:
            if self.ledger.is_banned(node.me):  # this replica's own stage banned (or retired) it: no further round
                return AllReduceResult(torch.zeros_like(vector), (), (), ())
            self.view.group = list(group)
            self.view.fresh = it - 1 not in self.groups  # kept until the step before it settles (StageAdmission)
            self.groups[it] = list(group)
            self.view.board.prune(it - 2)  # broadcasts older than two iterations are settled
            if self.inputs is not None:
                self.inputs.record(it, group)
            result = await self.fill_missing(it, await self.round(it, vector, group))
            self.applied[it] = result
            for old in [k for k in self.applied if k <= it - KEPT_ITERATIONS]:
                del self.applied[old]
            for ban in result.bans:
                event = {"kind": "ban", "peer": ban.peer, "step": ban.step, "reason": f"btard:{ban.reason}",
                         "by": node.me, "stage": node.stage, "accuser": ban.accuser, "t": node.now()}
                if ban.reason.rsplit(":", 1)[-1] == "gradient":  # gradient, slander:gradient, covered:gradient
                    event["gradient"] = [self._explain(*found) for found in self._claims_behind(ban)]
                node.on_event(event)
                await self.report(ban.peer, ban.step)
            return result

    async def fill_missing(self, it: int, result: AllReduceResult) -> AllReduceResult:
        """The round's update with the partitions it lacks filled in from the group's other replicas: each
        aggregate as one of them applied it, checked against the hash its owner signed (the owner's aggregate
        commitment, fetched from them too if it did not reach this replica)."""
        node, me = self.node, self.node.me
        owners = list(result.group)  # a stage group's owners: every member (StageAdmission.roles)
        missing = [o for o in result.missing_parts if o != me and o in owners]
        if not missing:
            return result
        sources = [p for p in owners if p != me and p not in missing]
        bounds, g = part_bounds(result.vector.numel(), len(owners)), group_digest(owners)
        timeout = self.round.state.btard.timeout
        commitments, passed = self._commitments(it, owners, g)
        unheard = [o for o in missing if o in passed and o not in commitments]
        if unheard and sources:
            # The declarations of the owners I passed over that I lack (my gather may have ended at once: they left
            # before committing): one that another replica holds and that does not drop a fellow passed-over owner
            # makes that owner's partition one the others apply, and then I take it from them.
            await self.view.fetch_broadcasts("bt.rcommit", it, unheard, sources, timeout)
            commitments, passed = self._commitments(it, owners, g)
        wanted = [o for o in missing if o not in passed]  # a passed-over owner's partition: nobody applied it
        if any(o not in commitments for o in wanted) and sources:
            await self.view.fetch_broadcasts("bt.rcommit", it, [o for o in wanted if o not in commitments], sources, timeout)
            commitments, passed = self._commitments(it, owners, g)
        vector, filled = result.vector.clone(), []
        for owner in wanted:
            parsed = commitments.get(owner)
            if parsed is None or parsed[0] is None or owner in passed:
                continue
            a, b = bounds[owners.index(owner)]
            answers = await asyncio.gather(*(self._ask_aggregate(p, it, owner, timeout) for p in sources))
            part = next((t for t in answers if t is not None and tuple(t.shape) == (b - a,) and t.dtype == torch.float32
                         and tensor_hash(t) == parsed[0]), None)
            if part is not None:
                vector[a:b] = part
                filled.append(owner)
        if filled:
            node.on_event({"kind": "filled", "peer": me, "stage": node.stage, "it": it, "owners": filled,
                           "t0": node.now(), "t1": node.now()})
        return dataclasses.replace(result, vector=vector, missing_parts=tuple(o for o in result.missing_parts if o not in filled))

    def _commitments(self, it: int, owners: list[str], g: bytes) -> tuple[dict[str, tuple], set[str]]:
        """The aggregate commitments of iteration `it`'s group held here (owner -> (hash, used, drops); a
        malformed one has no hash), and the owners they pass over (as the round decides it: `passed_over`)."""
        commitments = {}
        for peer, env in self.view.board.get("bt.rcommit", it).items():
            obj = decoded(env.payload, peer, None)
            if peer in owners and group_in(obj) == g:
                commitments[peer] = rcommit_in(obj, owners) or (None, [], {})
        return commitments, passed_over(owners, {p: c[2] for p, c in commitments.items()}) or set()

    async def _ask_aggregate(self, peer: str, it: int, owner: str, timeout: float) -> torch.Tensor | None:
        try:
            answer = decode(await self.node.transport.request(peer, STAGE_AGGREGATE, encode({"it": it, "owner": owner}), timeout),
                            peer, self.node.transport.limits)
        except PhalanxError:
            return None
        part = answer.get("t") if isinstance(answer, dict) else None
        return part if isinstance(part, torch.Tensor) else None

    async def _serve_aggregate(self, sender: str, payload: bytes) -> bytes:
        """A partition's aggregate as this replica applied it in an iteration's update (None: not applied here)."""
        obj = m.parse_mapping(payload, sender, self.node.transport.limits, "aggregate request")
        it, owner = obj.get("it"), obj.get("owner")
        if type(it) is not int or not isinstance(owner, str):
            raise RemoteError(Evidence(sender, "malformed", "bad aggregate request"))
        timeout = self.round.state.btard.timeout
        deadline = self.node.now() + timeout
        while it not in self.applied and it > max(self.applied, default=-1) and self.node.now() < deadline:
            await asyncio.sleep(timeout / 10)  # my round of `it` may still be finishing
        result = self.applied.get(it)
        if result is None or owner not in result.group or owner in result.missing_parts:
            return encode({"t": None})
        owners = list(result.group)
        a, b = part_bounds(result.vector.numel(), len(owners))[owners.index(owner)]
        return encode({"t": result.vector[a:b].clone()})

    def _note_claims(self, st: StepState, claims: list[Claim]) -> None:
        """Keep a verified step's stage-gradient accusations (to explain the bans they lead to); write my own
        as a `claim` event."""
        held = [c for c in claims if c.kind == ACCUSE and c.reason == "gradient" and self.inputs is not None]
        self.gradient_claims[st.step] = (st, held)
        for old in [k for k in self.gradient_claims if k <= st.step - KEPT_ITERATIONS]:
            del self.gradient_claims[old]
        node = self.node
        for claim in held:
            if claim.accuser == node.me:
                node.on_event({"kind": "claim", "peer": claim.target, "step": st.step, "reason": "btard:gradient",
                               "by": node.me, "stage": node.stage, "t0": node.now(), "t1": node.now(),
                               "gradient": [self._explain(st, claim)]})

    def _claims_behind(self, ban: BanRecord) -> list[tuple[StepState, Claim]]:
        """The stage-gradient accusations a ban resolved: against its peer (gradient), by its peer (slander),
        or by its accuser against a target its peer approved (covered)."""
        st, held = self.gradient_claims.get(ban.step, (None, []))
        if ban.reason == "gradient":
            return [(st, c) for c in held if c.target == ban.peer and c.accuser == ban.accuser]
        if ban.reason.startswith("slander:"):
            return [(st, c) for c in held if c.accuser == ban.peer]
        return [(st, c) for c in held if c.accuser == ban.accuser]

    def _explain(self, st: StepState, claim: Claim) -> dict:
        """What this replica finds in a stage-gradient accusation's evidence (`StageInputs.explain`)."""
        found = {"target": claim.target, "accuser": claim.accuser}
        blob, parts = (claim.evidence[0], parts_in(claim.evidence[1:], st, claim.target)) if claim.evidence else (None, None)
        if not isinstance(blob, bytes) or parts is None or digest(blob) != st.inputs.get(claim.target):
            return {**found, "evidence": "unusable"}  # as the verdict finds it: not the target's committed parts and inputs
        try:
            return {**found, **self.inputs.explain(claim.target, st.step, blob, parts, st.bounds)}
        except (PhalanxError, IndexError, KeyError, TypeError, ValueError, RuntimeError) as exc:  # a liar's evidence
            return {**found, "evidence": f"unusable ({type(exc).__name__})"}

    async def record(self, peer: str, step: int, reason: str, retired: bool) -> None:
        """A departure settled in this replica's ledger: an event; a retired one is also reported and routed around."""
        node = self.node
        node.on_event({"kind": "retire" if retired else "depart", "peer": peer, "step": step, "reason": reason,
                       "by": node.me, "stage": node.stage, "t0": node.now(), "t1": node.now()})
        if retired:
            await self.report(peer, step)

    async def report(self, peer: str, step: int) -> None:
        """Tell every node that `peer` is out of this stage's ledger; route around it."""
        node = self.node
        body = encode({"peer": peer, "it": step, "stage": node.stage})
        for other in sorted(node.directory):
            if other != node.me:
                await node.transport.send(other, STAGE_BAN, body)
        if peer != node.me:
            exclude(node, peer)

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
        if node.directory.get(sender) != stage or node.directory.get(peer, stage) != stage or stage < 1:
            return  # not a replica of the stage it reports on (or a view that lags): proves nothing
        # (a banned peer that is asking to join again is in no stage here: the report still counts)
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
    version: int  # the replica's version when it kept them (the weights are those of `it` only if it equals `it`)


class StageInputs:
    """The inputs a replica's stage gradient is recomputed from (SecureRound's InputsHook; module docstring)."""

    def __init__(self, node: PipelineNode, timeout: float) -> None:
        self.node = node
        self.timeout = timeout
        self.mine: dict[int, bytes] = {}  # iteration -> my committed inputs (encoded records)
        self.kept: dict[int, _Iteration] = {}
        # (target, iteration, digest of its inputs) -> its recomputed microbatch gradients, for `explain`
        self.explained: dict[tuple[str, int, bytes], list[tuple[m.Key, torch.Tensor]] | None] = {}
        node.transport.add_request_handler(STAGE_INPUTS, self._serve)

    @property
    def departure_wait(self) -> float:
        """The timeout, or the transport's failure detection where that is longer (over hivemind a dead peer's
        membership record outlives it by up to its ttl)."""
        return max(self.timeout, self.node.transport.failure_detection)

    def record(self, it: int, group: list[str]) -> None:
        """Before iteration `it`'s round (weights not yet stepped): keep its weights and BEGIN, encode my inputs."""
        node = self.node
        paths = {k: tuple(p) for k, p in node.finished_paths.items() if len(p) > node.stage}
        work = sum(1 for p in paths.values() if p[node.stage] in group)
        self.kept[it] = _Iteration(copy.deepcopy(node.part), paths, len(group), work, node.version)
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
        for old in [k for k in self.explained if k[1] <= it - KEPT_ITERATIONS]:
            del self.explained[old]

    def commitment(self, step: int) -> bytes:
        return digest(self.mine[step])

    async def _serve(self, sender: str, payload: bytes) -> bytes:
        obj = m.parse_mapping(payload, sender, self.node.transport.limits, "inputs request")
        it = obj.get("it")
        if type(it) is not int:
            raise RemoteError(Evidence(sender, "malformed", "bad inputs request"))
        node = self.node
        fresh = not node.entered or node.serving_from > it  # a process that restarted since `it`: it holds nothing of it
        return encode({"it": it, "inputs": self.mine.get(it), "fresh": fresh})

    async def fetch(self, target: str, step: int, committed: bytes) -> bytes | None:
        """The target's inputs of `step` if they match its commitment (None otherwise: the validator
        eliminates it); DEPARTED_INPUTS when the target departed without giving them: it left the
        membership view, or says it is a fresh process that entered after `step` (`recompute` then
        cannot judge; the target is retired when it departs, `StageAdmission`). The device is charged
        for the recomputation that follows (a forward and a backward per microbatch)."""
        node = self.node
        # a target that already left my view is asked briefly (it may only look gone to me), not for the whole timeout
        timeout = self.timeout if target in node.transport.members() else self.timeout / 10
        try:
            answer = decode(await node.transport.request(target, STAGE_INPUTS, encode({"it": step}), timeout),
                            target, node.transport.limits)
        except RemoteError as exc:
            node.transport.report(exc.evidence)
            return None
        except PhalanxError:
            return DEPARTED_INPUTS if await self._departs(target) else None
        blob = answer.get("inputs") if isinstance(answer, dict) else None
        if blob is None and isinstance(answer, dict) and answer.get("fresh") is True:
            return DEPARTED_INPUTS  # it crashed and came back as a fresh process: a departure
        if not isinstance(blob, bytes) or digest(blob) != committed:
            return None
        kept = self.kept.get(step)
        served = sum(1 for p in kept.paths.values() if p[node.stage] == target) if kept is not None else 0
        async with node.compute_lock:
            await node.transport.charge_compute(3 * served * node.staged.forward_flops[node.stage] * node.config.flops_scale)
        return blob

    async def _departs(self, target: str) -> bool:
        """Whether a target that did not answer leaves the membership view within the timeout, or within
        the transport's failure detection where that is longer (over hivemind, a dead peer's membership
        record outlives it), rather than staying and withholding its inputs."""
        node = self.node
        deadline = node.now() + self.departure_wait
        while target in node.transport.members():
            if node.now() >= deadline:
                return False
            await asyncio.sleep(self.timeout / 10)
        return True

    def recompute(self, target: str, step: int, inputs: bytes) -> torch.Tensor | None:
        """The target's stage vector of `step` recomputed from its committed inputs; None when the inputs
        prove a lie: not the microbatches BEGIN says it served, a tensor of the wrong shape, or a seal that
        is not its sender's. Raises CannotJudge when this replica cannot judge: it kept no weights of `step`
        (none, or those of another version), or the target departed without giving its inputs (DEPARTED_INPUTS)."""
        grads = self._microbatch_grads(target, step, inputs)
        if grads is None:
            return None
        kept = self.kept[step]
        total = torch.zeros(sum(p.numel() for p in kept.part.parameters()))
        for _, grad in grads:
            total += grad
        return contribution(total, kept.work, kept.replicas)

    def _microbatch_grads(self, target: str, step: int, inputs: bytes) -> list[tuple[m.Key, torch.Tensor]] | None:
        """`recompute`'s work: the target's gradient of each microbatch it served at `step`, in key order."""
        node, stage = self.node, self.node.stage
        kept = self.kept.get(step)
        if inputs == DEPARTED_INPUTS or kept is None or kept.version != step:
            # the target left without its inputs, or I hold no weights of `step`: a replica behind at `step` (a
            # joiner that had not caught up) recomputed with older weights and accused honest replicas (issue 18)
            raise CannotJudge(target)
        records = decode(inputs, target, node.transport.limits)
        expected = sorted(k for k, p in kept.paths.items() if p[stage] == target)
        if not isinstance(records, list) or len(records) != len(expected):
            return None
        params = list(kept.part.parameters())
        grads = []
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
                grads.append((key, flat(list(torch.autograd.grad(kept.part(xin), params, g, allow_unused=True)), params)))
        return grads

    def explain(self, target: str, step: int, inputs: bytes, parts: dict[int, torch.Tensor],
                bounds: list[tuple[int, int]]) -> dict:
        """How the target's committed parts differ from this replica's recomputation from `inputs` (the
        detail of a stage-gradient claim; the verdict itself is BTARD's `parts_guilty`)."""
        kept = self.kept.get(step)
        if kept is None or kept.version != step or inputs == DEPARTED_INPUTS:
            why = "departed" if inputs == DEPARTED_INPUTS else "no weights of that iteration kept here"
            return {"judged": False, "why": why, **({"version": kept.version} if kept is not None else {})}
        context = {"weights": _weights_digest(kept.part), "version": kept.version, "work": kept.work,
                   "replicas": kept.replicas}
        key = (target, step, digest(inputs))
        if key not in self.explained:
            self.explained[key] = self._microbatch_grads(target, step, inputs)
        grads = self.explained[key]
        if grads is None:
            return {**context, "judged": False, "why": "the inputs prove a lie by themselves"}
        return {**context, **gradient_gap(grads, kept.work, kept.replicas, parts, bounds,
                                          [(name, p.numel()) for name, p in kept.part.named_parameters()])}


def gradient_gap(grads: list[tuple[m.Key, torch.Tensor]], work: int, replicas: int, parts: dict[int, torch.Tensor],
                 bounds: list[tuple[int, int]], tensors: list[tuple[str, int]], top: int = 3) -> dict:
    """Committed parts against the stage vector recomputed from per-microbatch gradients `grads`: the gap
    (L2, over the parts at hand) and BTARD's tolerance for it (GRAD_RTOL of the whole recomputed norm plus
    GRAD_ATOL per coordinate, as `gradient_matches`), the max abs difference overall, per partition and for
    the `top` parameter tensors (`tensors`: name and size, in vector order), the committed/recomputed ratio
    (a scale lie or a different work count shows as a ratio off 1), and for each microbatch its share of the
    difference: `fit` (the difference's coefficient along that microbatch's vector: 1 or -1 when it is one
    microbatch too many or too few) and `cos`."""
    scale = replicas / work if work else 0.0
    vectors = [(k, (g * scale).to(torch.float64)) for k, g in grads]
    total = torch.zeros(sum(n for _, n in tensors))
    for _, g in grads:  # as `recompute` sums them
        total += g
    whole = contribution(total, work, replicas).to(torch.float64)
    held = sorted(parts)
    index = torch.cat([torch.arange(*bounds[j]) for j in held])
    diff = torch.cat([parts[j].to(torch.float64) for j in held]) - whole[index]
    recomputed = whole[index]
    gap = float(diff.norm())
    out: dict = {
        "gap": gap, "tolerance": GRAD_RTOL * float(whole.norm()) + GRAD_ATOL * whole.numel() ** 0.5,
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "norm": float(whole.norm()), "committed_norm": float((diff + recomputed).norm()),
        "ratio": float((diff + recomputed) @ recomputed / (recomputed @ recomputed)) if float(recomputed.norm()) else None,
        "partitions": [], "tensors": [], "microbatches": [],
    }
    offset = 0
    for j in held:
        a, b = bounds[j]
        d = diff[offset: offset + b - a]
        out["partitions"].append({"j": j, "max_abs": float(d.abs().max()) if d.numel() else 0.0, "gap": float(d.norm())})
        offset += b - a
    full = torch.full((whole.numel(),), float("nan"), dtype=torch.float64)  # the difference where a part is at hand
    full[index] = diff
    start = 0
    per_tensor = []
    for name, size in tensors:
        d = full[start: start + size]
        d = d[~torch.isnan(d)]
        if d.numel():
            per_tensor.append({"name": name, "max_abs": float(d.abs().max()), "gap": float(d.norm())})
        start += size
    out["tensors"] = sorted(per_tensor, key=lambda t: -t["max_abs"])[:top]
    for key, vector in vectors:
        v = vector[index]
        norm2 = float(v @ v)
        fit = float(diff @ v) / norm2 if norm2 else None
        cos = float(diff @ v) / (gap * norm2 ** 0.5) if norm2 and gap else None
        out["microbatches"].append({"key": [key[0][:8], key[1], key[2]], "norm": norm2 ** 0.5, "fit": fit, "cos": cos})
    return out


def _weights_digest(part: torch.nn.Module) -> str:
    """sha256 prefix of a stage's parameters (as the launch's `final` rows digest them)."""
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in part.parameters())).hexdigest()[:16]


def _sealed(node: PipelineNode, direction: str, c: m.Carry, sender: str) -> bool:
    return c.seal is not None and c.seal.valid(c.key, c.it, direction, c.stage, c.tensor) and (
        c.seal.signer in node.sealers(direction, c, sender))
