"""Pipeline messages: topics, the microbatch key, and total parsers that turn bad bytes into evidence.

A microbatch is named by (data node, sequence number, attempt): the data node
is its source and sink, the sequence number fixes its public samples, and a
restart from scratch (SWARM) bumps the attempt. Activations and gradients
travel with the path list (path[s] serves stage s; path[0] is the data node).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.errors import Evidence, RemoteError
from ...core.identity import Identity, peer_id_of, verify_signature
from ...core.serialization import Limits, decode, digest, encode, tensor_bytes

FORWARD = "pp.fwd"  # request: activation for stage s; answered COMPLETE (ok), DENY (full) or STALE
BACKWARD = "pp.bwd"  # request: gradient of stage s's output; answered COMPLETE (ok) or UNKNOWN
DENY = "pp.deny"  # one-way, downstream -> upstream: I cannot place this microbatch further
BROKEN = "pp.broken"  # one-way, to the data node: my gradient could not reach the previous stage
PING = "pp.ping"  # request: do you still hold this microbatch's activations?
REFORWARD = "pp.refwd"  # request, data node -> last live node: resend your stored output to a new peer
RESUME = "pp.resume"  # request, repair peer -> gradient holder: the broken stage is rebuilt, send on
RESENDS = "pp.resends"  # request, data node -> gradient holder: a repair of the stage before you resends from this node
REPAIRED = "pp.repaired"  # one-way, gradient holder -> data node: I resumed the repair of a stage with this path prefix
DONE = "pp.done"  # one-way, data node -> leader: my microbatches of this iteration are settled
BEGIN = "pp.begin"  # one-way flood, front to back: BEGIN AGGREGATION
CAN_TAKE = "pp.cantake"  # one-way, back to front: aggregated, ready for the next iteration
SUSPECT = "pp.suspect"  # one-way, relay -> data nodes: this peer did not answer me
HELLO = "pp.hello"  # one-way to every member: I serve this stage from this version (joiners, after the download)
UTIL = "pp.util"  # one-way flood, leader -> stage 1 -> ... -> leader: utilization query (GWTF V-B)
JOIN = "pp.join"  # request, joiner -> leader: my capacity; answered with a stage and the current iteration
WEIGHTS = "pp.weights"  # request: a stage's parameters and optimizer state at a version
STEPPED = "pp.stepped"  # request, replica -> its stage group: the digest (or the whole state) of your weights just stepped to a version

OK, DENIED, STALE, UNKNOWN = "ok", "deny", "stale", "unknown"

Key = tuple[str, int, int]


def key_name(key: Key) -> str:
    return f"{key[0][:8]}/{key[1]}/{key[2]}"


@dataclass(frozen=True)
class Carry:
    """An activation (forward) or activation gradient (backward) of one microbatch at one stage."""

    key: Key
    it: int
    stage: int  # forward: the stage that must process it; backward: the stage whose output it is the gradient of
    path: tuple[str, ...]
    tensor: torch.Tensor
    repair: int = -1  # forward only: recompute up to this stage, then resume the holder's gradient (-1: normal)
    holder: str = ""  # forward repair only: who holds the gradient to resume
    recomputed: tuple[int, ...] = ()
    hops: tuple[Hop, ...] = ()  # signed hop records of this direction's journey so far (boundary verifiers)
    seal: Seal | None = None  # its sender's signature on the tensor (BTARD per stage with validators)
    restart: Restart | None = None  # attempt > 0: its data node's signature on the attempt (a restart)

    def to_bytes(self, pad: int = 0) -> bytes:
        """The wire form; `pad` zero bytes ride along (a simulated larger activation, ignored on receipt)."""
        body = {
            "src": self.key[0], "seq": self.key[1], "att": self.key[2], "it": self.it, "stage": self.stage,
            "path": list(self.path), "t": self.tensor, "repair": self.repair, "holder": self.holder,
            "rec": list(self.recomputed), "hops": [h.to_obj() for h in self.hops],
        }
        if self.seal is not None:
            body["seal"] = self.seal.to_obj()
        if self.restart is not None:
            body["restart"] = self.restart.to_obj()
        if pad > 0:
            body["pad"] = bytes(pad)
        return encode(body)


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """What a hop record says about a tensor: sha256 of its canonical bytes."""
    t = tensor.detach().to(torch.float32).contiguous()
    return digest(encode(list(t.shape)) + tensor_bytes(t))


@dataclass(frozen=True)
class Hop:
    """One hop's signed account of a microbatch's tensor in one direction (SENTINEL's no-framing rule).

    A relay signs what it received and what it sent on, and to whom; a
    boundary verifier signs the same for the link it verifies, naming the
    worker that sent the tensor over it (`sender`). The records travel with
    the carry, so a verifier further on learns who sent the microbatch over
    earlier links from verifiers' signatures, not from the path list a relay
    forwards. `link`: the link the tensor crosses (a relay: its output's link).
    """

    key: Key
    it: int
    direction: str  # "forward" | "backward"
    link: int
    signer: str
    sender: str  # a verifier's record: who sent the tensor over its link; a relay's: ""
    received: bytes  # tensor_digest of what the signer received
    sent: bytes  # tensor_digest of what it sent on
    to: str  # the next hop
    public_key: bytes = b""
    signature: bytes = b""

    def digest(self) -> bytes:
        return digest(encode(["pp.hop", list(self.key), self.it, self.direction, self.link, self.signer, self.sender,
                              self.received, self.sent, self.to]))

    @classmethod
    def signed(cls, identity: Identity, key: Key, it: int, direction: str, link: int, sender: str, received: bytes,
               sent: bytes, to: str) -> "Hop":
        unsigned = cls(key, it, direction, link, identity.peer_id, sender, received, sent, to, identity.public_key)
        return cls(key, it, direction, link, identity.peer_id, sender, received, sent, to, identity.public_key,
                   identity.sign(unsigned.digest()))

    def valid(self) -> bool:
        """The signature is the signer's (its public key hashes to its id) over these fields."""
        return peer_id_of(self.public_key) == self.signer and verify_signature(self.public_key, self.digest(), self.signature)

    def to_obj(self) -> dict:
        return {"src": self.key[0], "seq": self.key[1], "att": self.key[2], "it": self.it, "dir": self.direction,
                "link": self.link, "by": self.signer, "from": self.sender, "in": self.received, "out": self.sent,
                "to": self.to, "pk": self.public_key, "sig": self.signature}


@dataclass(frozen=True)
class Seal:
    """A sender's signature on the tensor it sends for one microbatch, direction and stage (issue 18 item 2).

    The receiving replica of `stage` keeps it with the tensor and commits to both in its stage's BTARD
    round, so that a validator can recompute its stage gradient from inputs that their senders signed:
    the replica cannot claim a tensor nobody sent, and the sender answers for what it signed. Stage:
    forward, the stage that processes the activation; backward, the stage whose output it is the
    gradient of (the same replica's stage in both directions). `to` is not bound: a repair resends the
    same output to another peer, and under client routing the sender does not know the receiver.
    """

    signer: str
    public_key: bytes
    signature: bytes

    @staticmethod
    def statement(key: Key, it: int, direction: str, stage: int, tensor: torch.Tensor) -> bytes:
        return digest(encode(["pp.seal", list(key), it, direction, stage, tensor_digest(tensor)]))

    @classmethod
    def make(cls, identity: Identity, key: Key, it: int, direction: str, stage: int, tensor: torch.Tensor) -> "Seal":
        return cls(identity.peer_id, identity.public_key,
                   identity.sign(cls.statement(key, it, direction, stage, tensor)))

    def valid(self, key: Key, it: int, direction: str, stage: int, tensor: torch.Tensor) -> bool:
        """The signer's signature (its public key hashes to its id) on exactly this tensor, microbatch, direction, stage."""
        return peer_id_of(self.public_key) == self.signer and verify_signature(
            self.public_key, self.statement(key, it, direction, stage, tensor), self.signature)

    def to_obj(self) -> dict:
        return {"by": self.signer, "pk": self.public_key, "sig": self.signature}


@dataclass(frozen=True)
class Restart:
    """A data node's signature on a new attempt of its own microbatch (it restarted the microbatch).

    A relay that holds an earlier attempt frees its slot only for an attempt that carries this: any
    relay on the path could otherwise write a higher attempt number and drop the honest attempt held
    downstream. It travels unchanged with every forward of the attempt; attempt 0 needs none. It names
    the iteration: a deferred microbatch starts again at attempt 0 in a later iteration, so (src, seq,
    att) recurs, and a signature kept from the earlier iteration must not free the new one's attempts.
    """

    public_key: bytes
    signature: bytes

    @staticmethod
    def statement(key: Key, it: int) -> bytes:
        return digest(encode(["pp.attempt", list(key), it]))

    @classmethod
    def make(cls, identity: Identity, key: Key, it: int) -> "Restart":
        return cls(identity.public_key, identity.sign(cls.statement(key, it)))

    def valid(self, key: Key, it: int) -> bool:
        """Signed by the microbatch's data node (its public key hashes to key[0]) for exactly this attempt
        in iteration `it`."""
        return peer_id_of(self.public_key) == key[0] and verify_signature(
            self.public_key, self.statement(key, it), self.signature)

    def to_obj(self) -> dict:
        return {"pk": self.public_key, "sig": self.signature}


def parse_restart(obj: object, sender: str) -> Restart:
    """A restart signature, checked for types only (`Restart.valid` checks it)."""
    if not (isinstance(obj, dict) and all(isinstance(obj.get(k), bytes) and len(obj[k]) <= 128 for k in ("pk", "sig"))):
        raise _bad(sender, "bad restart signature")
    return Restart(obj["pk"], obj["sig"])


def parse_seal(obj: object, sender: str) -> Seal:
    """A seal, checked for types only (`Seal.valid` checks the signature)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("by"), str) and len(obj["by"]) <= 256
            and all(isinstance(obj.get(k), bytes) and len(obj[k]) <= 128 for k in ("pk", "sig"))):
        raise _bad(sender, "bad seal")
    return Seal(obj["by"], obj["pk"], obj["sig"])


def parse_hop(obj: object, sender: str) -> Hop:
    """A hop record, checked for types only (`Hop.valid` checks the signature)."""
    if not isinstance(obj, dict):
        raise _bad(sender, "hop record is not a mapping")
    key = parse_key(obj, sender)
    it, direction, link = obj.get("it"), obj.get("dir"), obj.get("link")
    texts = [obj.get(k) for k in ("by", "from", "to")]
    blobs = [obj.get(k) for k in ("in", "out", "pk", "sig")]
    if not (_is_int(it) and direction in ("forward", "backward") and _is_int(link)
            and all(isinstance(t, str) and len(t) <= 256 for t in texts)
            and all(isinstance(b, bytes) and len(b) <= 128 for b in blobs)):
        raise _bad(sender, "bad hop record")
    return Hop(key, it, direction, link, texts[0], texts[1], blobs[0], blobs[1], texts[2], blobs[2], blobs[3])


def _bad(sender: str, detail: str, it: int | None = None, kind: str = "malformed") -> RemoteError:
    return RemoteError(Evidence(sender, kind, detail, it))


def _is_int(value: object) -> bool:
    return type(value) is int and value >= 0


def parse_key(obj: dict, sender: str) -> Key:
    src, seq, att = obj.get("src"), obj.get("seq"), obj.get("att")
    if not (isinstance(src, str) and _is_int(seq) and _is_int(att)):
        raise _bad(sender, "microbatch key needs src (str), seq and att (ints >= 0)")
    return (src, seq, att)


def parse_mapping(payload: bytes, sender: str, limits: Limits, what: str) -> dict:
    obj = decode(payload, sender, limits)
    if not isinstance(obj, dict):
        raise _bad(sender, f"{what} is not a mapping")
    return obj


def parse_carry(payload: bytes, sender: str, limits: Limits, max_stage: int) -> Carry:
    """A forward or backward message, checked for shape of the envelope (not of the tensor)."""
    obj = parse_mapping(payload, sender, limits, "pipeline message")
    key = parse_key(obj, sender)
    it, stage, path, tensor = obj.get("it"), obj.get("stage"), obj.get("path"), obj.get("t")
    repair, holder, rec, hops = obj.get("repair", -1), obj.get("holder", ""), obj.get("rec", []), obj.get("hops", [])
    if not (_is_int(it) and _is_int(stage) and stage <= max_stage):
        raise _bad(sender, f"iteration and stage must be ints (stage <= {max_stage})")
    if not (isinstance(path, list) and 1 <= len(path) <= max_stage + 1 and all(isinstance(p, str) for p in path)):
        raise _bad(sender, "path must be a non-empty list of peer ids", it)
    if not isinstance(tensor, torch.Tensor):
        raise _bad(sender, "pipeline message carries no tensor", it)
    if type(repair) is not int or repair < -1 or repair > max_stage or not isinstance(holder, str):
        raise _bad(sender, "bad repair fields", it)
    if not (isinstance(rec, list) and len(rec) <= 4 * (max_stage + 1) and all(_is_int(s) for s in rec)):
        raise _bad(sender, "bad recomputation list", it)
    if not (isinstance(hops, list) and len(hops) <= 4 * (max_stage + 1)):
        raise _bad(sender, "bad hop records", it)
    seal = parse_seal(obj["seal"], sender) if "seal" in obj else None
    restart = parse_restart(obj["restart"], sender) if "restart" in obj else None
    return Carry(key, it, stage, tuple(path), tensor, repair, holder, tuple(rec), tuple(parse_hop(h, sender) for h in hops),
                 seal, restart)


def answer(word: str) -> bytes:
    return encode(word)


def parse_answer(payload: bytes, sender: str, limits: Limits) -> str:
    word = decode(payload, sender, limits)
    if word not in (OK, DENIED, STALE, UNKNOWN):
        raise _bad(sender, f"unexpected answer {word!r}")
    return word
