"""BTARD verification math, tolerances and the canonical ban order (pure; no I/O).

Notation (BTARD Alg. 6): peer i's gradient g_i is cut into parts g_i(j), one
per partition owner j; the owner returns the aggregate a_j = ĝ(j). For each
(i, j): norm_ij = ||g_i(j) - a_j||, Δ_i^j = (g_i(j) - a_j) min(1, τ/norm_ij),
s_i^j = <z_j, Δ_i^j> with z the step's random direction drawn from MPRNG.

- V1: the owner j recomputes norm_ij from the part it holds and checks i's report.
- V2: the owner recomputes s_i^j; everyone checks that Σ_i s_i^j = 0 (the
  CenteredClip fixed-point equation, projected on z_j).
- V3: check_ij = [norm_ij > Δ_max]; more than half flags -> CHECKAVERAGING(j).
- Validation: a recomputed gradient is compared with the committed one.

Real numbers are not exact, so each equality holds within a tolerance that is
derived next to its check. Every quantity is computed in float64 from the
float32 tensors that were sent, so both sides of a check start from the same
bits and differ only by the order of float64 summation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3
import torch
from torch import Tensor

from .bans import BanLedger, BanRecord

# V1. Both sides hold the same float32 part and aggregate; their difference is
# exact in float64 and only the order of the m-term float64 sum of squares may
# differ, which moves the norm by at most m * 2^-53 relative (1e-10 at m = 1e6).
# 1e-6 leaves four orders of magnitude of margin and still catches any lie of
# 1e-3 relative size.
NORM_RTOL = 1e-6

# V2 (owner's check of one s). Same inputs on both sides; the float64 inner
# product's rounding depends on summation order by at most
# m * 2^-53 * ||z_j|| * ||Δ|| (Cauchy-Schwarz on the sum of |z_k Δ_k|), i.e.
# 1.1e-10 ||z_j|| ||Δ|| at m = 1e6. The tolerance is 1e-8 ||z_j|| ||Δ||.
S_RTOL = 1e-8

# V2 (everyone's check of the sum). At the exact CenteredClip fixed point the
# residual r = Σ_i Δ_i is 0. An honest owner stops when an update r/k is at
# most eps, so ||r|| <= 2 k eps after that update, and rounding a_j to float32
# moves each coordinate by <= 2^-24 |a|, which moves r by <= k 2^-24 ||a_j||
# (each Δ_i is 1-Lipschitz in a). z_j ~ N(0, I) is drawn after a_j is
# committed, so <z_j, r> ~ N(0, ||r||^2): six sigmas (p = 2e-9 per check)
# bound the honest sum, plus the float error of each s (S_RTOL above).
SUM_SIGMAS = 6.0
FLOAT32_ROUNDING = 2.0**-24

# Validation. The validator recomputes the gradient with the same code, model
# and public batch. On the same build this is bit-identical; across BLAS
# builds and hardware, float32 backprop differs by ~1e-6 relative (reduction
# order). 1e-4 gives 100x margin; a lie below it moves the aggregate by less
# than 1e-4 ||g|| / n, far under the step's sampling noise.
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-7

# CHECKAVERAGING: everyone reruns the owner's rule on the committed parts. The
# owner's own run stops within eps, and the float32 result is rounded by
# 2^-24; the same code gives the same bits, other builds differ by a few eps.
AVERAGING_EPS_FACTOR = 4.0


def tensor_hash(tensor: Tensor) -> bytes:
    """BLAKE3 over dtype, shape and raw bytes: the commitment to a tensor.

    BLAKE3 (a dependency of hivemind's multihash) hashes about 2.5x faster
    than SHA-256 on one core here; every peer must use the same function, so
    there is no fallback. The bytes are read in place, without a copy.
    """
    t = tensor.detach().contiguous()
    h = blake3.blake3(b"phalanx-tensor")
    h.update(str(t.dtype).encode() + b"|" + ",".join(map(str, t.shape)).encode() + b"|")
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


def gradient_hash(part_hashes: list[bytes]) -> bytes:
    """The commitment to a whole gradient: a hash of its part hashes, so no byte is hashed twice."""
    return blake3.blake3(b"phalanx-gradient|" + b"".join(part_hashes)).digest()


def direction(r: bytes, dim: int) -> Tensor:
    """The step's random direction z ~ N(0, I_dim), float32, drawn from the MPRNG output r."""
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(b"btard-z" + r).digest()[:8], "little") >> 1)
    return torch.randn(dim, generator=generator)


