"""BTARD's secure all-reduce round for one data-parallel peer (Alg. 5-7, App. B, D.3).

One call per step, with the candidates (the unbanned members in this peer's view).
The critical path has one synchronisation before aggregation (App. B):

0. join: a signed, empty join per step; the step's group G is every unbanned
   peer whose join reached me (directly or through relays) by the deadline, so
   a membership view that lags does not split honest peers. The join for step
   k + 1 is broadcast during step k's scatter, so this wait is normally over
   before it starts.
1. commit: broadcast signed hashes of each part g_i(j) and of the whole g_i
   (the hash of the part hashes), immediately followed by the parts: an owner
   uses a part only once it holds the sender's commitment, so commitments need
   no round of their own. An owner aggregates the parts of the owners whose
   commitment it holds by its deadline.
2. scatter: the owner checks each part against its commitment: missing or
   mismatching -> ELIMINATE(owner, sender); matching but NaN/Inf, wrong shape
   or dtype -> ACCUSE with the part as proof.
3. reduce: the owner runs the configured rule (CenteredClip), broadcasts the
   hash of the result with its declaration (the parts it used, and the owners
   it dropped and why), then sends the result; receivers check it the same
   way. What a partition must aggregate is never the owner's word: it is every
   owner whose commitment is in the agreed set (step 6) less the owner's
   drops, and each drop of a committed owner is the dropper's ELIMINATE (a
   commitment that reached the owner late included: lateness is unprovable,
   so it is priced like a missing part). The step's result (the SGD update) is
   returned as soon as the aggregates are gathered and hash-checked.

Verification runs in the background while the next step computes and
all-reduces (App. B, the second synchronisation point):

4. MPRNG commits during the scatter and reveals once every aggregate
   commitment is in (r must not be known before them); r gives the direction
   z (Verification 2) and m validator/target pairs.
5. meta: each contributor broadcasts norm_ij and s_ij for every partition
   that did not drop it. Owners run V1 and V2 on their contributors; V3 flags trigger CHECKAVERAGING. Validators recompute their target's
   gradient from the public batch at that step's parameters; if its hashes
   equal the commitment (same build: bit-identical) nothing is fetched,
   otherwise they fetch the committed parts from the owners that aggregated
   them (the target only for parts nobody else holds) and compare within
   GRAD_RTOL; then they check its norms and inner products (Alg. 7). The
   validator/target pairs are drawn from the step's roles, not from the
   commitments that reached each peer.
6. report: each peer broadcasts its claims (ACCUSE with evidence, ELIMINATE),
   approvals and seen-set digests of the commitments, aggregate commitments
   and metadata it holds; each peer fetches what others hold and it lacks
   (split views become equivocation proofs) and only then runs the checks
   that decide on sets: every declaration against the agreed contributors,
   and Σ_i s_i^j = 0 over every agreed contributor of every partition.

Step k's claims are resolved in one canonical order (`algorithms.btard.checks.resolve`)
at the end of step k + 1's all-reduce (`settle`), on every honest peer at the
same point: step k + 1's group was fixed before those bans, step k + 2's after.
What an attacker gains from this one-step delay: a peer caught at step k still
contributes to step k + 1 (its step-k contribution was applied in any case:
bans never roll an update back). So each Byzantine gets at most one more step
before removal, once per identity, and what it does in that step is bounded as
any other step: CenteredClip bounds a gradient attack's shift of each
partition by tau·b/n, a malformed or uncommitted part or aggregate is left out
(a missing slice is zero), and its step-(k+1) messages are verified too. The
paper makes the same trade (App. B: checks run while peers compute the next
step). With `btard.background=false` each step's verification and bans happen
before its SGD step (the baseline for the overhead benchmark).

Admission (App. F), when `admission` is set: only the trusted members
(`Roles.owners`) own partitions and have their parts aggregated; untrusted
members commit their gradient, may be drawn as validation targets (never as
validators), and receive the aggregate; their ELIMINATE claims are ignored
(a cheap identity must not be able to remove a trusted one with it); queued
members only receive the aggregate. A step's approvals reach admission when
its verification is settled (`AdmissionHook.settle`), with the members that
departed: trusted ones without an agreed commitment, and those silent through
the verification (no report anywhere), whose omission claims then ban nobody.

Protocol messages a peer gets wrong never raise: they become claims.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from ...algorithms.btard.admission import Roles
from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger, BanRecord
from ...algorithms.btard.checks import (
    ACCUSE,
    ELIMINATE,
    Claim,
    Verdict,
    averaging_matches,
    direction,
    gradient_hash,
    gradient_matches,
    norm_matches,
    project,
    resolve,
    s_matches,
    sum_holds,
    sum_tolerance,
    tensor_hash,
    v3_flags,
)
from ...algorithms.btard.mprng import choose
from ...core.envelope import SignedEnvelope
from ...core.errors import ConfigError, Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ...transport.base import BROADCAST_TOPIC, Transport
from .btard_messages import (
    commit_in,
    decoded,
    group_in,
    malformed_part,
    meta_in,
    parts_in,
    rcommit_in,
    report_in,
)
from .butterfly import (
    PART,
    REDUCED,
    AllReduceConfig,
    AllReduceResult,
    ButterflyAllReduce,
    group_digest,
    part_bounds,
)
from .mprng import MPRNGConfig, MPRNGFailed, run_mprng

log = logging.getLogger(__name__)

META_REASONS = ("v1_norm", "v2_s", "no_meta")
HANDLED_EVIDENCE = ("wrong_shape", "wrong_dtype", "non_finite", "equivocation", "no_reveal", "bad_reveal")
SECURE_REDUCERS = ("centered_clip", "mean")
DERIVED_REASONS = ("equivocation", "not_validating", "v2_sum", "averaging", "no_reveal", "bad_reveal", "declaration")  # accuser "" only
SEEN_TOPICS = ("bt.commit", "bt.rcommit", "bt.meta")  # what honest peers exchange seen-set digests of before deciding
# Faults that are only an absence. With admission (App. F) a member that is silent through the step's
# verification (no report reached anyone) departs instead of being banned for them: a crash is not a
# lie, and the identity loses its trust (it comes back through admission); nobody who eliminated it pays.
OMISSION_REASONS = ("no_reveal", "not_validating", "no_meta", "missing_part", "missing_aggregate", "late_commit")


@dataclass(frozen=True)
class BTARDConfig:
    enabled: bool = False  # run the secure round instead of plain butterfly all-reduce
    validators: int = 1  # m: validator/target pairs drawn per step
    timeout: float = 5.0  # seconds per broadcast phase (commitments, metadata, reports)
    delta_max: float = float("inf")  # V3 threshold on ||g_i(j) - ĝ(j)|| (inf: V3 never fires)
    bans: bool = True  # False: claims are resolved but nobody is banned (a benchmark baseline)
    background: bool = True  # verify step k while step k + 1 runs, its bans at the end of step k + 1's all-reduce (App. B); False: before k's SGD step
    # T of App. F: approved gradients a peer that joins mid-run needs before it is trusted (0: trusted at once).
    # 10: with m validators and n trusted peers a joiner is a target with probability ~m/(n+1-m) per step, so
    # it stays out of the average ~75 steps under btard-digits (16 peers, m=2): about 3x the ~25 steps a digits
    # run needed to recover after its last sign-flip ban (issue-6 bench), the paper's rule for T; and a Sybil
    # that splits one device between two identities gets both trusted with probability 2^-9 (App. F, eq. 77).
    admission_after: int = 10

    def __post_init__(self) -> None:
        if self.validators < 0:
            raise ConfigError(f"btard.validators={self.validators} must be >= 0")
        if not 0 < self.timeout < float("inf"):
            raise ConfigError(f"btard.timeout={self.timeout!r} must be a finite number > 0")
        if not self.delta_max > 0:
            raise ConfigError(f"btard.delta_max={self.delta_max!r} must be > 0 (inf: V3 off)")
        if self.admission_after < 0:
            raise ConfigError(f"btard.admission_after={self.admission_after} must be >= 0 (0: joiners are trusted at once)")


@dataclass(frozen=True)
class SecureResult(AllReduceResult):
    bans: tuple[BanRecord, ...] = ()  # bans that took effect since the previous result (verifications of earlier steps)


class InputsHook(Protocol):
    """How a member's gradient is recomputed when it is not a function of public data (a pipeline
    stage's: it depends on the activations and output gradients other relays sent it, issue 18 item 2).

    Each member commits, beside its gradient, to the digest of its inputs (signed by their senders);
    a validator fetches them from the target and recomputes; every peer judges an accusation by
    recomputing from the inputs carried as its evidence.
    """

    def commitment(self, step: int) -> bytes: ...

    async def fetch(self, target: str, step: int, committed: bytes) -> bytes | None: ...

    def recompute(self, target: str, step: int, inputs: bytes) -> torch.Tensor | None: ...


class AdmissionHook(Protocol):
    """What the round asks of admission (App. F): who does what in a step, and whom its verification approved."""

    async def roles(self, step: int, group: list[str]) -> Roles: ...

    async def settle(self, step: int, approved: tuple[str, ...], departed: tuple[str, ...] = ()) -> None: ...

    def checkpoint_state(self) -> dict: ...

    def load_checkpoint_state(self, saved: dict) -> None: ...


@dataclass
class _Step:
    """Everything one step's checks and verdicts read."""

    step: int
    group: list[str]  # the partition owners (the whole group unless admission says otherwise)
    bounds: list[tuple[int, int]]
    g: bytes = b""  # digest of the whole group, named by every signed payload of the step
    members: list[str] = field(default_factory=list)  # the whole group
    committers: list[str] = field(default_factory=list)  # owners and untrusted members
    commits: dict[str, tuple[list[bytes], bytes]] = field(default_factory=dict)
    rcommits: dict[str, tuple[bytes, list[str], dict[str, str]]] = field(default_factory=dict)  # owner -> (hash, from, drop)
    inputs: dict[str, bytes] = field(default_factory=dict)  # committer -> digest of its committed inputs (InputsHook)
    aggregates: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, tuple[dict, dict]] = field(default_factory=dict)
    z: torch.Tensor | None = None
    z64: torch.Tensor | None = None
    pairs: list[tuple[str, str]] = field(default_factory=list)
    reports: dict[str, dict] = field(default_factory=dict)
    sum_failed: set[str] = field(default_factory=set)
    declaration_failed: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    filled: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # metadata recomputed for contributors that sent none  # members whose report for the step nobody holds
    averaging: dict[str, bool] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)  # this peer's own claims, reported in step 6

    def slice(self, owner: str) -> slice:
        a, b = self.bounds[self.group.index(owner)]
        return slice(a, b)


