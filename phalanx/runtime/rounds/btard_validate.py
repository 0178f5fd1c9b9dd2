"""BTARD's validators (Alg. 7): recompute a target's gradient, fetch its committed parts, compare.

A validator recomputes its target's gradient from the public batch at that step's parameters (or, with an
`InputsHook`, from the inputs the target committed to); if the hashes equal the commitment (same build:
bit-identical) nothing is fetched, otherwise it fetches the committed parts from the owners that
aggregated them (the target only for parts nobody else holds) and compares within GRAD_RTOL; then it
checks the target's norms and inner products. The same checks judge a gradient accusation
(`btard_judge`). The `serve_*` handlers answer the requests validators and CHECKAVERAGING send.
"""

from __future__ import annotations

import asyncio

import torch

from ...algorithms.btard.checks import ACCUSE, ELIMINATE, Claim, gradient_hash, gradient_matches, tensor_hash
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, encode
from .btard_messages import commit_in, decoded, group_in
from .btard_state import CannotJudge, RoundState, StepState


async def validate(state: RoundState, st: StepState, target: str) -> Claim | str | None:
    """Alg. 7: None approves the target; a claim accuses or eliminates it; 'skip' sends no verdict."""
    me = state.transport.peer_id
    decision = state.policy.validate(st.step, target)
    if decision == "approve":
        return None
    if decision == "skip":
        return "skip"
    if target not in st.commits:
        return "unverified"  # no commitment reached me: it contributed nothing I could check
    if state.inputs is not None:
        return await _validate_from_inputs(state, st, target)
    recomputed = state.recompute(target, st.step).reshape(-1)
    if recomputed.dtype == torch.float32 and _matches_commit(state, st, target, recomputed):
        # bit-identical to the commitment (same build): nothing to fetch
        parts = {j: recomputed[a:b] for j, (a, b) in enumerate(st.bounds)}
    else:
        parts = await committed_parts(state, st, target)
    if parts_guilty(state, st, target, parts, recomputed):
        return Claim(ACCUSE, me, target, "gradient", tuple(sorted(parts.items(), key=lambda item: item[0])))
    # What could be had is honest; the rest was aggregated by nobody else, or the target's metadata never
    # reached me (my cut passed it over, and it may have sent the others metadata that lies: they judge a
    # `gradient` claim on that, and my approval would be banned as covering it).
    if len(parts) < len(st.bounds) or target not in st.meta:
        return "unverified"
    return None


async def _validate_from_inputs(state: RoundState, st: StepState, target: str) -> Claim | str | None:
    """Alg. 7 for a gradient that is a function of committed inputs (InputsHook): fetch them from
    the target, check them against its commitment, recompute, compare with the committed parts.

    Inputs the target will not give (or that miss its commitment) are an omission only this
    validator saw: ELIMINATE, as for a missing part. Inputs that prove a lie by themselves (a seal
    that is not its sender's, a microbatch it did not serve) are an ACCUSE with the inputs as proof.
    """
    me = state.transport.peer_id
    committed = st.inputs.get(target)
    if committed is None:
        return Claim(ACCUSE, me, target, "inputs", ())
    blob = await state.inputs.fetch(target, st.step, committed)
    if blob is None:
        return Claim(ELIMINATE, me, target, "no_inputs")
    try:
        recomputed = state.inputs.recompute(target, st.step, blob)
    except CannotJudge:  # this validator holds no weights of that step (it joined, or was behind): it cannot judge
        return "unverified"
    if recomputed is None:
        return Claim(ACCUSE, me, target, "inputs", (blob,))
    recomputed = recomputed.reshape(-1)
    parts = await committed_parts(state, st, target)
    if parts_guilty(state, st, target, parts, recomputed):
        return Claim(ACCUSE, me, target, "gradient", (blob, *sorted(parts.items(), key=lambda item: item[0])))
    if len(parts) < len(st.bounds) or target not in st.meta:
        return "unverified"
    return None


def parts_guilty(state: RoundState, st: StepState, target: str, parts: dict[int, torch.Tensor], recomputed: torch.Tensor | None = None) -> bool:
    """Whether the committed parts differ from the recomputation, or show a metadata lie.

    The tolerance is the whole gradient's (GRAD_RTOL of its norm): an honest gradient is within
    it, so is any subset of its parts, and a forgery that shows in the parts at hand is caught.
    """
    if not parts:
        return False
    if recomputed is None:
        recomputed = state.recompute(target, st.step).reshape(-1)
    index = torch.cat([torch.arange(*st.bounds[j]) for j in sorted(parts)])
    committed = torch.cat([parts[j] for j in sorted(parts)])
    if not gradient_matches(committed, recomputed[index], scale=recomputed):
        return True
    return bool(lied_about(state, st, target, parts))


def lied_about(state: RoundState, st: StepState, target: str, parts: dict[int, torch.Tensor]) -> list[str]:
    """Owners whose partition the target reported false metadata about (among the parts at hand)."""
    return [
        owner
        for j, owner in enumerate(st.group)
        if j in parts and owner in st.aggregates and target in st.contributors(owner)
        and st.meta_lie(target, owner, parts[j], state.tau) not in (None, "no_meta")  # an absence is the owner's claim to make
    ]