@dataclass(frozen=True)
class Projection:
    """norm_ij, s_ij and ||Δ_i^j|| of one part against its aggregate."""

    norm: float
    s: float
    delta_norm: float


def project(part: Tensor, aggregate: Tensor, z: Tensor, tau: float) -> Projection:
    """norm = ||g - a||, Δ = (g - a) min(1, τ/norm), s = <z, Δ>, all in float64."""
    diff = part.to(torch.float64) - aggregate.to(torch.float64)
    norm = float(torch.linalg.vector_norm(diff))
    weight = 1.0 if norm <= tau else tau / norm
    s = float(torch.dot(z.to(torch.float64), diff)) * weight  # a float64 z (one conversion per step) is used as is
    return Projection(norm, s, norm * weight)


def norm_matches(reported: float, computed: float) -> bool:
    """V1: the reported norm equals the recomputed one within NORM_RTOL."""
    return isinstance(reported, float) and abs(reported - computed) <= NORM_RTOL * computed + 1e-30


def s_matches(reported: float, computed: Projection, z_norm: float) -> bool:
    """V2 (owner): the reported s equals the recomputed one within S_RTOL ||z_j|| ||Δ||."""
    return isinstance(reported, float) and abs(reported - computed.s) <= S_RTOL * z_norm * computed.delta_norm + 1e-30


def sum_tolerance(count: int, eps: float, aggregate_norm: float, z_norm: float, delta_norms: list[float]) -> float:
    """V2 (everyone): the bound on |Σ_i s_i^j| for an honest owner of `count` parts (derivation above)."""
    residual = 2 * count * eps + count * FLOAT32_ROUNDING * aggregate_norm
    return SUM_SIGMAS * residual + S_RTOL * z_norm * sum(delta_norms)


def sum_holds(s_values: list[float], tolerance: float) -> bool:
    """V2 (everyone): Σ_i s_i^j = 0 within `tolerance` (NaN or missing values fail)."""
    total = math.fsum(s_values)
    return math.isfinite(total) and abs(total) <= tolerance


def gradient_matches(committed: Tensor, recomputed: Tensor, scale: Tensor | None = None) -> bool:
    """Validation: ||g_committed - g_recomputed|| <= GRAD_RTOL ||s|| + GRAD_ATOL sqrt(dim s).

    s is the whole recomputed gradient (`scale`) when only some of its parts are compared: an
    honest gradient's whole gap is within the bound, so the gap of any subset is too.
    """
    if committed.shape != recomputed.shape or committed.dtype != recomputed.dtype:
        return False
    whole = recomputed if scale is None else scale
    gap = float(torch.linalg.vector_norm(committed.to(torch.float64) - recomputed.to(torch.float64)))
    size = float(torch.linalg.vector_norm(whole.to(torch.float64)))
    return math.isfinite(gap) and gap <= GRAD_RTOL * size + GRAD_ATOL * math.sqrt(whole.numel())


def averaging_matches(reported: Tensor, recomputed: Tensor, eps: float) -> bool:
    """CHECKAVERAGING: the owner's aggregate equals the rerun within a few eps plus float32 rounding."""
    if reported.shape != recomputed.shape:
        return False
    gap = float(torch.linalg.vector_norm(reported.to(torch.float64) - recomputed.to(torch.float64)))
    scale = float(torch.linalg.vector_norm(recomputed.to(torch.float64)))
    return math.isfinite(gap) and gap <= AVERAGING_EPS_FACTOR * (eps + FLOAT32_ROUNDING * scale)


def v3_flags(norms: list[float], delta_max: float) -> int:
    """V3: how many reported norms of one partition exceed Δ_max."""
    return sum(1 for norm in norms if not norm <= delta_max)


SILENT_DROPS = ("late_commit", "missing_part")  # an owner's drop of a sender that sent it nothing in time


