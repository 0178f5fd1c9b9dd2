"""Ed25519 identities; a peer id is the hash of the public key.

Signatures are taken over 32-byte digests, never over megabytes of payload.
Verification results are cached per (key, digest, signature): verifying is a
pure function, and in the simulator hundreds of peers check the same broadcast.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def peer_id_of(public_key: bytes) -> str:
    """The peer id of a raw 32-byte Ed25519 public key: 32 hex chars of sha256."""
    return hashlib.sha256(b"phalanx-peer-id" + public_key).hexdigest()[:32]


@dataclass(frozen=True)
class Identity:
    """A private signing key with its public key and peer id."""

    private_key: Ed25519PrivateKey
    public_key: bytes
    peer_id: str

    @classmethod
    def from_private_key(cls, key: Ed25519PrivateKey) -> "Identity":
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(key, public, peer_id_of(public))

    @classmethod
    def generate(cls) -> "Identity":
        """A fresh random identity (real peers)."""
        return cls.from_private_key(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """A deterministic identity from any seed bytes (simulated peers, tests)."""
        return cls.from_private_key(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    def sign(self, digest: bytes) -> bytes:
        """Sign a digest (Ed25519 is deterministic: same digest, same signature)."""
        return self.private_key.sign(digest)


@lru_cache(maxsize=65536)
def verify_signature(public_key: bytes, digest: bytes, signature: bytes) -> bool:
    """True when `signature` is `public_key`'s signature of `digest`."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, digest)
    except (InvalidSignature, ValueError):
        return False
    return True
