"""BTARD's verdicts: one step's claims (ACCUSE with evidence, ELIMINATE) judged the same on every honest peer.

`judge_step` resolves a step's claims in one canonical order (`algorithms.btard.checks.resolve`, App. D.3)
once its verification is done; `SecureRound.settle` calls it at the end of the next step's all-reduce.
Each claim is judged by `verdict` from what every honest peer holds after the seen-set exchange: the
evidence it carries, the agreed commitments and reports, and the failures derived from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...algorithms.btard.bans import BanRecord
from ...algorithms.btard.checks import ACCUSE, ELIMINATE, Claim, Verdict, resolve, tensor_hash
from ...core.envelope import SignedEnvelope
from ...core.serialization import digest
from .btard_messages import commit_in, decoded, group_in, malformed_part, parts_in, rcommit_in, report_in
from .btard_state import CannotJudge, RoundState, StepState
from .btard_validate import lied_about, parts_guilty

log = logging.getLogger(__name__)

META_REASONS = ("v1_norm", "v2_s", "no_meta")
DERIVED_REASONS = ("equivocation", "not_validating", "v2_sum", "averaging", "no_reveal", "bad_reveal", "declaration")  # accuser "" only
# Faults that are only an absence. With admission (App. F) a member that is silent through the step's
# verification (no report reached anyone) departs instead of being banned for them: a crash is not a
# lie, and the identity loses its trust (it comes back through admission); nobody who eliminated it pays.
OMISSION_REASONS = ("no_reveal", "not_validating", "no_meta", "missing_part", "missing_aggregate", "late_commit")


@dataclass(frozen=True)
class Judgement:
    """What one step's verification settled: its bans, and (with admission) whom it approved and who departed."""

    bans: list[BanRecord]
    approved: tuple[str, ...] = ()
    departed: tuple[str, ...] = ()


def judge_step(state: RoundState, st: StepState, claims: list[Claim], admission: bool) -> Judgement:
    """Resolve every claim of one step into bans (applied to the ledger unless `btard.bans` is off)."""
    claims = [c for claim in claims for c in _missing_meta(st, claim, state.tau)]
    departed: set[str] = set()
    if admission:
        departed = {c.target for c in claims if c.target in st.silent and c.reason in OMISSION_REASONS}
        claims = [c for c in claims if c.target not in departed or c.reason not in OMISSION_REASONS]
        # a trusted member that missed its commitment, or whose commitment most other owners declared late
        departed |= st.silent | st.late | {p for p in st.group if p not in st.commits}
    bans = resolve(state.ledger, st.step, claims, lambda c: verdict(state, st, c), apply=state.btard.bans)
    if not admission:
        return Judgement(bans)
    banned = state.ledger.is_banned
    approved = {t for v, t in st.pairs if t in st.reports.get(v, {}).get("approve", []) and not banned(t) and not banned(v)}
    return Judgement(bans, tuple(sorted(approved)), tuple(sorted(p for p in departed if not banned(p))))


def _missing_meta(st: StepState, claim: Claim, tau: float) -> list[Claim]:
    """An owner's `no_meta` claim, read on the agreed metadata (after the seen-set exchange), never on
    which aggregates reached the judge: only the contributor knows whether the owner's aggregate (or its
    commitment) reached it in time, and an honest one sends no metadata for a partition it lacks.

    - the contributor's metadata covers the partition: the claim came before the metadata did (a late
      broadcast): nobody is at fault, unless the metadata lies (V1/V2 on it), which the claim then proves;
    - its metadata omits the partition: "your aggregate never came" against "your metadata never came",
      which nobody else can tell apart, so it is an ELIMINATE (both go, App. D.3);
    - it sent no metadata at all: the accusation stands (a silent member departs under admission).
    A claim whose evidence does not hold is left to `verdict` (the accuser's slander).
    """
    if claim.kind != ACCUSE or claim.reason != "no_meta" or claim.accuser not in st.group:
        return [claim]
    try:
        j, part = claim.evidence
        holds = j == st.group.index(claim.accuser) and claim.target in st.commits and tensor_hash(part) == st.commits[claim.target][0][j]
    except (TypeError, ValueError, RuntimeError):
        return [claim]
    meta = st.meta.get(claim.target)
    if not holds or claim.target not in st.contributors(claim.accuser) or meta is None:
        return [claim]
    if claim.accuser in meta[0] and claim.accuser in meta[1]:
        lie = st.meta_lie(claim.target, claim.accuser, part, tau) if st.z is not None and claim.accuser in st.aggregates else None
        return [claim] if lie is not None else []
    return [Claim(ELIMINATE, claim.accuser, claim.target, "no_meta")]


