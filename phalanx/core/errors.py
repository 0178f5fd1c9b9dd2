"""Errors that keep "we erred" apart from "the peer erred".

`LocalError` is our bug or a misuse of the API: fix the caller.
`RemoteError` is a peer's misbehaviour: it carries `Evidence` against that peer
and must never crash a run; protocols turn it into an accusation or a ban.
`PeerTimeout` is neither: a peer was silent, which may be a crash or a slow link.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PhalanxError(Exception):
    """Base of every error phalanx raises on purpose."""


class LocalError(PhalanxError):
    """Our side erred: a bug or a misuse of the API."""


class ConfigError(LocalError, ValueError):
    """A user's configuration is invalid; the message says what to change."""


@dataclass(frozen=True)
class Evidence:
    """What a peer did wrong, in a form other peers can log or re-check.

    `kind` is a short stable tag (bad_signature, oversize, malformed, non_finite,
    wrong_shape, equivocation, bad_reveal, no_reveal, ...); `data` holds the
    offending bytes or signed envelopes where they make a transferable proof.
    """

    peer: str
    kind: str
    detail: str
    step: int | None = None
    data: tuple[bytes, ...] = field(default=(), repr=False)


class RemoteError(PhalanxError):
    """A peer sent something it must not have; `evidence` says what."""

    def __init__(self, evidence: Evidence) -> None:
        super().__init__(f"peer {evidence.peer[:8]} {evidence.kind}: {evidence.detail}")
        self.evidence = evidence


class PeerTimeout(PhalanxError):
    """A peer did not answer in time (crashed, partitioned or slow)."""

    def __init__(self, peer: str, what: str) -> None:
        super().__init__(f"peer {peer[:8]} timed out: {what}")
        self.peer = peer


class PeerUnreachable(PhalanxError):
    """No route to a peer: it is not a member, is crashed or is partitioned away."""

    def __init__(self, peer: str, why: str) -> None:
        super().__init__(f"peer {peer[:8]} unreachable: {why}")
        self.peer = peer


class RequestFailed(PhalanxError):
    """A peer answered a request with an error instead of a response."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer[:8]} rejected the request: {reason}")
        self.peer = peer
        self.reason = reason
