"""Core: what every other layer stands on; no networking, no training.

- identity: Ed25519 keys, peer ids, cached signature checks
- envelope: signed envelopes and equivocation proofs
- serialization: canonical message/tensor encoding with limits (never pickle)
- rng: random streams derived from (run seed, peer, step, purpose)
- clock: the event loop's clock (virtual in the simulator)
- errors: LocalError (our bug) vs RemoteError (a peer's misbehaviour, with Evidence)
"""

from .clock import Clock
from .envelope import EquivocationProof, SignedEnvelope
from .errors import (
    ConfigError,
    Evidence,
    LocalError,
    PeerTimeout,
    PeerUnreachable,
    PhalanxError,
    RemoteError,
    RequestFailed,
)
from .identity import Identity, peer_id_of, verify_signature
from .rng import derive_seed, py_stream, torch_stream
from .serialization import DEFAULT_LIMITS, Limits, check_tensor, decode, digest, encode

__all__ = [
    "Clock",
    "ConfigError",
    "DEFAULT_LIMITS",
    "EquivocationProof",
    "Evidence",
    "Identity",
    "Limits",
    "LocalError",
    "PeerTimeout",
    "PeerUnreachable",
    "PhalanxError",
    "RemoteError",
    "RequestFailed",
    "SignedEnvelope",
    "check_tensor",
    "decode",
    "derive_seed",
    "digest",
    "encode",
    "peer_id_of",
    "py_stream",
    "torch_stream",
    "verify_signature",
]
