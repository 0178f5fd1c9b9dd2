"""BTARD's signed payloads, parsed totally: each parser returns the fields of a well-formed payload, or None.

None means the sender sent what no honest peer sends; the round turns it into evidence against the sender
(or a drop) rather than an exception. `parts_in` checks an accusation's evidence against the target's
commitment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...algorithms.btard.checks import ACCUSE, ELIMINATE, tensor_hash
from ...core.errors import RemoteError
from ...core.serialization import DEFAULT_LIMITS, decode
from ...transport.base import Transport

if TYPE_CHECKING:
    from .btard_state import StepState

DROP_REASONS = ("missing_part", "part_hash", "bad_part", "late_commit")  # why an owner left a committed part out


def decoded(payload: bytes, sender: str, transport: Transport | None):
    try:
        return decode(payload, sender, transport.limits if transport else DEFAULT_LIMITS)
    except RemoteError:
        return None


def group_in(obj) -> bytes | None:
    """The group digest a decoded signed payload names (None: none)."""
    return obj.get("g") if isinstance(obj, dict) and isinstance(obj.get("g"), bytes) else None


def commit_in(obj, n: int) -> tuple[list[bytes], bytes] | None:
    if not isinstance(obj, dict) or set(obj) - {"inputs"} != {"g", "parts", "whole"}:
        return None
    if "inputs" in obj and not (isinstance(obj["inputs"], bytes) and len(obj["inputs"]) == 32):
        return None
    parts, whole = obj["parts"], obj["whole"]
    if not isinstance(parts, list) or len(parts) != n or not all(isinstance(h, bytes) and len(h) == 32 for h in parts):
        return None
    return (parts, whole) if isinstance(whole, bytes) and len(whole) == 32 else None


def rcommit_in(obj, group: list[str]) -> tuple[bytes, list[str], dict[str, str]] | None:
    """(aggregate hash, the owners whose parts it used, {dropped owner: reason}); None: malformed."""
    if not isinstance(obj, dict) or set(obj) != {"g", "h", "from", "drop"}:
        return None
    h, used, drop = obj["h"], obj["from"], obj["drop"]
    if not isinstance(h, bytes) or len(h) != 32 or not isinstance(used, list) or not all(p in group for p in used):
        return None
    if not isinstance(drop, dict) or not all(p in group and isinstance(r, str) and r in DROP_REASONS for p, r in drop.items()):
        return None
    return (h, used, drop) if len(set(used)) == len(used) and not set(used) & set(drop) else None


def meta_in(payload: bytes, sender: str, transport) -> tuple[dict, dict] | None:
    obj = decoded(payload, sender, transport)
    if not isinstance(obj, dict) or not isinstance(obj.get("norm"), dict) or not isinstance(obj.get("s"), dict):
        return None
    norms = {k: float(v) for k, v in obj["norm"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    s = {k: float(v) for k, v in obj["s"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return norms, s


def report_in(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("claims"), list) or not isinstance(obj.get("approve"), list):
        return None
    if not isinstance(obj.get("unverified"), list):
        return None
    seen = obj.get("seen")
    if not isinstance(seen, dict) or not all(isinstance(t, str) and isinstance(m, dict) for t, m in seen.items()):
        return None
    if not all(isinstance(p, str) and isinstance(d, bytes) for m in seen.values() for p, d in m.items()):
        return None
    for c in obj["claims"]:
        if not isinstance(c, dict) or c.get("kind") not in (ACCUSE, ELIMINATE) or not isinstance(c.get("target"), str):
            return None
        if not isinstance(c.get("reason"), str) or not isinstance(c.get("ev"), list):
            return None
    return obj


def parts_in(evidence, st: "StepState", target: str) -> dict[int, torch.Tensor] | None:
    """A gradient accusation's evidence, {partition: committed part}; None unless every part matches
    the target's commitment."""
    if target not in st.commits or not evidence:
        return None
    parts: dict[int, torch.Tensor] = {}
    for item in evidence:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return None
        j, part = item
        if type(j) is not int or not 0 <= j < len(st.bounds) or j in parts or not isinstance(part, torch.Tensor):
            return None
        a, b = st.bounds[j]
        if part.dtype != torch.float32 or tuple(part.shape) != (b - a,) or tensor_hash(part) != st.commits[target][0][j]:
            return None
        parts[j] = part
    return parts


def malformed_part(part, size: int) -> bool:
    """A part that no honest peer sends: not a float32 vector of `size` finite values."""
    if not isinstance(part, torch.Tensor) or part.dtype != torch.float32 or tuple(part.shape) != (size,):
        return True
    return not bool(torch.isfinite(part).all())


def declared_hash(obj: object) -> bytes | None:
    """The aggregate hash a declaration binds, also when the rest of it is malformed; None if it binds none."""
    h = obj.get("h") if isinstance(obj, dict) else None
    return h if isinstance(h, bytes) and len(h) == 32 else None