def verdict(state: RoundState, st: StepState, claim: Claim) -> Verdict:
    """Whether `claim` holds (and who else is at fault); unusable evidence is the accuser's fault."""
    try:
        return _judge(state, st, claim)
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        log.info("claim %s against %s has unusable evidence (%s): the accuser is at fault", claim.reason, claim.target[:8], exc)
        return Verdict(False)


def _judge(state: RoundState, st: StepState, claim: Claim) -> Verdict:
    target, ev = claim.target, claim.evidence
    if claim.reason in DERIVED_REASONS:
        if claim.accuser != "":  # only derived from broadcasts every honest peer holds
            return Verdict(False)
    if claim.reason in ("bad_commit", "bad_report"):
        env = SignedEnvelope.from_bytes(ev[0], target, state.transport.limits).verify()
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
        ok = ok and target in st.contributors(owner)  # nobody owes metadata for a partition that dropped it
        return Verdict(ok and st.z is not None and owner in st.aggregates and st.meta_lie(target, owner, part, state.tau) is not None)
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
        if target not in st.commits or state.inputs is None:
            return Verdict(False)
        if target not in st.inputs:  # it committed no inputs at all
            return Verdict(True)
        (blob,) = ev
        if not (isinstance(blob, bytes) and digest(blob) == st.inputs[target]):
            return Verdict(False)
        try:
            return Verdict(state.inputs.recompute(target, st.step, blob) is None)
        except CannotJudge:
            return Verdict(False, judged=False)
    if claim.reason == "gradient":
        return _judge_gradient(state, st, claim)
    return Verdict(False)


def _judge_gradient(state: RoundState, st: StepState, claim: Claim) -> Verdict:
    """A forged gradient: the committed parts in the evidence against the recomputation; the target's
    approvers, and owners that kept silent about its metadata lies, share the fault."""
    target, ev = claim.target, claim.evidence
    recomputed = None
    if state.inputs is not None:  # evidence: (the target's committed inputs, its committed parts...)
        blob, ev = ev[0], ev[1:]
        if not (isinstance(blob, bytes) and digest(blob) == st.inputs.get(target)):
            return Verdict(False)
        try:
            recomputed = state.inputs.recompute(target, st.step, blob)
        except CannotJudge:  # no weights of that step here: the peers that hold them judge it
            return Verdict(False, judged=False)
        if recomputed is None:
            return Verdict(False)
        recomputed = recomputed.reshape(-1)
    elif state.recompute is None:  # nobody can recompute it: the accusation cannot hold (a slander)
        return Verdict(False)
    parts = parts_in(ev, st, target)
    if parts is None or st.z is None or not parts_guilty(state, st, target, parts, recomputed):
        return Verdict(False)
    approvers = [v for v, t in st.pairs if t == target and target in st.reports.get(v, {}).get("approve", [])]
    silent_owners = [
        o for o in lied_about(state, st, target, parts)
        if o != claim.accuser and not any(c["target"] == target for c in st.reports.get(o, {}).get("claims", []))
    ]
    return Verdict(True, tuple(p for p in dict.fromkeys(approvers + silent_owners) if p != claim.accuser))