async def committed_parts(state: RoundState, st: StepState, target: str) -> dict[int, torch.Tensor]:
    """The target's committed parts that can be had, each checked against its part hash.

    From the owners that aggregated them (this peer first), so that a target that will not send
    its gradient still leaves the evidence its owners hold; the target is asked only for the
    parts nobody else holds (its own partition, or every part of an untrusted target).
    """
    me = state.transport.peer_id
    if target not in st.commits:
        return {}
    hashes = st.commits[target][0]
    found: dict[int, torch.Tensor] = {}

    def take(j: int, part) -> None:
        a, b = st.bounds[j]
        if isinstance(part, torch.Tensor) and part.dtype == torch.float32 and tuple(part.shape) == (b - a,) and tensor_hash(part) == hashes[j]:
            found[j] = part

    holders = [(j, o) for j, o in enumerate(st.group) if o != target and target in st.contributors(o)]
    for j, owner in holders:
        if owner == me:
            take(j, state.used.get(st.step, {}).get(target))
    remote = [(j, o) for j, o in holders if o != me]
    answers = await asyncio.gather(*(ask(state, o, "bt.part", {"step": st.step, "peer": target}) for _, o in remote))
    for (j, _), answer in zip(remote, answers):
        take(j, answer.get("t") if answer is not None else None)
    if len(found) < len(st.bounds):
        answer = await ask(state, target, "bt.grad", {"step": st.step})
        gradient = answer.get("t") if answer is not None else None
        if isinstance(gradient, torch.Tensor) and gradient.dim() == 1 and gradient.numel() == state.dim:
            for j, (a, b) in enumerate(st.bounds):
                if j not in found:
                    take(j, gradient[a:b].clone())
    return found


def committed_part(state: RoundState, st: StepState, peer: str, j: int, part: torch.Tensor) -> bool:
    """Whether `part` is peer's committed part j: under the commitment I hold, or under another
    one it signed for this step and group (an equivocator's parts match either version, so that
    honest peers holding different versions judge its owners alike)."""
    h = tensor_hash(part)
    if h == st.commits[peer][0][j]:
        return True
    for proof in state.transport.board.proofs:
        if proof.first.topic == "bt.commit" and proof.first.step == st.step and proof.first.sender == peer:
            for env in (proof.first, proof.second):
                obj = decoded(env.payload, peer, state.transport)
                version = commit_in(obj, len(st.group)) if group_in(obj) == st.g else None
                if version is not None and version[0][j] == h:
                    return True
    return False


def _matches_commit(state: RoundState, st: StepState, target: str, gradient) -> bool:
    """Whether `gradient` is exactly what `target` committed to (its part hashes and whole hash)."""
    if not isinstance(gradient, torch.Tensor) or target not in st.commits or gradient.dim() != 1 or gradient.numel() != state.dim:
        return False
    hashes, whole = st.commits[target]
    mine = [tensor_hash(gradient[a:b]) for a, b in st.bounds]
    return mine == hashes and gradient_hash(mine) == whole


async def ask(state: RoundState, peer: str, topic: str, query: dict) -> dict | None:
    """One verification request; a peer that answers badly is reported, one that does not is None.
    A peer that already left my membership view is asked briefly (it may only look gone to me): a tenth
    of btard.timeout, or one pull of a whole gradient if that is longer (the answer's transfer)."""
    timeout = state.btard.timeout
    if peer not in state.transport.members():
        transfer = state.allreduce.pull_timeout + 4 * state.dim / state.allreduce.pull_bandwidth
        timeout = min(timeout, max(timeout / 10, transfer))
    try:
        answer = decode(await state.transport.request(peer, topic, encode(query), timeout), peer, state.transport.limits)
    except RemoteError as exc:
        state.transport.report(exc.evidence)
        return None
    except PhalanxError:
        return None
    return answer if isinstance(answer, dict) else None


# --- serving the requests of validators and CHECKAVERAGING -------------------------

async def serve_gradient(state: RoundState, sender: str, payload: bytes) -> bytes:
    """The gradient this peer committed at a step (`bt.grad`: a validator's fallback)."""
    obj = decode(payload, sender, state.transport.limits)
    step = obj.get("step") if isinstance(obj, dict) else None
    if type(step) is not int:
        raise RemoteError(Evidence(sender, "malformed", "bad gradient request"))
    return encode({"step": step, "t": state.grads.get(step) if state.policy.serve_gradient(step) else None})


async def serve_part(state: RoundState, sender: str, payload: bytes) -> bytes:
    """One contributor's part that this owner aggregated (`bt.part`: a validator's evidence)."""
    obj = decode(payload, sender, state.transport.limits)
    step, peer = (obj.get("step"), obj.get("peer")) if isinstance(obj, dict) else (None, None)
    if type(step) is not int or not isinstance(peer, str):
        raise RemoteError(Evidence(sender, "malformed", "bad part request"))
    return encode({"step": step, "t": state.used.get(step, {}).get(peer) if state.policy.serve_parts(step) else None})


async def serve_parts(state: RoundState, sender: str, payload: bytes) -> bytes:
    """Every part this owner aggregated at a step (`bt.parts`: CHECKAVERAGING)."""
    obj = decode(payload, sender, state.transport.limits)
    step = obj.get("step") if isinstance(obj, dict) else None
    if type(step) is not int:
        raise RemoteError(Evidence(sender, "malformed", "bad parts request"))
    return encode({"step": step, "parts": state.used.get(step, {})})