def passed_over(owners: list[str], drops: dict[str, dict[str, str]]) -> set[str] | None:
    """Owners whose partition a step leaves out because they sent most owners nothing in time (their
    commitment or their parts); None while the declarations at hand do not decide it.

    `drops`: the aggregate commitments held so far, owner -> {dropped owner: reason}. An owner is
    passed over once more than half of the other owners' declarations drop it as silent (`SILENT_DROPS`:
    `silent_for_most`), and that is decided once every other owner is either passed over or declared and
    can no longer be (its silent drops and the undeclared others are at most half of its others). The
    count is monotone: a declaration that comes later (a colluder's, sent to some peers only, that says it
    used a fellow colluder's part) never revives an owner that others already passed over, and with
    f < n / 2 at least one honest owner found every owner passed over silent. A lone declaration that calls
    every other owner late passes nobody over. The outcome reads signed declarations only, never when an
    aggregate arrived: a crashed owner is not waited for, and a slow one whose aggregate reaches some
    peers in time is left out by all of them (itself too).
    """
    others = len(owners) - 1
    passed = silent_for_most(owners, drops)
    undecided = [
        o for o in owners if o not in passed and not (
            o in drops and 2 * (_silent_drops(o, drops) + sum(1 for d in owners if d != o and d not in drops)) <= others)
    ]
    return None if undecided else passed


def silent_for_most(owners: list[str], drops: dict[str, dict[str, str]]) -> set[str]:
    """Owners that the declarations held of more than half of the other owners drop as silent: passed over
    whatever declarations come later (`passed_over`)."""
    return {o for o in owners if 2 * _silent_drops(o, drops) > len(owners) - 1}


def _silent_drops(owner: str, drops: dict[str, dict[str, str]]) -> int:
    return sum(1 for d in drops if d != owner and drops[d].get(owner) in SILENT_DROPS)


# --- claims and their canonical order (BTARD App. D.3) ------------------------

ACCUSE, ELIMINATE = "accuse", "eliminate"  # sorted: every ACCUSE is processed before any ELIMINATE


@dataclass(frozen=True, order=True)
class Claim:
    """One ACCUSE or ELIMINATE of `target` by `accuser` in one step.

    ACCUSE carries evidence that every honest peer re-checks; ELIMINATE needs
    none, and bans the accuser along with the target.
    """

    kind: str
    accuser: str
    target: str
    reason: str
    evidence: tuple = field(default=(), compare=False)


@dataclass(frozen=True)
class Verdict:
    guilty: bool
    covered_by: tuple[str, ...] = ()  # peers that approved the target's lie (banned with it)
    judged: bool = True  # False: this peer cannot weigh the evidence (it lacks the state it needs): nobody is banned


def resolve(
    ledger: BanLedger, step: int, claims: list[Claim], verdict: Callable[[Claim], Verdict], apply: bool = True
) -> list[BanRecord]:
    """Process one step's claims in canonical order; returns the bans that took effect.

    Order is (kind, accuser, target, reason) with ACCUSE first. A claim that
    involves a peer banned earlier in this order is ignored, so a Byzantine
    can take at most one honest peer with it. ELIMINATE(i, j) bans j and i:
    only i saw the fault (a part that does not match its commitment, a part
    that never came), so nobody else can tell whether i or j lies, and banning
    both removes at least one Byzantine while costing at most one honest peer.
    ACCUSE bans the target (and those who covered it) when the evidence holds,
    else the accuser (slander). An accuser "" marks a failure that every
    honest peer derives from broadcasts it holds (a failed sum, a split view). With `apply=False` nothing is banned (a
    benchmark baseline); the would-be bans are still returned.
    """
    shadow = ledger if apply else _copy(ledger)
    applied: list[BanRecord] = []
    seen: set[tuple[str, str, str, str]] = set()
    for claim in sorted(claims):
        key = (claim.kind, claim.accuser, claim.target, claim.reason)
        if key in seen or shadow.is_banned(claim.accuser) or shadow.is_banned(claim.target) or claim.accuser == claim.target:
            continue
        seen.add(key)
        if claim.kind == ELIMINATE:
            records = [BanRecord(step, claim.target, f"eliminated:{claim.reason}", claim.accuser), BanRecord(step, claim.accuser, "eliminator", claim.accuser)]
        else:
            outcome = verdict(claim)
            if outcome.guilty:
                records = [BanRecord(step, claim.target, claim.reason, claim.accuser)]
                records += [BanRecord(step, peer, f"covered:{claim.reason}", claim.accuser) for peer in outcome.covered_by]
            elif not claim.accuser or not outcome.judged:
                records = []  # a failure every honest peer derives itself did not hold, or a claim this peer cannot weigh
            else:
                records = [BanRecord(step, claim.accuser, f"slander:{claim.reason}", claim.accuser)]
        for record in records:
            applied += shadow.apply([record])
    return applied


def _copy(ledger: BanLedger) -> BanLedger:
    copy = BanLedger()
    copy.apply(ledger.records)
    return copy
