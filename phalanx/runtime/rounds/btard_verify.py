"""BTARD's background verification of one step (App. B, the second synchronisation point; Alg. 6-7).

It runs while the next step computes and all-reduces:

4. MPRNG commits during the scatter and reveals once every aggregate commitment is in (r must not be
   known before them); r gives the direction z (Verification 2) and m validator/target pairs, drawn
   from the step's roles, not from the commitments that reached each peer.
5. meta: each contributor broadcasts norm_ij and s_ij for every partition that did not drop it. Owners
   run V1 and V2 on their contributors; V3 flags trigger CHECKAVERAGING; validators check their targets
   (`btard_validate`).
6. report: each peer broadcasts its claims (ACCUSE with evidence, ELIMINATE), approvals and seen-set
   digests of the commitments, aggregate commitments and metadata it holds; then the digests of the
   reports it collected (`bt.rseen`), so that every honest peer decides on the same reports; each peer
   fetches what others hold and it lacks (split views become equivocation proofs), takes in only what an
   agreed report lists, and only then runs the checks that decide on sets: every declaration against the
   agreed contributors, and Σ_i s_i^j = 0 over every agreed contributor of every partition.

A member silent in an earlier phase of the step (no MPRNG commitment, no reveal, no commitment or metadata
in any report at hand) is waited for only a grace of btard.timeout / 4 in the later waits, once every other
member's message is in (`Transport.collect_passing_over`), not the whole timeout again; one that has left the
membership view is not waited for once everyone still in it has sent (`_collect_passing_over`).

`verify` returns every claim of the step; `btard_judge` resolves them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

import torch

from ...algorithms.btard.bans import BanLedger
from ...algorithms.btard.checks import (
    ACCUSE,
    ELIMINATE,
    Claim,
    averaging_matches,
    direction,
    project,
    sum_holds,
    sum_tolerance,
    tensor_hash,
    v3_flags,
)
from ...algorithms.btard.mprng import choose
from ...core.envelope import SignedEnvelope
from ...core.errors import PhalanxError
from ...core.serialization import decode, digest, encode
from ...transport.base import BROADCAST_TOPIC, Transport
from .btard_judge import META_REASONS
from .btard_messages import commit_in, declared_hash, decoded, group_in, meta_in, rcommit_in, report_in
from .btard_state import RoundState, StepState
from .btard_validate import committed_part, committed_parts, validate
from .mprng import MPRNGConfig, MPRNGFailed, run_mprng

log = logging.getLogger(__name__)

HANDLED_EVIDENCE = ("wrong_shape", "wrong_dtype", "non_finite", "equivocation", "no_reveal", "bad_reveal")
SEEN_TOPICS = ("bt.commit", "bt.rcommit", "bt.meta")  # what honest peers exchange seen-set digests of before deciding


async def draw(
    state: RoundState, mprng: MPRNGConfig, entropy: Callable[[int], bytes], step: int, group: list[str],
    before_reveal: Callable[[], Awaitable[None]], gathered_by: Callable[[], float] = lambda: 0.0,
) -> tuple[bytes | None, list[Claim]]:
    """The step's MPRNG output (drawn among the step's group) and claims against its cheaters.

    Among the group, not every member: a joiner still catching up is not waited for.
    The first reveals are waited for mprng.timeout from `gathered_by()` (when my gather would have ended at the
    latest) if that is later than now: a member reveals once its gather ends, and mine may have ended well before
    it would have (it stopped for owners gone before committing that another honest member still waits for:
    `SecureRound._gather`); that member's reveal is then waited for as long as before, not claimed no_reveal on my
    side only.

    MPRNG runs on a copy of the ledger, so its bans (no reveal, bad
    reveal, equivocation: each derived from signed broadcasts every honest
    peer holds) are resolved with the step's other claims in `settle`
    instead of changing the ledger in the middle of the next step.
    """
    shadow = BanLedger()
    shadow.restore(state.ledger.records)
    before = set(shadow.banned)
    try:
        clock = state.transport.clock

        def reveal_wait() -> float:
            return max(mprng.timeout, gathered_by() + mprng.timeout - clock.now())

        value = (await run_mprng(state.transport, shadow, step, mprng, entropy, before_reveal=before_reveal, among=group,
                                 reveal_wait=reveal_wait)).value
    except MPRNGFailed as exc:
        log.warning("BTARD step %d has no random value (%s): V2 and validation are skipped", step, exc)
        value = None
    return value, [Claim(ACCUSE, "", rec.peer, rec.reason) for rec in shadow.records if rec.peer not in before]


async def verify(state: RoundState, st: StepState, parts: list[torch.Tensor], drawn: asyncio.Future) -> list[Claim]:
    """Steps 5-6 of one step: metadata, V1-V3, validators, reports; returns every claim to resolve."""
    tr, me = state.transport, state.transport.peer_id
    step, group, g = st.step, st.members, st.g
    claims = st.claims
    r, mprng_claims = await drawn
    unrevealed = {c.target for c in mprng_claims if c.reason == "no_reveal"}
    approvals, unverified = await _check(state, st, parts, r, unrevealed) if r is not None else ([], [])
    mine = [ev for ev in state.evidence if ev.step is None or ev.step <= step]
    state.evidence = [ev for ev in state.evidence if not (ev.step is None or ev.step <= step)]
    for ev in mine:
        if ev.peer in group and ev.peer != me and ev.kind not in HANDLED_EVIDENCE:
            claims.append(Claim(ELIMINATE, me, ev.peer, ev.kind))

    # 6. reports, equivocation proofs; resolution happens in `settle`
    # A validator may have waited one timeout for a silent target (and, recomputing from inputs, until the
    # target left the view: else the others passed an honest validator over, over hivemind, and retired it)
    # and one for CHECKAVERAGING. A member silent earlier in the step by every report at hand is passed over
    # after a grace (`_unheard`).
    departure = state.inputs.departure_wait if state.inputs is not None else state.btard.timeout
    wait = 2 * state.btard.timeout + max(state.btard.timeout, departure)
    report = encode({
        "g": g,
        "claims": [{"kind": c.kind, "target": c.target, "reason": c.reason, "ev": list(c.evidence)} for c in claims],
        "approve": approvals,
        "unverified": unverified,
        "seen": _seen(state, st),
    })
    if state.policy.report_edge(step):
        sending = asyncio.ensure_future(edge_broadcast(tr, "bt.report", step, report, wait))
        state.pending_sends.add(sending)
        sending.add_done_callback(state.pending_sends.discard)
    else:
        await tr.broadcast("bt.report", step, report)
    deadline = tr.clock.now() + wait
    parsed: dict[tuple[str, bytes], dict | None] = {}
    envelopes = await _collect_passing_over(state, "bt.report", step, group, wait, lambda got: _unheard(st, got, parsed), len(group))
    # A member passed over because it left my view may be in the others' (it only looks gone to me): they
    # may wait for its report until their deadline, and I must then wait for their lists.
    looks_gone = any(p not in envelopes and p not in tr.members() for p in group)
    envelopes = await _agreed_reports(state, st, envelopes, deadline if looks_gone else tr.clock.now())
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
    await _compare_views(state, st)
    equivocators = {
        proof.first.sender for proof in tr.board.proofs
        if proof.first.topic in (*SEEN_TOPICS, "bt.report") and proof.first.step == step and proof.first.sender in group
    }
    everyone += [Claim(ACCUSE, "", peer, "equivocation") for peer in sorted(equivocators)]
    _absorb(state, st)
    if st.z is not None:
        # V3 counts norms on the agreed metadata: counted on what my own cut held (a member that looked gone
        # to me alone sent it to the others only), it ran CHECKAVERAGING on some honest peers and not others.
        await _v3(state, st)
        await _agreed_checks(state, st, equivocators)
    return everyone + _derived_claims(st, equivocators)


async def edge_broadcast(tr: Transport, topic: str, step: int, payload: bytes, deadline: float) -> None:
    """A deadline-edge attacker's broadcast: signed just before the others' deadline, sent to
    half of them then, and to the other half just after it."""
    await asyncio.sleep(0.95 * deadline)
    envelope = SignedEnvelope.create(tr.identity, topic, step, payload)
    tr.board.add(envelope)
    others = [p for p in tr.members() if p != tr.peer_id]
    for i, peer in enumerate(others):
        if i == len(others) // 2:
            await asyncio.sleep(0.1 * deadline)
        await tr.send(peer, BROADCAST_TOPIC, envelope.to_bytes())


async def _agreed_reports(
    state: RoundState, st: StepState, held: dict[str, SignedEnvelope], until: float,
) -> dict[str, SignedEnvelope]:
    """The step's reports as honest peers decide on them, not as each one's deadline cut them.

    Each peer broadcasts the digests of the reports it collected (`bt.rseen`), collects those of the
    peers whose report it holds, fetches what they list and it lacks (or holds otherwise: a reporter
    that signed two reports is caught by the proof), and decides on the reports the collected lists
    name, its own included; never on one that reached it only after its own list went out. So a
    report sent to some honest peers just before their deadline and to others just after it counts
    for all of them or for none, and a reporter that signed two reports counts for none. The lists
    are waited for btard.timeout / 2, from `until` on (when the others may still collect reports).
    """
    tr, me, step = state.transport, state.transport.peer_id, st.step
    members = set(st.members)
    mine = {peer: digest(env.payload) for peer, env in sorted(held.items())}
    await tr.broadcast("bt.rseen", step, encode({"g": st.g, "seen": mine}))
    timeout = max(0.0, until - tr.clock.now()) + state.btard.timeout / 2
    lists = await _collect_passing_over(state, "bt.rseen", step, sorted(held), timeout, lambda got: set(), len(st.members))
    listed = set(mine)
    wanted: dict[str, list[str]] = {}  # lister -> the reporters it holds that I lack or hold otherwise
    for lister, env in sorted(lists.items()):
        obj = decoded(env.payload, lister, tr)
        seen = obj.get("seen") if isinstance(obj, dict) and group_in(obj) == st.g else None
        if not isinstance(seen, dict):
            continue
        for reporter, report_digest in seen.items():
            if reporter in members and isinstance(report_digest, bytes):
                listed.add(reporter)
                if mine.get(reporter) != report_digest and reporter != me:
                    wanted.setdefault(lister, []).append(reporter)
    await asyncio.gather(*(
        tr.fetch_broadcasts("bt.report", step, reporters, [lister], state.btard.timeout / 2) for lister, reporters in wanted.items()
    ))
    twice = {proof.first.sender for proof in tr.board.proofs if proof.first.topic == "bt.report" and proof.first.step == step}
    board = tr.board.get("bt.report", step)
    return {peer: board[peer] for peer in sorted(listed) if peer in board and peer not in twice}


async def _check(
    state: RoundState, st: StepState, parts: list[torch.Tensor], r: bytes, unrevealed: set[str],
) -> tuple[list[str], list[str]]:
    """Step 5 once r is known: metadata, V1-V3, this peer's validations and its attacker's slander.
    Returns the targets it approves and those it could not fully check (the rest are claims).
    `unrevealed`: the members that withheld their MPRNG reveal (banned for it or departed in this
    step's verdict): their metadata gets a grace once everyone else's is in, not the whole wait."""
    tr, me = state.transport, state.transport.peer_id
    step, group = st.step, st.members
    contributors_all = [p for p in st.committers if p in st.commits]
    # Validator/target pairs are drawn from the step's roles (fixed by the group), not from the
    # commitments that reached me by my deadline: a commitment timed at the deadline must not give
    # honest peers different pairs (and each other's validators as not_validating).
    drawn = list(st.committers)
    trusted = [p for p in drawn if p in st.group]  # validators are drawn among these (App. F)
    claims = st.claims
    approvals: list[str] = []
    unverified: list[str] = []  # targets whose parts at hand are honest, the rest held by nobody but them
    st.z = direction(r, state.dim)
    st.z64 = st.z.to(torch.float64)  # converted once: every projection of the step reads it
    recomputable = state.recompute is not None or state.inputs is not None
    validators = min(state.btard.validators, len(trusted) // 2) if recomputable else 0
    st.pairs = validator_pairs(r, trusted, drawn, validators)
    await _send_meta(state, st, parts, me)
    # A peer may have waited the whole gather timeout for a silent owner's aggregate.
    wait = state.allreduce.timeout + state.btard.timeout
    envelopes = await _collect_passing_over(state, "bt.meta", step, contributors_all, wait, lambda got: unrevealed, len(group))
    for peer, env in envelopes.items():
        parsed = meta_in(env.payload, peer, tr)
        if parsed is not None:
            st.meta[peer] = parsed
    claims += _owner_checks(state, st, me)
    for validator, target in st.pairs:
        if validator == me:
            claim = await validate(state, st, target)
            if claim is None:
                approvals.append(target)
            elif claim == "unverified":
                unverified.append(target)
            elif claim != "skip":
                claims.append(claim)
    for target in state.policy.slander(step, [p for p in contributors_all if p != me]):
        held = await committed_parts(state, st, target)
        evidence = tuple(sorted(held.items(), key=lambda item: item[0]))
        if state.inputs is not None and target in st.inputs:  # its true inputs: the recomputation clears it
            evidence = (await state.inputs.fetch(target, step, st.inputs[target]) or b"", *evidence)
        claims.append(Claim(ACCUSE, me, target, "gradient", evidence))
    return approvals, unverified


async def _collect_passing_over(
    state: RoundState, topic: str, step: int, senders: list[str], timeout: float,
    quiet: Callable[[dict[str, SignedEnvelope]], set[str]], relays: int,
) -> dict[str, SignedEnvelope]:
    """`Transport.collect_passing_over` with a grace of btard.timeout / 4, ended early once every sender
    still in my membership view has sent, some have left it (the transport's failure detection: a crash
    sends no message, so the view is read every btard.timeout / 10) and those in it are at least half.

    The view is local: a member may look gone to some peers only (a partition, a slow link, a Byzantine
    that answers some). That changes when a peer stops waiting, not what honest peers decide on: what
    one cut is in the others' reports' seen-sets and `bt.rseen` lists, and it fetches and takes it as
    they do. A peer that sees more than half of the senders gone (cut off itself, maybe) waits as before.
    """
    tr, me = state.transport, state.transport.peer_id
    collect = asyncio.ensure_future(
        tr.collect_passing_over(topic, step, senders, timeout, quiet, relays, grace=state.btard.timeout / 4)
    )

    def settled() -> bool:
        held, view = tr.board.get(topic, step), set(tr.members())
        present = [p for p in senders if p in view]
        return len(present) < len(senders) <= 2 * len(present) and all(p in held or p == me for p in present)

    try:
        while not collect.done():
            await asyncio.wait([collect], timeout=state.btard.timeout / 10)
            if not collect.done() and settled():
                held = tr.board.get(topic, step)
                return {p: held[p] for p in senders if p in held}
        return collect.result()
    finally:
        collect.cancel()


def _unheard(st: StepState, got: dict[str, SignedEnvelope], parsed: dict[tuple[str, bytes], dict | None]) -> set[str]:
    """Members silent earlier in the step by every report at hand: no report (mine included) holds
    their commitment (a committer) or, once r was drawn, their metadata. Read from signed reports,
    so honest peers that hold the same reports pass over the same members. `parsed` keeps each
    report parsed once across the collection's many calls (decoding them all again on every
    arrival cost half of a 16-peer run's time)."""
    for peer, env in got.items():
        if (peer, env.payload) not in parsed:
            obj = decoded(env.payload, peer, None)
            parsed[peer, env.payload] = report_in(obj) if group_in(obj) == st.g else None
    reports = [rep for peer, env in got.items() if (rep := parsed[peer, env.payload]) is not None]
    if not reports:
        return set()
    seen = {topic: set().union(*(rep["seen"].get(topic, {}) for rep in reports)) for topic in ("bt.commit", "bt.meta")}
    committers = set(st.committers)
    return {
        p for p in st.members
        if p not in got and ((p in committers and p not in seen["bt.commit"]) or (st.z is not None and p not in seen["bt.meta"]))
    }


def _derived_claims(st: StepState, equivocators: set[str]) -> list[Claim]:
    """Failures every honest peer derives from the same broadcasts, claimed by nobody in particular
    (accuser ""), so that agreeing peers are never banned as slanderers; and the owners' signed drops."""
    claims = [Claim(ACCUSE, "", o, "declaration") for o in sorted(st.declaration_failed)]
    claims += [Claim(ACCUSE, "", o, "v2_sum") for o in st.sum_failed]
    # A committed owner's part left out: the owner's signed drop is its ELIMINATE of that owner, unless the
    # committer was late against the group (`late_for_most`): then it departs from the step and nobody pays.
    st.late = late_for_most(st, equivocators)
    for owner, (_, _, drop) in st.rcommits.items():
        if owner not in equivocators:
            claims += [Claim(ELIMINATE, owner, p, reason) for p, reason in drop.items()
                       if p in st.commits and p != owner and not (reason == "late_commit" and p in st.late)]
    claims += [Claim(ACCUSE, "", o, "averaging") for o, ok in st.averaging.items() if not ok]
    for validator, target in st.pairs:
        report = st.reports.get(validator)
        judged = report is not None and (
            target in report["approve"] or target in report["unverified"] or any(c["target"] == target for c in report["claims"])
        )
        if not judged:
            claims.append(Claim(ACCUSE, "", validator, "not_validating"))
    return claims


def late_for_most(st: StepState, equivocators: set[str]) -> set[str]:
    """Committers whose commitment more than half of the other declaring owners declare late (`late_commit`, in
    the agreed declarations of owners that signed one version): late against the group, not against one
    owner's clock. At least one of those owners is honest (colluders are at most half of anyone's other
    owners), so the commitment really came after an honest owner's deadline: the committer began the step
    too late (still catching up, a loaded machine) and departs from it, not banned, and the owners that
    dropped it pay nothing. It commits in the window between those owners' deadlines and the arrival of
    their declarations, which would have made it step out (`SecureRound._closed_before_me`). A committer
    late for fewer is the `deadline_edge` case: each drop stays an ELIMINATE (App. D.3)."""
    counts: dict[str, int] = {}
    for owner, (_, _, drop) in st.rcommits.items():
        if owner not in equivocators:
            for p, reason in drop.items():
                if reason == "late_commit" and p != owner:
                    counts[p] = counts.get(p, 0) + 1
    # Against the owners that declared (an owner that declares nothing, crashed or withholding, drops nobody; counted
    # as "not late" it let two colluders keep a late honest committer's drop an ELIMINATE: review s23-RE HIGH 9).
    declared = [o for o in st.rcommits if o not in equivocators]
    return {p for p, n in counts.items() if p in st.commits and 2 * n > sum(1 for o in declared if o != p)}


def validator_pairs(r: bytes, trusted: list[str], contributors: list[str], m: int) -> list[tuple[str, str]]:
    """m (validator, target) pairs from r: validators among trusted contributors, targets among all (App. F).

    Without untrusted contributors this is plain BTARD's draw of 2m distinct contributors.
    """
    if len(trusted) == len(contributors):
        chosen = choose(r, contributors, 2 * m)
        return list(zip(chosen[:m], chosen[m:]))
    validators = choose(r, trusted, m)
    targets = choose(r + b"/targets", [p for p in contributors if p not in validators], m)
    return list(zip(validators, targets))


async def _send_meta(state: RoundState, st: StepState, parts: list[torch.Tensor], me: str) -> None:
    norms, s = {}, {}
    for j, owner in enumerate(st.group):
        if owner in st.aggregates and me in st.contributors(owner):
            proj = project(parts[j], st.aggregates[owner], st.z64[st.slice(owner)], state.tau)
            norms[owner], s[owner] = proj.norm, proj.s
    norms, s = state.policy.report(st.step, norms, s)
    await state.transport.broadcast("bt.meta", st.step, encode({"norm": norms, "s": s}))


def _owner_checks(state: RoundState, st: StepState, me: str) -> list[Claim]:
    """V1 and V2 on the parts this peer aggregated (none unless it owns a partition)."""
    if me not in st.aggregates:  # not an owner, or passed over: it aggregated nothing that counts
        return []
    index = st.group.index(me)
    claims = []
    contributors = st.contributors(me)
    for peer, part in state.used.get(st.step, {}).items():
        if peer != me and peer in contributors and (lie := st.meta_lie(peer, me, part, state.tau)) is not None:
            claims.append(Claim(ACCUSE, me, peer, lie, (index, part)))
    return claims


def _seen(state: RoundState, st: StepState) -> dict[str, dict[str, bytes]]:
    """Digests of the step's commitments, aggregate commitments and metadata this peer holds, by topic."""
    members = set(st.members)
    return {
        topic: {peer: digest(env.payload) for peer, env in sorted(state.transport.board.get(topic, st.step).items()) if peer in members}
        for topic in SEEN_TOPICS
    }


async def _compare_views(state: RoundState, st: StepState) -> None:
    """Fetch what a reporter holds and I lack or hold otherwise: I decide on the union, and a
    split view becomes an equivocation proof."""
    members = set(st.members)
    mine = _seen(state, st)
    fetches = []
    for topic in SEEN_TOPICS:
        for reporter, report in sorted(st.reports.items()):
            wanted = [p for p, d in sorted(report["seen"].get(topic, {}).items()) if p in members and mine[topic].get(p) != d]
            if wanted and reporter != state.transport.peer_id:
                fetches.append(state.transport.fetch_broadcasts(topic, st.step, wanted, [reporter], state.btard.timeout / 2))
    await asyncio.gather(*fetches)


def _absorb(state: RoundState, st: StepState) -> None:
    """Take in the signed commitments, aggregate commitments and metadata the seen-set exchange brought.

    The step's agreed contributors are every committer whose commitment (naming this step's
    group) some honest peer holds: honest peers report what they hold, so after the exchange
    each holds the union. Only what an agreed report lists is taken: a broadcast that reached this
    peer after every report went out (sent late to some on purpose) is not something the others
    decide on. A malformed one found this way was already claimed by whoever got it.
    """
    tr, g = state.transport, st.g
    listed = {topic: {(p, d) for rep in st.reports.values() for p, d in rep["seen"].get(topic, {}).items()} for topic in SEEN_TOPICS}

    def agreed(topic: str) -> list[tuple[str, SignedEnvelope]]:
        return [(p, env) for p, env in sorted(tr.board.get(topic, st.step).items()) if (p, digest(env.payload)) in listed[topic]]

    for peer, env in agreed("bt.commit"):
        obj = decoded(env.payload, peer, tr)
        if peer in st.committers and peer not in st.commits and group_in(obj) == g and (parsed := commit_in(obj, len(st.group))):
            st.commits[peer] = parsed
            st.take_inputs(peer, obj)
    for peer, env in agreed("bt.rcommit"):
        obj = decoded(env.payload, peer, tr)
        if peer in st.group and peer not in st.rcommits and group_in(obj) == g:
            parsed = rcommit_in(obj, st.group)
            if parsed is None and (h := declared_hash(obj)) is not None:
                parsed = (h, [], {})  # a malformed declaration binds its hash, as in the gather
            if parsed is not None:
                st.rcommits[peer] = parsed
    for peer, env in agreed("bt.meta"):
        if peer in st.committers and peer not in st.meta and (parsed := meta_in(env.payload, peer, tr)) is not None:
            st.meta[peer] = parsed


async def _agreed_checks(state: RoundState, st: StepState, equivocators: set[str]) -> None:
    """Declaration and Σ_i s_i^j = 0 over every agreed contributor of every partition.

    An owner's declaration (the parts it used) must be exactly the agreed contributors less the
    owners it dropped; anything else is a claim against it that every honest peer derives.
    An owner that signed two declarations is left to its equivocation proof.
    """
    for owner, (_, declared, _) in st.rcommits.items():
        if owner not in equivocators and set(declared) != set(st.contributors(owner)):
            st.declaration_failed.add(owner)
    _fill_missing_meta(state, st)
    sum_checks(state, st, equivocators | st.declaration_failed)
    for owner in sorted(st.sum_failed):
        # The owner blames a contributor's metadata (its report's V1/V2 claim): the sum cannot
        # judge the partition, so everyone reruns the owner's rule on the committed parts instead.
        if any(c["reason"] in META_REASONS for c in st.reports.get(owner, {}).get("claims", [])) and owner not in st.averaging:
            st.averaging[owner] = await _check_averaging(state, st, owner)


def _fill_missing_meta(state: RoundState, st: StepState) -> None:
    """Metadata a contributor never sent (it crashed, or withholds it), recomputed where possible.

    Its minibatch is public: anyone can recompute its gradient, and a part whose hash equals the
    commitment is the committed part itself, so its norm and s are exact. Used by the Σ check
    only (the owner's V1/V2 claim about the missing report is judged on what was sent).
    """
    if state.recompute is None:
        return  # a missing report is left to the owners' no_meta claims
    for peer in sorted(st.commits):
        owners = [o for o in st.aggregates if peer in st.contributors(o) and o not in st.meta.get(peer, ({}, {}))[1]]
        if not owners:
            continue
        recomputed = state.recompute(peer, st.step).reshape(-1).to(torch.float32)
        for owner in owners:
            j, sl = st.group.index(owner), st.slice(owner)
            if tensor_hash(recomputed[sl].contiguous()) == st.commits[peer][0][j]:
                proj = project(recomputed[sl], st.aggregates[owner], st.z64[sl], state.tau)
                norms, s = st.filled.setdefault(peer, ({}, {}))
                norms[owner], s[owner] = proj.norm, proj.s


def sum_checks(state: RoundState, st: StepState, skip: set[str]) -> None:
    """Owners whose partition fails Σ_i s_i^j = 0 (everyone checks every partition it holds)."""
    failed = []
    for owner, aggregate in st.aggregates.items():
        if owner in skip:
            continue
        contributors = st.contributors(owner)
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
            deltas.append(min(meta[0].get(owner, math.inf), state.tau) if meta else math.inf)
        z = st.z[st.slice(owner)]
        tolerance = sum_tolerance(len(contributors), state.eps, float(aggregate.norm()), float(z.norm()), deltas)
        if not sum_holds(s_values, tolerance):
            failed.append(owner)
    st.sum_failed = set(failed)


async def _v3(state: RoundState, st: StepState) -> None:
    """V3: run CHECKAVERAGING on partitions where over half the reported norms exceed Δ_max."""
    for owner in st.aggregates:
        contributors = st.contributors(owner)
        norms = [st.meta[p][0].get(owner, math.inf) for p in contributors if p in st.meta]
        if contributors and v3_flags(norms, state.btard.delta_max) > len(contributors) / 2:
            st.averaging[owner] = await _check_averaging(state, st, owner)


async def _check_averaging(state: RoundState, st: StepState, owner: str) -> bool:
    """CHECKAVERAGING(j): fetch the committed parts the owner used, rerun its rule, compare."""
    tr = state.transport
    contributors = st.contributors(owner)
    j = st.group.index(owner)
    if owner == tr.peer_id:
        parts = state.used.get(st.step, {})
    else:
        try:
            answer = decode(await tr.request(owner, "bt.parts", encode({"step": st.step}), state.btard.timeout), owner, tr.limits)
            parts = answer.get("parts") if isinstance(answer, dict) else None
        except PhalanxError:
            parts = None
    if not isinstance(parts, dict):
        return False
    rows = []
    for peer in contributors:
        part = parts.get(peer)
        if not isinstance(part, torch.Tensor) or peer not in st.commits or not committed_part(state, st, peer, j, part):
            return False
        rows.append(part)
    recomputed = state.reducer(torch.stack(rows)).to(torch.float32)
    return averaging_matches(st.aggregates[owner], recomputed, state.eps)