class SecureRound(ButterflyAllReduce):
    """One peer's side of BTARD; `await round(step, gradient, group)` once per step."""

    def __init__(
        self,
        transport: Transport,
        dim: int,
        allreduce: AllReduceConfig,
        config: BTARDConfig,
        ledger: BanLedger,
        recompute: Callable[[str, int], torch.Tensor] | None,
        policy: ProtocolPolicy | None = None,
        mprng: MPRNGConfig = MPRNGConfig(),
        entropy: Callable[[int], bytes] = secrets.token_bytes,
        agreed_candidates: bool = False,
        inputs: InputsHook | None = None,
    ) -> None:
        if allreduce.reducer not in SECURE_REDUCERS:
            raise ConfigError(f"allreduce.reducer={allreduce.reducer!r} cannot be verified by BTARD; use one of {', '.join(SECURE_REDUCERS)}")
        super().__init__(transport, dim, allreduce.build_reducer(), allreduce)
        self.btard = config
        self.tau = allreduce.tau if allreduce.reducer == "centered_clip" else float("inf")
        self.eps = allreduce.eps
        self.ledger = ledger
        # None: nobody can recompute a member's gradient (a pipeline stage's depends on what other
        # relays sent it): no validators are drawn, no metadata is filled in, no gradient claim holds.
        self.recompute = recompute
        # Set (with recompute=None): a member's gradient is recomputed from inputs it committed to.
        self.inputs = inputs
        # True: the caller's candidates are agreed by every honest member (a pipeline's BEGIN), so the
        # step's group is the candidates whose join arrived, never a peer outside them.
        self.agreed_candidates = agreed_candidates
        self.policy = policy or ProtocolPolicy()
        self.mprng = mprng
        self.entropy = entropy
        self._grads: dict[int, torch.Tensor] = {}
        self._used: dict[int, dict[str, torch.Tensor]] = {}
        self._evidence: list[Evidence] = []
        self._joined: set[int] = set()  # steps whose join this peer already broadcast
        self._pending: dict[int, tuple[_Step, asyncio.Future]] = {}  # step -> its verification, not yet resolved
        self._unreported: list[BanRecord] = []
        self._edge: asyncio.Future | None = None  # a deadline_edge attacker's delayed broadcast (kept referenced)
        self.admission: AdmissionHook | None = None  # App. F; None: every member is trusted
        transport.add_request_handler("bt.grad", self._on_grad)
        transport.add_request_handler("bt.parts", self._on_parts)
        transport.add_request_handler("bt.part", self._on_part_request)
        transport.on_evidence(lambda ev: self._evidence.append(ev))

    # --- the round -------------------------------------------------------------

    async def __call__(self, step: int, vector: torch.Tensor, group: list[str]) -> SecureResult:
        tr, me = self.transport, self.transport.peer_id
        if me not in group:
            raise PhalanxError(f"peer {me[:8]} is not in its own BTARD group; pass a group that includes it")
        if self.ledger.is_banned(me):
            raise PhalanxError(f"peer {me[:8]} is banned in its own ledger: it takes no further BTARD step")
        # 0. the step's group: every unbanned peer whose signed join for this step reached me
        # directly or through a relay, so that a lagging membership view does not split the group.
        # Joins for step k + 1 are sent during step k, so this wait is normally already over.
        if step not in self._joined:
            await tr.broadcast("bt.join", step, b"")
        self._joined = {s for s in self._joined if s > step}
        await tr.collect_broadcasts("bt.join", step, group, self.btard.timeout, relays=len(group))
        joined = set(tr.board.get("bt.join", step)) | {me}
        if self.agreed_candidates:
            joined &= set(group)
        group = sorted(p for p in joined if not self.ledger.is_banned(p))
        g = group_digest(group)
        self._begin(step, g)
        for table in (self._grads, self._used):
            for key in [k for k in table if k < step - 2]:
                del table[key]
        roles = await self.admission.roles(step, group) if self.admission is not None else Roles(tuple(group), tuple(group))
        owners, committers = list(roles.owners), list(roles.committers)
        st = _Step(step, owners, part_bounds(self.dim, len(owners)) if owners else [], g, list(group), committers)
        if not owners:  # nobody trusted in view: nothing can be aggregated this step
            return await self._unaggregated(st)
        index = owners.index(me) if me in owners else None
        # MPRNG commits now, alongside the scatter, and reveals once every aggregate commitment is in
        # (App. B: r must not be known before them); it runs on into the background verification.
        rcommitted = asyncio.Event()
        draw = asyncio.ensure_future(self._draw(step, group, rcommitted.wait))
        claims = st.claims
        committed = self.policy.committed_gradient(step, vector.detach().reshape(-1).to(torch.float32))
        parts = [committed[a:b] for a, b in st.bounds]
        hashes = [tensor_hash(p) for p in parts]
        self._grads[step] = committed

        # 1. commitments, broadcast just before the parts they bind: an owner uses a part only once
        # it holds the sender's commitment, so the commitment needs no round of its own (App. B: one
        # synchronisation before aggregation). Each names the group its sender settled on: another
        # group is a view mismatch, which excludes the sender from my step but proves nothing.
        # A queued member commits nothing.
        bound = {"inputs": self.inputs.commitment(step)} if self.inputs is not None and me in committers else {}
        payload = encode({"g": g, "parts": hashes, "whole": gradient_hash(hashes), **bound})
        if me in committers and self.policy.equivocate(step):
            negated = [tensor_hash(-p) for p in parts]
            await self._split_broadcast("bt.commit", step, payload, encode({"g": g, "parts": negated, "whole": gradient_hash(negated), **bound}))
        elif me in committers and self.policy.deadline_edge(step):
            self._edge = asyncio.ensure_future(self._edge_broadcast("bt.commit", step, payload, self.btard.timeout))
            st.commits[me] = (hashes, gradient_hash(hashes))  # it knows its own commitment: it goes on as a contributor
            st.inputs.update({me: bound["inputs"]} if bound else {})
        elif me in committers:
            await tr.broadcast("bt.commit", step, payload)

        # 2. scatter, then check each part against its commitment (owners only: untrusted and
        # queued members send no parts and reduce no partition)
        if index is not None:
            sent = {owner: self.policy.part_for(step, owner, parts[j], owners) for j, owner in enumerate(owners)}
            self._publish(step, PART, {o: t for o, t in sent.items() if t is not None})
            for owner, tensor in sent.items():
                if owner != me and tensor is not None:
                    await tr.send(owner, "ar.part", encode({"step": step, "g": g, "t": tensor}))
        await tr.broadcast("bt.join", step + 1, b"")
        self._joined.add(step + 1)
        lo, hi = st.bounds[index] if index is not None else (0, 0)
        envelopes, valid = await asyncio.gather(
            tr.collect_broadcasts("bt.commit", step, committers, self.btard.timeout, relays=len(group)),
            self._collect(step, PART, {p: (hi - lo,) for p in owners if p != me} if index is not None else {}),
        )
        for peer, env in envelopes.items():
            obj = decoded(env.payload, peer, tr)
            if group_in(obj) != g:
                continue
            parsed = commit_in(obj, len(owners))
            if parsed is None:
                claims.append(Claim(ACCUSE, me, peer, "bad_commit", (env.to_bytes(),)))
            else:
                st.commits[peer] = parsed
                _take_inputs(st, peer, obj)
        contributors_all = [p for p in committers if p in st.commits]
        trusted = [p for p in contributors_all if p in owners]  # contributors whose parts are aggregated
        rows, used = [], []
        dropped: dict[str, str] = {}
        received: dict[str, torch.Tensor] = {}
        mine = None
        if index is not None:
            box = self._inbox.get((step, PART), {})
            for peer in trusted:
                if peer == me:
                    if parts[index].shape == (hi - lo,):
                        rows.append(parts[index])
                        used.append(me)
                    continue
                held = box.get(peer)
                raw = held[0] if held is not None and held[1] == g else None
                if raw is None:
                    dropped[peer] = "missing_part"
                elif tensor_hash(raw) != st.commits[peer][0][index]:
                    dropped[peer] = "part_hash"
                elif peer not in valid:
                    dropped[peer] = "bad_part"
                    claims.append(Claim(ACCUSE, me, peer, "bad_part", (index, raw)))
                else:
                    rows.append(valid[peer])
                    used.append(peer)
            claims += [Claim(ELIMINATE, me, peer, reason) for peer, reason in dropped.items() if reason != "bad_part"]
            # An owner whose commitment did not reach me in time: its part is not mine to use. If any
            # honest peer holds that commitment, my drop becomes an ELIMINATE (see `_agreed_claims`).
            dropped.update({peer: "late_commit" for peer in owners if peer not in used and peer not in dropped})

            # 3. reduce, commit the aggregate with what the protocol fixes (the parts it used, and
            # the owners it drops, each drop a claim), send it (to every member, untrusted and queued too)
            received = dict(zip(used, rows))
            kept = self.policy.aggregated(step, used)
            rows = [received[peer] for peer in used if peer in kept]
            aggregate = self.reducer(torch.stack(rows)).to(torch.float32) if rows else torch.zeros(hi - lo)
            mine, sent_aggregate = self.policy.aggregate(step, aggregate)
            declared, drop = self.policy.declare(step, used, dropped, owners)
            payload = encode({"g": g, "h": tensor_hash(mine), "from": declared, "drop": drop})
            other = self.policy.other_declaration(step, used, dropped, owners)
            if other is not None:
                await self._split_broadcast("bt.rcommit", step, payload, encode({"g": g, "h": tensor_hash(mine), "from": other[0], "drop": other[1]}))
            else:
                await tr.broadcast("bt.rcommit", step, payload)
            self._publish(step, REDUCED, {peer: sent_aggregate for peer in group})
            message = encode({"step": step, "g": g, "t": sent_aggregate})
            for peer in group:
                if peer != me:
                    await tr.send(peer, "ar.reduced", message)
        self._used[step] = received

        # 4. gather the aggregates while their commitments arrive; once they are in, MPRNG may reveal.
        # An honest owner may have waited the whole scatter timeout for a silent sender before committing.
        async def aggregate_commitments():
            held = await tr.collect_broadcasts("bt.rcommit", step, owners, self.config.timeout + self.btard.timeout, relays=len(group))
            rcommitted.set()
            return held

        others = {o: (st.slice(o).stop - st.slice(o).start,) for o in owners if o != me}
        envelopes, results = await asyncio.gather(aggregate_commitments(), self._collect(step, REDUCED, others))
        for peer, env in envelopes.items():
            obj = decoded(env.payload, peer, tr)
            if group_in(obj) != g:
                continue
            parsed = rcommit_in(obj, owners)
            if parsed is None:
                claims.append(Claim(ACCUSE, me, peer, "bad_commit", (env.to_bytes(),)))
                h = obj.get("h") if isinstance(obj, dict) else None
                if isinstance(h, bytes) and len(h) == 32:
                    # The declaration is malformed, the hash is not: the aggregate it binds is applied
                    # (and checked over every agreed contributor), so that whether a peer applies it
                    # never depends on which of two signed declarations reached it.
                    st.rcommits[peer] = (h, [], {})
            else:
                st.rcommits[peer] = parsed
        rbox = self._inbox.get((step, REDUCED), {})
        out = torch.zeros(self.dim, dtype=torch.float32)
        if mine is not None:
            st.aggregates[me] = mine
        for owner in others:
            if owner not in st.rcommits:
                continue
            held = rbox.get(owner)
            raw = held[0] if held is not None and held[1] == g else None
            if raw is None:
                claims.append(Claim(ELIMINATE, me, owner, "missing_aggregate"))
            elif tensor_hash(raw) != st.rcommits[owner][0]:
                claims.append(Claim(ELIMINATE, me, owner, "aggregate_hash"))
            elif owner not in results:
                claims.append(Claim(ACCUSE, me, owner, "bad_aggregate", (raw,)))
            else:
                st.aggregates[owner] = results[owner]
        for owner, tensor in st.aggregates.items():
            out[st.slice(owner)] = tensor

        # 5-6. verification of this step runs in the background of the next step's compute and
        # all-reduce (App. B); the previous step's verdicts are applied now (`settle`).
        self._pending[step] = (st, asyncio.ensure_future(self._verify(st, parts, draw)))
        await self.settle(step if self.btard.background else step + 1)
        bans, self._unreported = self._unreported, []
        return SecureResult(
            out,
            tuple(group),
            tuple(p for p in trusted if p != me and p not in used) if index is not None else (),
            tuple(o for o in owners if o not in st.aggregates),
            tuple(bans),
        )

    async def _unaggregated(self, st: _Step) -> SecureResult:
        """A step with no trusted member in view: no update; its (empty) verification settles like any other."""
        await self.transport.broadcast("bt.join", st.step + 1, b"")
        self._joined.add(st.step + 1)
        self._used[st.step] = {}
        nothing = asyncio.get_running_loop().create_future()
        nothing.set_result([])
        self._pending[st.step] = (st, nothing)
        await self.settle(st.step if self.btard.background else st.step + 1)
        bans, self._unreported = self._unreported, []
        return SecureResult(torch.zeros(self.dim, dtype=torch.float32), tuple(st.members), (), (), tuple(bans))

    def cancel_pending(self) -> None:
        """Cancel the verifications still running in the background, unresolved: a peer that stops
        while its group stops too (a pipeline's last iteration), so none of them sends after its transport is gone."""
        for _, task in self._pending.values():
            task.cancel()
        self._pending.clear()

    async def settle(self, step: int | None = None) -> None:
        """Resolve the pending verifications of steps before `step` (all of them when None), in step order.

        The verification of step k runs in the background and is resolved at
        the end of step k + 1's all-reduce, so that every honest peer applies
        it at the same point of its run: step k + 1's group was fixed before
        these bans, step k + 2's is fixed after them. The bans are returned
        by the round's result (or `take_bans`).
        """
        for k in sorted(k for k in self._pending if step is None or k < step):
            st, task = self._pending.pop(k)
            everyone = await task
            departed: set[str] = set()
            if self.admission is not None:
                departed = {c.target for c in everyone if c.target in st.silent and c.reason in OMISSION_REASONS}
                everyone = [c for c in everyone if c.target not in departed or c.reason not in OMISSION_REASONS]
                departed |= st.silent | {p for p in st.group if p not in st.commits}  # a trusted member that missed its commitment
            bans = resolve(self.ledger, k, everyone, lambda c, st=st: self._verdict(st, c), apply=self.btard.bans)
            if self.btard.bans:  # would-be bans of a run without bans are not bans: the ledger stays empty
                self._unreported += bans
            if self.admission is not None:
                banned = self.ledger.is_banned
                approved = {t for v, t in st.pairs if t in st.reports.get(v, {}).get("approve", []) and not banned(t) and not banned(v)}
                await self.admission.settle(k, tuple(sorted(approved)), tuple(sorted(p for p in departed if not banned(p))))

    def take_bans(self) -> list[BanRecord]:
        """Bans applied by `settle` and not yet returned by a round."""
        bans, self._unreported = self._unreported, []
        return bans

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint taken before `step` (after `settle`) keeps of this round.

        The bans `settle` applied that the next round will report, and the
        signed joins for `step` already received: joins for step k + 1 travel
        with step k's scatter, so a resumed run would otherwise pay a join
        round that the uninterrupted run did not. With admission, its state too.
        """
        saved = {
            "unreported_bans": [asdict(b) for b in self._unreported],
            "joined": step in self._joined,
            "joins": [env.to_bytes() for _, env in sorted(self.transport.board.get("bt.join", step).items())],
        }
        if self.admission is not None:
            saved["admission"] = self.admission.checkpoint_state()
        return saved

    def load_checkpoint_state(self, step: int, saved: dict) -> None:
        """Take back `checkpoint_state(step)`; the joins are verified again like any received envelope."""
        self._unreported = [BanRecord(**ban) for ban in saved["unreported_bans"]]
        if saved["joined"]:
            self._joined.add(step)
        me = self.transport.peer_id
        for data in saved["joins"]:
            self.transport.board.add(SignedEnvelope.from_bytes(data, me).verify())
        if self.admission is not None and "admission" in saved:
            self.admission.load_checkpoint_state(saved["admission"])

    async def _verify(self, st: _Step, parts: list[torch.Tensor], draw: asyncio.Future) -> list[Claim]:
        """Steps 5-6 of one step: metadata, V1-V3, validators, reports; returns every claim to resolve."""
        tr, me = self.transport, self.transport.peer_id
        step, group, g = st.step, st.members, st.g
        contributors_all = [p for p in st.committers if p in st.commits]
        # Validator/target pairs are drawn from the step's roles (fixed by the group), not from the
        # commitments that reached me by my deadline: a commitment timed at the deadline must not give
        # honest peers different pairs (and each other's validators as not_validating).
        drawn = list(st.committers)
        trusted = [p for p in drawn if p in st.group]  # validators are drawn among these (App. F)
        claims = st.claims
        approvals: list[str] = []
        unverified: list[str] = []  # targets whose parts at hand are honest, the rest held by nobody but them
        r, mprng_claims = await draw
        if r is not None:
            st.z = direction(r, self.dim)
            st.z64 = st.z.to(torch.float64)  # converted once: every projection of the step reads it
            recomputable = self.recompute is not None or self.inputs is not None
            validators = min(self.btard.validators, len(trusted) // 2) if recomputable else 0
            st.pairs = _pairs(r, trusted, drawn, validators)
            await self._send_meta(st, parts, me)
            # A peer may have waited the whole gather timeout for a silent owner's aggregate.
            wait = self.config.timeout + self.btard.timeout
            envelopes = await tr.collect_broadcasts("bt.meta", step, contributors_all, wait, relays=len(group))
            for peer, env in envelopes.items():
                parsed = meta_in(env.payload, peer, tr)
                if parsed is not None:
                    st.meta[peer] = parsed
            claims += self._owner_checks(st, me)
            await self._v3(st)
            for validator, target in st.pairs:
                if validator == me:
                    claim = await self._validate(st, target)
                    if claim is None:
                        approvals.append(target)
                    elif claim == "unverified":
                        unverified.append(target)
                    elif claim != "skip":
                        claims.append(claim)
            for target in self.policy.slander(step, [p for p in contributors_all if p != me]):
                parts = await self._committed_parts(st, target)
                evidence = tuple(sorted(parts.items(), key=lambda item: item[0]))
                if self.inputs is not None and target in st.inputs:  # its true inputs: the recomputation clears it
                    evidence = (await self.inputs.fetch(target, step, st.inputs[target]) or b"", *evidence)
                claims.append(Claim(ACCUSE, me, target, "gradient", evidence))
        mine = [ev for ev in self._evidence if ev.step is None or ev.step <= step]
        self._evidence = [ev for ev in self._evidence if not (ev.step is None or ev.step <= step)]
        for ev in mine:
            if ev.peer in group and ev.peer != me and ev.kind not in HANDLED_EVIDENCE:
                claims.append(Claim(ELIMINATE, me, ev.peer, ev.kind))

        # 6. reports, equivocation proofs; resolution happens in `settle`
        await tr.broadcast("bt.report", step, encode({
            "g": g,
            "claims": [{"kind": c.kind, "target": c.target, "reason": c.reason, "ev": list(c.evidence)} for c in claims],
            "approve": approvals,
            "unverified": unverified,
            "seen": self._seen(st),
        }))
        # A validator may have waited one timeout for a silent target and one for CHECKAVERAGING.
        envelopes = await tr.collect_broadcasts("bt.report", step, group, 3 * self.btard.timeout, relays=len(group))
        everyone: list[Claim] = list(mprng_claims)
        for peer, env in envelopes.items():
            obj = decoded(env.payload, peer, tr)
            if group_in(obj) != g:
                continue  # a peer that settled on another group judged another step: its claims do not apply here
            report = report_in(obj)
            if report is None:
                everyone.append(Claim(ACCUSE, me, peer, "bad_report", (env.to_bytes(),)))
                continue
            st.reports[peer] = report
            everyone += [
                Claim(c["kind"], peer, c["target"], c["reason"], tuple(c["ev"]))
                for c in report["claims"]
                if c["kind"] != ELIMINATE or peer in st.group  # an untrusted peer cannot eliminate
            ]
        st.silent = {p for p in group if p not in st.reports and p != me}
        await self._compare_views(st)
        equivocators = {
            proof.first.sender for proof in tr.board.proofs
            if proof.first.topic in SEEN_TOPICS and proof.first.step == step and proof.first.sender in group
        }
        everyone += [Claim(ACCUSE, "", peer, "equivocation") for peer in sorted(equivocators)]
        self._absorb(st)
        if st.z is not None:
            await self._agreed_checks(st, equivocators)
        # Failures every honest peer derives from the same broadcasts are claimed by nobody in
        # particular (accuser ""), so that agreeing peers are never banned as slanderers.
        everyone += [Claim(ACCUSE, "", o, "declaration") for o in sorted(st.declaration_failed)]
        everyone += [Claim(ACCUSE, "", o, "v2_sum") for o in st.sum_failed]
        # A committed owner's part left out: the owner's signed drop is its ELIMINATE of that owner.
        for owner, (_, _, drop) in st.rcommits.items():
            if owner not in equivocators:
                everyone += [Claim(ELIMINATE, owner, p, reason) for p, reason in drop.items() if p in st.commits and p != owner]
        everyone += [Claim(ACCUSE, "", o, "averaging") for o, ok in st.averaging.items() if not ok]
        for validator, target in st.pairs:
            report = st.reports.get(validator)
            judged = report is not None and (
                target in report["approve"] or target in report["unverified"] or any(c["target"] == target for c in report["claims"])
            )
            if not judged:
                everyone.append(Claim(ACCUSE, "", validator, "not_validating"))
        return everyone

    # --- phases ----------------------------------------------------------------

    async def _draw(self, step: int, group: list[str], before_reveal: Callable[[], Awaitable[None]]) -> tuple[bytes | None, list[Claim]]:
        """The step's MPRNG output (drawn among the step's group) and claims against its cheaters.

        Among the group, not every member: a joiner still catching up is not waited for.

        MPRNG runs on a copy of the ledger, so its bans (no reveal, bad
        reveal, equivocation: each derived from signed broadcasts every honest
        peer holds) are resolved with the step's other claims in `settle`
        instead of changing the ledger in the middle of the next step.
        """
        shadow = BanLedger()
        shadow.restore(self.ledger.records)
        before = set(shadow.banned)
        try:
            value = (await run_mprng(self.transport, shadow, step, self.mprng, self.entropy, before_reveal=before_reveal, among=group)).value
        except MPRNGFailed as exc:
            log.warning("BTARD step %d has no random value (%s): V2 and validation are skipped", step, exc)
            value = None
        return value, [Claim(ACCUSE, "", rec.peer, rec.reason) for rec in shadow.records if rec.peer not in before]

    async def _edge_broadcast(self, topic: str, step: int, payload: bytes, deadline: float) -> None:
        """A deadline_edge attacker's broadcast: signed just before the others' deadline, sent to
        half of them then, and to the other half just after it."""
        tr = self.transport
        await asyncio.sleep(0.95 * deadline)
        envelope = SignedEnvelope.create(tr.identity, topic, step, payload)
        tr.board.add(envelope)
        others = [p for p in tr.members() if p != tr.peer_id]
        for i, peer in enumerate(others):
            if i == len(others) // 2:
                await asyncio.sleep(0.1 * deadline)
            await tr.send(peer, BROADCAST_TOPIC, envelope.to_bytes())

    async def _split_broadcast(self, topic: str, step: int, first: bytes, second: bytes) -> None:
        """An equivocating peer's broadcast: `first` to itself and half of the others, `second` to the rest."""
        tr = self.transport
        a = SignedEnvelope.create(tr.identity, topic, step, first)
        b = SignedEnvelope.create(tr.identity, topic, step, second)
        tr.board.add(a)
        others = [p for p in tr.members() if p != tr.peer_id]
        for i, peer in enumerate(others):
            await tr.send(peer, BROADCAST_TOPIC, (a if i < len(others) // 2 else b).to_bytes())

    async def _send_meta(self, st: _Step, parts: list[torch.Tensor], me: str) -> None:
        norms, s = {}, {}
        for j, owner in enumerate(st.group):
            if owner in st.aggregates and me in self._contributors(st, owner):
                proj = project(parts[j], st.aggregates[owner], st.z64[st.slice(owner)], self.tau)
                norms[owner], s[owner] = proj.norm, proj.s
        norms, s = self.policy.report(st.step, norms, s)
        await self.transport.broadcast("bt.meta", st.step, encode({"norm": norms, "s": s}))

    def _contributors(self, st: _Step, owner: str) -> list[str]:
        """The parts partition `owner` must aggregate: every owner whose commitment is held, less the
        owners it dropped (each drop an ELIMINATE). Never the owner's own list of what it used."""
        drop = st.rcommits[owner][2] if owner in st.rcommits else {}
        return [p for p in st.group if p in st.commits and p not in drop]

    def _meta_lie(self, st: _Step, peer: str, owner: str, part: torch.Tensor) -> str | None:
        """Which of peer's reports about partition `owner` is false, given its part; None if both hold."""
        meta = st.meta.get(peer)
        if meta is None or owner not in meta[0] or owner not in meta[1]:
            return "no_meta"
        proj = project(part, st.aggregates[owner], st.z64[st.slice(owner)], self.tau)
        if not norm_matches(meta[0][owner], proj.norm):
            return "v1_norm"
        if not s_matches(meta[1][owner], proj, float(st.z[st.slice(owner)].norm())):
            return "v2_s"
        return None

    def _owner_checks(self, st: _Step, me: str) -> list[Claim]:
        """V1 and V2 on the parts this peer aggregated (none unless it owns a partition)."""
        if me not in st.group:
            return []
        index = st.group.index(me)
        claims = []
        contributors = self._contributors(st, me)
        for peer, part in self._used.get(st.step, {}).items():
            if peer != me and peer in contributors and (lie := self._meta_lie(st, peer, me, part)) is not None:
                claims.append(Claim(ACCUSE, me, peer, lie, (index, part)))
        return claims

    def _seen(self, st: _Step) -> dict[str, dict[str, bytes]]:
        """Digests of the step's commitments, aggregate commitments and metadata this peer holds, by topic."""
        members = set(st.members)
        return {
            topic: {peer: digest(env.payload) for peer, env in sorted(self.transport.board.get(topic, st.step).items()) if peer in members}
            for topic in SEEN_TOPICS
        }

    def _absorb(self, st: _Step) -> None:
        """Take in the signed commitments, aggregate commitments and metadata the seen-set exchange brought.

        The step's agreed contributors are every committer whose commitment (naming this step's
        group) some honest peer holds: honest peers report what they hold, so after the exchange
        each holds the union. A malformed one found this way was already claimed by whoever got it.
        """
        board, g = self.transport.board, st.g
        for peer, env in board.get("bt.commit", st.step).items():
            obj = decoded(env.payload, peer, self.transport)
            if peer in st.committers and peer not in st.commits and group_in(obj) == g and (parsed := commit_in(obj, len(st.group))):
                st.commits[peer] = parsed
                _take_inputs(st, peer, obj)
        for peer, env in board.get("bt.rcommit", st.step).items():
            obj = decoded(env.payload, peer, self.transport)
            if peer in st.group and peer not in st.rcommits and group_in(obj) == g and (parsed := rcommit_in(obj, st.group)):
                st.rcommits[peer] = parsed
        for peer, env in board.get("bt.meta", st.step).items():
            if peer in st.committers and peer not in st.meta and (parsed := meta_in(env.payload, peer, self.transport)) is not None:
                st.meta[peer] = parsed

    async def _agreed_checks(self, st: _Step, equivocators: set[str]) -> None:
        """Declaration and Σ_i s_i^j = 0 over every agreed contributor of every partition.

        An owner's declaration (the parts it used) must be exactly the agreed contributors less the
        owners it dropped; anything else is a claim against it that every honest peer derives.
        An owner that signed two declarations is left to its equivocation proof.
        """
        for owner, (_, declared, _) in st.rcommits.items():
            if owner not in equivocators and set(declared) != set(self._contributors(st, owner)):
                st.declaration_failed.add(owner)
        self._fill_missing_meta(st)
        self._sum_checks(st, equivocators | st.declaration_failed)
        for owner in sorted(st.sum_failed):
            # The owner blames a contributor's metadata (its report's V1/V2 claim): the sum cannot
            # judge the partition, so everyone reruns the owner's rule on the committed parts instead.
            if any(c["reason"] in META_REASONS for c in st.reports.get(owner, {}).get("claims", [])) and owner not in st.averaging:
                st.averaging[owner] = await self._check_averaging(st, owner)

    def _fill_missing_meta(self, st: _Step) -> None:
        """Metadata a contributor never sent (it crashed, or withholds it), recomputed where possible.

        Its minibatch is public: anyone can recompute its gradient, and a part whose hash equals the
        commitment is the committed part itself, so its norm and s are exact. Used by the Σ check
        only (the owner's V1/V2 claim about the missing report is judged on what was sent).
        """
        if self.recompute is None:
            return  # a missing report is left to the owners' no_meta claims
        for peer in sorted(st.commits):
            owners = [o for o in st.aggregates if peer in self._contributors(st, o) and o not in st.meta.get(peer, ({}, {}))[1]]
            if not owners:
                continue
            recomputed = self.recompute(peer, st.step).reshape(-1).to(torch.float32)
            for owner in owners:
                j, sl = st.group.index(owner), st.slice(owner)
                if tensor_hash(recomputed[sl].contiguous()) == st.commits[peer][0][j]:
                    proj = project(recomputed[sl], st.aggregates[owner], st.z64[sl], self.tau)
                    norms, s = st.filled.setdefault(peer, ({}, {}))
                    norms[owner], s[owner] = proj.norm, proj.s

    def _sum_checks(self, st: _Step, skip: set[str]) -> None:
        """Owners whose partition fails Σ_i s_i^j = 0 (everyone checks every partition it holds)."""
        failed = []
        for owner, aggregate in st.aggregates.items():
            if owner in skip:
                continue
            contributors = self._contributors(st, owner)
            if not contributors:  # nothing to aggregate: the only honest aggregate is zero
                if bool(aggregate.any()):
                    failed.append(owner)
                continue
            s_values, deltas = [], []
            for peer in contributors:
                meta = st.meta.get(peer)
                if (meta is None or owner not in meta[1]) and owner in st.filled.get(peer, ({}, {}))[1]:
                    meta = st.filled[peer]
                s_values.append(meta[1].get(owner, math.nan) if meta else math.nan)
                deltas.append(min(meta[0].get(owner, math.inf), self.tau) if meta else math.inf)
            z = st.z[st.slice(owner)]
            tolerance = sum_tolerance(len(contributors), self.eps, float(aggregate.norm()), float(z.norm()), deltas)
            if not sum_holds(s_values, tolerance):
                failed.append(owner)
        st.sum_failed = set(failed)

    async def _v3(self, st: _Step) -> None:
        """V3: run CHECKAVERAGING on partitions where over half the reported norms exceed Δ_max."""
        for owner in st.aggregates:
            contributors = self._contributors(st, owner)
            norms = [st.meta[p][0].get(owner, math.inf) for p in contributors if p in st.meta]
            if contributors and v3_flags(norms, self.btard.delta_max) > len(contributors) / 2:
                st.averaging[owner] = await self._check_averaging(st, owner)

    async def _check_averaging(self, st: _Step, owner: str) -> bool:
        """CHECKAVERAGING(j): fetch the committed parts the owner used, rerun its rule, compare."""
        contributors = self._contributors(st, owner)
        j = st.group.index(owner)
        if owner == self.transport.peer_id:
            parts = self._used.get(st.step, {})
        else:
            try:
                answer = decode(await self.transport.request(owner, "bt.parts", encode({"step": st.step}), self.btard.timeout), owner, self.transport.limits)
                parts = answer.get("parts") if isinstance(answer, dict) else None
            except PhalanxError:
                parts = None
        if not isinstance(parts, dict):
            return False
        rows = []
        for peer in contributors:
            part = parts.get(peer)
            if not isinstance(part, torch.Tensor) or peer not in st.commits or not self._committed_part(st, peer, j, part):
                return False
            rows.append(part)
        recomputed = self.reducer(torch.stack(rows)).to(torch.float32)
        return averaging_matches(st.aggregates[owner], recomputed, self.eps)

    async def _ask(self, peer: str, topic: str, query: dict) -> dict | None:
        """One verification request; a peer that answers badly is reported, one that does not is None."""
        try:
            answer = decode(await self.transport.request(peer, topic, encode(query), self.btard.timeout), peer, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
            return None
        except PhalanxError:
            return None
        return answer if isinstance(answer, dict) else None

    async def _committed_parts(self, st: _Step, target: str) -> dict[int, torch.Tensor]:
        """The target's committed parts that can be had, each checked against its part hash.

        From the owners that aggregated them (this peer first), so that a target that will not send
        its gradient still leaves the evidence its owners hold; the target is asked only for the
        parts nobody else holds (its own partition, or every part of an untrusted target).
        """
        me = self.transport.peer_id
        if target not in st.commits:
            return {}
        hashes = st.commits[target][0]
        found: dict[int, torch.Tensor] = {}

        def take(j: int, part) -> None:
            a, b = st.bounds[j]
            if isinstance(part, torch.Tensor) and part.dtype == torch.float32 and tuple(part.shape) == (b - a,) and tensor_hash(part) == hashes[j]:
                found[j] = part

        holders = [(j, o) for j, o in enumerate(st.group) if o != target and target in self._contributors(st, o)]
        for j, owner in holders:
            if owner == me:
                take(j, self._used.get(st.step, {}).get(target))
        remote = [(j, o) for j, o in holders if o != me]
        answers = await asyncio.gather(*(self._ask(o, "bt.part", {"step": st.step, "peer": target}) for _, o in remote))
        for (j, _), answer in zip(remote, answers):
            take(j, answer.get("t") if answer is not None else None)
        if len(found) < len(st.bounds):
            answer = await self._ask(target, "bt.grad", {"step": st.step})
            gradient = answer.get("t") if answer is not None else None
            if isinstance(gradient, torch.Tensor) and gradient.dim() == 1 and gradient.numel() == self.dim:
                for j, (a, b) in enumerate(st.bounds):
                    if j not in found:
                        take(j, gradient[a:b].clone())
        return found

    def _committed_part(self, st: _Step, peer: str, j: int, part: torch.Tensor) -> bool:
        """Whether `part` is peer's committed part j: under the commitment I hold, or under another
        one it signed for this step and group (an equivocator's parts match either version, so that
        honest peers holding different versions judge its owners alike)."""
        h = tensor_hash(part)
        if h == st.commits[peer][0][j]:
            return True
        for proof in self.transport.board.proofs:
            if proof.first.topic == "bt.commit" and proof.first.step == st.step and proof.first.sender == peer:
                for env in (proof.first, proof.second):
                    obj = decoded(env.payload, peer, self.transport)
                    version = commit_in(obj, len(st.group)) if group_in(obj) == st.g else None
                    if version is not None and version[0][j] == h:
                        return True
        return False

    def _matches_commit(self, st: _Step, target: str, gradient) -> bool:
        """Whether `gradient` is exactly what `target` committed to (its part hashes and whole hash)."""
        if not isinstance(gradient, torch.Tensor) or target not in st.commits or gradient.dim() != 1 or gradient.numel() != self.dim:
            return False
        hashes, whole = st.commits[target]
        mine = [tensor_hash(gradient[a:b]) for a, b in st.bounds]
        return mine == hashes and gradient_hash(mine) == whole

    async def _validate(self, st: _Step, target: str) -> Claim | str | None:
        """Alg. 7: None approves the target; a claim accuses or eliminates it; 'skip' sends no verdict."""
        me = self.transport.peer_id
        decision = self.policy.validate(st.step, target)
        if decision == "approve":
            return None
        if decision == "skip":
            return "skip"
        if target not in st.commits:
            return "unverified"  # no commitment reached me: it contributed nothing I could check
        if self.inputs is not None:
            return await self._validate_from_inputs(st, target)
        recomputed = self.recompute(target, st.step).reshape(-1)
        if recomputed.dtype == torch.float32 and self._matches_commit(st, target, recomputed):
            # bit-identical to the commitment (same build): nothing to fetch
            parts = {j: recomputed[a:b] for j, (a, b) in enumerate(st.bounds)}
        else:
            parts = await self._committed_parts(st, target)
        if self._parts_guilty(st, target, parts, recomputed):
            return Claim(ACCUSE, me, target, "gradient", tuple(sorted(parts.items(), key=lambda item: item[0])))
        if len(parts) < len(st.bounds):
            return "unverified"  # what could be had is honest; the rest was aggregated by nobody else
        return None

    async def _validate_from_inputs(self, st: _Step, target: str) -> Claim | str | None:
        """Alg. 7 for a gradient that is a function of committed inputs (InputsHook): fetch them from
        the target, check them against its commitment, recompute, compare with the committed parts.

        Inputs the target will not give (or that miss its commitment) are an omission only this
        validator saw: ELIMINATE, as for a missing part. Inputs that prove a lie by themselves (a seal
        that is not its sender's, a microbatch it did not serve) are an ACCUSE with the inputs as proof.
        """
        me = self.transport.peer_id
        committed = st.inputs.get(target)
        if committed is None:
            return Claim(ACCUSE, me, target, "inputs", ())
        blob = await self.inputs.fetch(target, st.step, committed)
        if blob is None:
            return Claim(ELIMINATE, me, target, "no_inputs")
        try:
            recomputed = self.inputs.recompute(target, st.step, blob)
        except KeyError:  # this validator holds no weights of that step (it joined since): it cannot judge
            return "unverified"
        if recomputed is None:
            return Claim(ACCUSE, me, target, "inputs", (blob,))
        recomputed = recomputed.reshape(-1)
        parts = await self._committed_parts(st, target)
        if self._parts_guilty(st, target, parts, recomputed):
            return Claim(ACCUSE, me, target, "gradient", (blob, *sorted(parts.items(), key=lambda item: item[0])))
        if len(parts) < len(st.bounds):
            return "unverified"
        return None

    def _parts_guilty(self, st: _Step, target: str, parts: dict[int, torch.Tensor], recomputed: torch.Tensor | None = None) -> bool:
        """Whether the committed parts differ from the recomputation, or show a metadata lie.

        The tolerance is the whole gradient's (GRAD_RTOL of its norm): an honest gradient is within
        it, so is any subset of its parts, and a forgery that shows in the parts at hand is caught.
        """
        if not parts:
            return False
        if recomputed is None:
            recomputed = self.recompute(target, st.step).reshape(-1)
        index = torch.cat([torch.arange(*st.bounds[j]) for j in sorted(parts)])
        committed = torch.cat([parts[j] for j in sorted(parts)])
        if not gradient_matches(committed, recomputed[index], scale=recomputed):
            return True
        return bool(self._lied_about(st, target, parts))

    def _lied_about(self, st: _Step, target: str, parts: dict[int, torch.Tensor]) -> list[str]:
        """Owners whose partition the target reported false metadata about (among the parts at hand)."""
        return [
            owner
            for j, owner in enumerate(st.group)
            if j in parts and owner in st.aggregates and target in self._contributors(st, owner)
            and self._meta_lie(st, target, owner, parts[j]) not in (None, "no_meta")  # an absence is the owner's claim to make
        ]

    async def _compare_views(self, st: _Step) -> None:
        """Fetch what a reporter holds and I lack or hold otherwise: I decide on the union, and a
        split view becomes an equivocation proof."""
        members = set(st.members)
        mine = self._seen(st)
        fetches = []
        for topic in SEEN_TOPICS:
            for reporter, report in sorted(st.reports.items()):
                wanted = [p for p, d in sorted(report["seen"].get(topic, {}).items()) if p in members and mine[topic].get(p) != d]
                if wanted and reporter != self.transport.peer_id:
                    fetches.append(self.transport.fetch_broadcasts(topic, st.step, wanted, [reporter], self.btard.timeout / 2))
        await asyncio.gather(*fetches)

    # --- verdicts (the same inputs on every honest peer) ---------------------------

    def _verdict(self, st: _Step, claim: Claim) -> Verdict:
        try:
            return self._judge(st, claim)
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            log.info("claim %s against %s has unusable evidence (%s): the accuser is at fault", claim.reason, claim.target[:8], exc)
            return Verdict(False)

    def _judge(self, st: _Step, claim: Claim) -> Verdict:
        target, ev = claim.target, claim.evidence
        if claim.reason in DERIVED_REASONS:
            if claim.accuser != "":  # only derived from broadcasts every honest peer holds
                return Verdict(False)
        if claim.reason in ("bad_commit", "bad_report"):
            env = SignedEnvelope.from_bytes(ev[0], target, self.transport.limits).verify()
            obj = decoded(env.payload, target, None)
            parse = {"bad_commit": lambda: commit_in(obj, len(st.group)) or rcommit_in(obj, st.group),
                     "bad_report": lambda: report_in(obj)}[claim.reason]
            same_group = group_in(obj) == st.g
            return Verdict(env.sender == target and env.step == st.step and same_group and parse() is None)
        if claim.reason == "bad_part":
            j, part = ev
            ok = j == st.group.index(claim.accuser) and target in st.commits and tensor_hash(part) == st.commits[target][0][j]
            return Verdict(ok and malformed_part(part, st.bounds[j][1] - st.bounds[j][0]))
        if claim.reason == "bad_aggregate":
            (part,) = ev
            ok = target in st.rcommits and tensor_hash(part) == st.rcommits[target][0]
            sl = st.slice(target)
            return Verdict(ok and malformed_part(part, sl.stop - sl.start))
        if claim.reason in META_REASONS:
            j, part = ev
            owner = claim.accuser
            ok = j == st.group.index(owner) and target in st.commits and tensor_hash(part) == st.commits[target][0][j]
            ok = ok and target in self._contributors(st, owner)  # nobody owes metadata for a partition that dropped it
            return Verdict(ok and st.z is not None and owner in st.aggregates and self._meta_lie(st, target, owner, part) is not None)
        if claim.reason in ("equivocation", "not_validating", "no_reveal", "bad_reveal"):
            return Verdict(True)
        if claim.reason == "v2_sum":
            excused = any(c["reason"] in META_REASONS for c in st.reports.get(target, {}).get("claims", []))
            return Verdict(target in st.sum_failed and not excused)
        if claim.reason == "declaration":
            return Verdict(target in st.declaration_failed)
        if claim.reason == "averaging":
            return Verdict(st.averaging.get(target, True) is False)
        if claim.reason == "inputs":  # the target's committed inputs prove a lie by themselves
            if target not in st.commits or self.inputs is None:
                return Verdict(False)
            if target not in st.inputs:  # it committed no inputs at all
                return Verdict(True)
            (blob,) = ev
            ok = isinstance(blob, bytes) and digest(blob) == st.inputs[target]
            return Verdict(ok and self.inputs.recompute(target, st.step, blob) is None)
        if claim.reason == "gradient":
            recomputed = None
            if self.inputs is not None:  # evidence: (the target's committed inputs, its committed parts...)
                blob, ev = ev[0], ev[1:]
                if not (isinstance(blob, bytes) and digest(blob) == st.inputs.get(target)):
                    return Verdict(False)
                recomputed = self.inputs.recompute(target, st.step, blob)
                if recomputed is None:
                    return Verdict(False)
                recomputed = recomputed.reshape(-1)
            elif self.recompute is None:  # nobody can recompute it: the accusation cannot hold (a slander)
                return Verdict(False)
            parts = parts_in(ev, st, target)
            if parts is None or st.z is None or not self._parts_guilty(st, target, parts, recomputed):
                return Verdict(False)
            approvers = [v for v, t in st.pairs if t == target and target in st.reports.get(v, {}).get("approve", [])]
            silent_owners = [
                o for o in self._lied_about(st, target, parts)
                if o != claim.accuser and not any(c["target"] == target for c in st.reports.get(o, {}).get("claims", []))
            ]
            return Verdict(True, tuple(p for p in dict.fromkeys(approvers + silent_owners) if p != claim.accuser))
        return Verdict(False)

    # --- serving ----------------------------------------------------------------

    async def _on_grad(self, sender: str, payload: bytes) -> bytes:
        obj = decode(payload, sender, self.transport.limits)
        step = obj.get("step") if isinstance(obj, dict) else None
        if type(step) is not int:
            raise RemoteError(Evidence(sender, "malformed", "bad gradient request"))
        return encode({"step": step, "t": self._grads.get(step) if self.policy.serve_gradient(step) else None})

    async def _on_part_request(self, sender: str, payload: bytes) -> bytes:
        """One contributor's part that this owner aggregated (a validator's evidence)."""
        obj = decode(payload, sender, self.transport.limits)
        step, peer = (obj.get("step"), obj.get("peer")) if isinstance(obj, dict) else (None, None)
        if type(step) is not int or not isinstance(peer, str):
            raise RemoteError(Evidence(sender, "malformed", "bad part request"))
        return encode({"step": step, "t": self._used.get(step, {}).get(peer) if self.policy.serve_parts(step) else None})

    async def _on_parts(self, sender: str, payload: bytes) -> bytes:
        obj = decode(payload, sender, self.transport.limits)
        step = obj.get("step") if isinstance(obj, dict) else None
        if type(step) is not int:
            raise RemoteError(Evidence(sender, "malformed", "bad parts request"))
        return encode({"step": step, "parts": self._used.get(step, {})})


def _pairs(r: bytes, trusted: list[str], contributors: list[str], m: int) -> list[tuple[str, str]]:
    """m (validator, target) pairs from r: validators among trusted contributors, targets among all (App. F).

    Without untrusted contributors this is plain BTARD's draw of 2m distinct contributors.
    """
    if len(trusted) == len(contributors):
        chosen = choose(r, contributors, 2 * m)
        return list(zip(chosen[:m], chosen[m:]))
    validators = choose(r, trusted, m)
    targets = choose(r + b"/targets", [p for p in contributors if p not in validators], m)
    return list(zip(validators, targets))


def _take_inputs(st: _Step, peer: str, obj: dict) -> None:
    """Keep the digest of the inputs a parsed commitment binds (InputsHook), if it names one."""
    if "inputs" in obj:
        st.inputs[peer] = obj["inputs"]
