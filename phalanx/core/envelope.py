"""Signed envelopes: small messages whose signature makes them transferable proof.

The signature covers the sha256 digest of the canonical encoding of
(topic, step, sender, public key, sha256(payload)); a receiver checks it, and
that the sender id is the hash of the enclosed key, before trusting anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Evidence, RemoteError
from .identity import Identity, peer_id_of, verify_signature
from .serialization import DEFAULT_LIMITS, Limits, decode, digest, encode


@dataclass(frozen=True)
class SignedEnvelope:
    sender: str
    public_key: bytes
    topic: str
    step: int
    payload: bytes
    signature: bytes

    @classmethod
    def create(cls, identity: Identity, topic: str, step: int, payload: bytes) -> "SignedEnvelope":
        unsigned = cls(identity.peer_id, identity.public_key, topic, step, payload, b"")
        return cls(identity.peer_id, identity.public_key, topic, step, payload, identity.sign(unsigned.digest()))

    def digest(self) -> bytes:
        """What the signature covers."""
        return digest(encode([self.topic, self.step, self.sender, self.public_key, digest(self.payload)]))

    @property
    def slot(self) -> tuple[str, int, str]:
        """(topic, step, sender): one sender may sign one payload per slot."""
        return (self.topic, self.step, self.sender)

    def verify(self) -> "SignedEnvelope":
        """Return self if the signature and key binding hold, else raise RemoteError."""
        if peer_id_of(self.public_key) != self.sender:
            raise RemoteError(Evidence(self.sender, "bad_signature", "public key does not hash to sender id", self.step))
        if not verify_signature(self.public_key, self.digest(), self.signature):
            raise RemoteError(Evidence(self.sender, "bad_signature", f"invalid signature on {self.topic}", self.step))
        return self

    def to_bytes(self) -> bytes:
        return encode(
            {
                "sender": self.sender,
                "key": self.public_key,
                "topic": self.topic,
                "step": self.step,
                "payload": self.payload,
                "sig": self.signature,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, relayed_by: str, limits: Limits = DEFAULT_LIMITS) -> "SignedEnvelope":
        """Parse (not verify) an envelope; malformed bytes are evidence against `relayed_by`."""
        obj = decode(data, relayed_by, limits)
        try:
            env = cls(obj["sender"], obj["key"], obj["topic"], obj["step"], obj["payload"], obj["sig"])
        except (KeyError, TypeError) as exc:
            raise RemoteError(Evidence(relayed_by, "malformed", f"envelope field missing: {exc}")) from None
        types_ok = (
            isinstance(env.sender, str)
            and isinstance(env.public_key, bytes)
            and isinstance(env.topic, str)
            and isinstance(env.step, int)
            and isinstance(env.payload, bytes)
            and isinstance(env.signature, bytes)
        )
        if not types_ok:
            raise RemoteError(Evidence(relayed_by, "malformed", "envelope field of wrong type"))
        return env


@dataclass(frozen=True)
class EquivocationProof:
    """Two validly signed, different payloads from one sender for one slot."""

    first: SignedEnvelope
    second: SignedEnvelope

    def check(self) -> bool:
        """Anyone can re-check the proof without trusting who presents it."""
        try:
            self.first.verify()
            self.second.verify()
        except RemoteError:
            return False
        return self.first.slot == self.second.slot and self.first.payload != self.second.payload

    def evidence(self) -> Evidence:
        return Evidence(
            self.first.sender,
            "equivocation",
            f"two payloads for {self.first.topic}@{self.first.step}",
            self.first.step,
            (self.first.to_bytes(), self.second.to_bytes()),
        )
