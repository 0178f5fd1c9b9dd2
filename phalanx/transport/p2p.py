"""The real-network transport: each peer is an OS process with hivemind's libp2p daemon and DHT.

Identity binding. The libp2p daemon runs with this peer's own Ed25519 key, so
its libp2p id is derived from the same public key as its phalanx id, and
libp2p's secure channel (noise or TLS 1.3) authenticates that key on every
stream. A membership record ties the two ids together once more, under a
signature, for others to check before they talk to a peer; a stream from a
libp2p id without a valid record is dropped.

Membership. Every peer stores a signed, expiring record in the DHT under
``phalanx/<run_id>/members``, subkey = its phalanx id, and re-stores it every
ttl/3 (a store still running then is not waited for: a slow DHT under load
must not age the record that streams present). The signature covers (run_id, peer id, libp2p id, expiration), so a
record cannot be moved to another run, peer or lifetime; a validator in every
honest DHT node rejects records whose signature fails or whose DHT expiration
differs from the signed one (BTARD App. G: replay cannot extend a record).
A background task reads the records every ``refresh_interval``. Each
stream also carries the current records of both ends (see the wire format),
so peers that talk keep each other in view even while DHT lookups fail (a
busy DHT times out, and backs off from nodes that did). The record a stream
presents is signed afresh once the one held is a third of the ttl old, so a
peer that is alive and talking is never refused for a stale record, however
late its loop runs the re-store. A peer that stopped signs nothing more: it
leaves every view at most one ttl after its last stream or store.

Wire format. Raw bytes over libp2p streams through the daemon, one message or
request at a time per stream. A frame is ``kind u8 | topic length u8 | payload
length u64 | topic | payload``; the receiver checks the lengths against its
limits before it reads the payload. An exchange is: the requester's RECORD
(topic: its phalanx id, payload: its membership record) and its MESSAGE or
REQUEST frame, then the answerer's RECORD and its answer; a record is taken
into the view only if it is valid, live, newer than the one held, and names the
libp2p id that the secure channel authenticated. A one-way message is answered
with an empty RESPONSE (an ack, so that `send` returns once the peer has it); a
request with RESPONSE or ERROR. After a complete exchange the requester keeps
the stream for its next exchange with that peer (up to POOL_IDLE seconds idle,
POOL_SIZE streams per peer): opening a stream costs a connection to each
daemon and a protocol negotiation between them, more than a small message
itself. The answerer serves exchanges on a stream one after another until the
requester closes it, or SERVE_IDLE seconds pass without one. The requester
closes first; the answerer waits for that before it closes its end (the daemon
may reset a stream closed early, cutting the answer). A reused stream found
closed before any byte of the answer is retried once on a fresh stream: if the
answerer had taken the exchange and closed without answering (it was stopping),
the message or request arrives twice (the board and the all-reduce keep the
first; a quota-counted request, `bt.aggregate`, counts twice).

Importing this module imports hivemind (about a second), which also sets
torch's sharing strategy to ``file_system`` and renames the WARNING log level
to ``WARN`` process-wide. Starting a transport sets ``LIBP2P_TCP_REUSEPORT=false``
in the process environment unless it is set (see `REUSEPORT_ENV`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
)
from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from ..core.envelope import SignedEnvelope
from ..core.errors import (
    ConfigError,
    Evidence,
    LocalError,
    PeerTimeout,
    PeerUnreachable,
    RemoteError,
    RequestFailed,
)
from ..core.identity import PUBLIC_KEY_BYTES, Identity, peer_id_of, verify_signature
from ..core.serialization import DEFAULT_LIMITS, Limits, decode, digest, encode
from .base import BROADCAST_TOPIC, Transport

log = logging.getLogger(__name__)

MESSAGE, REQUEST, RESPONSE, ERROR, RECORD = 0, 1, 2, 3, 4
_HEADER = struct.Struct("<BBQ")
MAX_TOPIC_BYTES = 255
WRITE_CHUNK = 2**20
# How far in the future a record's expiration may lie beyond the ttl: the
# allowance for clocks of different peers disagreeing.
CLOCK_SKEW = 30.0
STARTUP_TIMEOUT = 30.0
# A stream is reused for the next exchange with its peer while it has been idle less than POOL_IDLE seconds;
# the answerer closes a stream idle SERVE_IDLE seconds, well after the requester stopped reusing it, so that
# a reused stream is never one the answerer is closing. At most POOL_SIZE idle streams are kept per peer.
POOL_IDLE = 10.0
SERVE_IDLE = 30.0
POOL_SIZE = 8
# How long `stop` lets the sends of this peer's last broadcasts finish (each is also bounded by send_timeout).
LINGER = 5.0
# At most this many broadcast sends to one member wait for its ack at a time; further broadcasts skip it (it
# fetches what it misses from the sender and relays, as any member that missed one). Above a BTARD step's 8
# broadcasts: a member whose loop is busy for a step misses none. Without a cap, a member that never acks (frozen,
# or Byzantine and still in view) holds a stream and a daemon socket per broadcast for send_timeout each.
BROADCAST_BACKLOG = 32
# libp2p dials over TCP from its listening port by default (port reuse, for NAT mappings). Two peers
# that dial each other at the same instant then make one TCP connection (a simultaneous open) on which
# both ends start the secure handshake as its initiator; it fails ("noise: message is too short"),
# the dial fails on both sides, and libp2p refuses to dial that peer again for seconds ("dial
# backoff"). With 40 ms links that happened in about one launch of three, at the start barrier.
# Dialling from an ephemeral port makes crossing dials two connections, which libp2p keeps apart.
REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"


def membership_key(run_id: str) -> str:
    """The DHT key under which the members of run `run_id` store their records."""
    return f"phalanx/{run_id}/members"


def libp2p_id_of(public_key: bytes) -> bytes:
    """The libp2p peer id of a raw Ed25519 public key (an identity multihash of its protobuf)."""
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public_key).SerializeToString()
    return bytes([0x00, len(proto)]) + proto


@dataclass(frozen=True)
class MembershipRecord:
    """A peer's signed claim: "I am `peer_id`, reachable as `libp2p_id`, until `expiration`"."""

    peer_id: str
    public_key: bytes
    libp2p_id: bytes
    expiration: float
    signature: bytes

    @staticmethod
    def signed_digest(run_id: str, peer_id: str, libp2p_id: bytes, expiration: float) -> bytes:
        """What the signature covers."""
        return digest(encode(["phalanx-membership", run_id, peer_id, libp2p_id, expiration]))

    @classmethod
    def create(cls, identity: Identity, run_id: str, expiration: float) -> "MembershipRecord":
        libp2p_id = libp2p_id_of(identity.public_key)
        signature = identity.sign(cls.signed_digest(run_id, identity.peer_id, libp2p_id, expiration))
        return cls(identity.peer_id, identity.public_key, libp2p_id, expiration, signature)

    def to_bytes(self) -> bytes:
        return encode(
            {"libp2p": self.libp2p_id, "key": self.public_key, "expires": self.expiration, "sig": self.signature}
        )

    @classmethod
    def parse(
        cls, data: bytes, peer_id: str, run_id: str, *, latest_expiration: float, limits: Limits = DEFAULT_LIMITS
    ) -> "MembershipRecord":
        """Parse and verify the record stored under subkey `peer_id`; raise RemoteError if it is invalid.

        An expired record is valid here (expiry is the caller's business); one
        that expires after `latest_expiration` is not.
        """

        def bad(detail: str) -> RemoteError:
            return RemoteError(Evidence(peer_id, "bad_record", detail, data=(data,)))

        obj = decode(data, peer_id, limits)
        if not isinstance(obj, dict) or set(obj) != {"libp2p", "key", "expires", "sig"}:
            raise bad("membership record must hold exactly libp2p, key, expires, sig")
        record = cls(peer_id, obj["key"], obj["libp2p"], obj["expires"], obj["sig"])
        types_ok = (
            isinstance(record.public_key, bytes)
            and len(record.public_key) == PUBLIC_KEY_BYTES
            and isinstance(record.libp2p_id, bytes)
            and isinstance(record.expiration, float)
            and isinstance(record.signature, bytes)
        )
        if not types_ok:
            raise bad("membership record field of wrong type")
        if peer_id_of(record.public_key) != peer_id:
            raise bad("public key does not hash to the peer id")
        if record.libp2p_id != libp2p_id_of(record.public_key):
            raise bad("libp2p id is not derived from the public key")
        expected = cls.signed_digest(run_id, peer_id, record.libp2p_id, record.expiration)
        if not verify_signature(record.public_key, expected, record.signature):
            raise bad("invalid signature")
        if record.expiration > latest_expiration:
            raise bad(f"expires {record.expiration - latest_expiration:.0f}s later than any record may")
        return record


class MembershipValidator(RecordValidatorBase):
    """Runs inside the DHT process: refuses to store or accept invalid membership records.

    Records under other keys pass untouched. A valid record's DHT expiration
    must equal its signed expiration, so nobody can pin a stale record over a
    fresh one by replaying it with a later DHT expiration.
    """

    def __init__(self, run_id: str, max_lifetime: float, limits: Limits) -> None:
        self._run_id = run_id
        self._key_id = DHTID.generate(source=membership_key(run_id)).to_bytes()
        self._max_lifetime = max_lifetime
        self._limits = limits

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # msgpack raises many types on a peer's garbage; any of them means invalid
            return False
        if not isinstance(subkey, str) or not isinstance(value, bytes):
            return False
        try:
            parsed = MembershipRecord.parse(
                value,
                subkey,
                self._run_id,
                latest_expiration=get_dht_time() + self._max_lifetime,
                limits=self._limits,
            )
        except RemoteError:
            return False
        return parsed.expiration == record.expiration_time


class HivemindTransport(Transport):
    """One peer on a real libp2p network: a hivemind DHT child process plus raw streams through its daemon.

    `run_id` separates runs that share a DHT; `initial_peers` are multiaddrs
    of running peers (another peer's `visible_maddrs()`), empty for the first;
    `host_maddrs` are where the daemon listens. Records live `membership_ttl`
    seconds (every peer of a run must use about the same value) and the view
    is re-read every `refresh_interval` seconds. `send_timeout` bounds a
    one-way send and the reading of any incoming frame.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        run_id: str,
        initial_peers: list[str] = [],
        host_maddrs: list[str] = ["/ip4/127.0.0.1/tcp/0"],
        membership_ttl: float = 30.0,
        refresh_interval: float = 1.0,
        send_timeout: float = 60.0,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(identity, limits)
        if not 0 < refresh_interval < 2 * membership_ttl / 3:
            # A record read just before its owner re-stores it has 2/3 of the ttl left.
            raise ConfigError(
                f"refresh_interval ({refresh_interval}) must be > 0 and < 2/3 of membership_ttl ({membership_ttl})"
            )
        if send_timeout <= 0:
            raise ConfigError(f"send_timeout must be > 0 seconds, got {send_timeout}")
        self.run_id = run_id
        self._initial_peers = list(initial_peers)
        self._host_maddrs = list(host_maddrs)
        self._ttl = membership_ttl
        self._refresh_interval = refresh_interval
        self._send_timeout = send_timeout
        self._key = membership_key(run_id)
        self._protocol = f"/phalanx/{run_id}/stream/1"
        self._dht: DHT | None = None
        self._p2p: P2P | None = None
        self._maddrs: list[str] = []
        self._view: dict[str, MembershipRecord] = {}
        self._own: MembershipRecord | None = None
        self._by_libp2p: dict[bytes, str] = {}
        self._reported_records: set[bytes] = set()
        self._refresh_task: asyncio.Task | None = None
        self._store_task: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._inbound: set[asyncio.Task] = set()
        self._outbound: set[asyncio.Task] = set()  # broadcast sends still running
        self._backlog: dict[str, int] = {}  # member -> broadcast sends to it still running
        self._stopping = False  # from `stop` on: a broadcast goes on the board only (nobody would cancel its sends)
        self._idle: dict[str, list[_Stream]] = {}  # peer -> streams of finished exchanges, kept for the next ones

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Start the DHT process and its libp2p daemon, publish our record and read the others'."""
        if self._dht is not None:
            raise LocalError("this transport is already started")
        self._stopping = False
        loop = asyncio.get_running_loop()
        os.environ.setdefault(REUSEPORT_ENV, "false")  # read by the daemon, which inherits our environment
        key_dir = tempfile.mkdtemp(prefix="phalanx-key-")
        try:
            key_path = os.path.join(key_dir, "libp2p.key")
            self._write_libp2p_key(key_path)
            self._dht = DHT(
                initial_peers=self._initial_peers,
                host_maddrs=self._host_maddrs,
                identity_path=key_path,
                check_if_identity_free=False,
                record_validators=[MembershipValidator(self.run_id, self._ttl + CLOCK_SKEW, self.limits)],
                start=True,
                await_ready=False,
            )
            await loop.run_in_executor(None, self._dht.wait_until_ready, STARTUP_TIMEOUT)
        except P2PDaemonError as exc:
            await self.stop()
            raise LocalError(f"the libp2p daemon did not start ({exc}); check initial_peers and host_maddrs") from exc
        except BaseException:
            await self.stop()
            raise
        finally:
            # The daemon has read its key by the time the DHT is ready; do not leave it on disk.
            shutil.rmtree(key_dir, ignore_errors=True)
        try:
            self._p2p = await self._dht.replicate_p2p()
            expected = libp2p_id_of(self.identity.public_key)
            if self._p2p.peer_id.to_bytes() != expected:
                raise LocalError(f"libp2p daemon runs as {self._p2p.peer_id}, not as our key's {PeerID(expected)}")
            self._maddrs = [str(addr) for addr in await self._p2p.get_visible_maddrs()]
            self._own = self._fresh_record()
            await self._p2p.add_binary_stream_handler(self._protocol, self._on_stream)
            await self._publish()
            if self._store_task is not None:
                await self._store_task  # the first store is waited for: the others read it at once
            await self._refresh_view()
        except BaseException:
            await self.stop()
            raise
        self._background = [
            asyncio.create_task(self._every(self._ttl / 3, self._publish), name="phalanx-publish"),
            asyncio.create_task(self._every(self._refresh_interval, self._refresh_view), name="phalanx-view"),
        ]
        for task in self._background:
            task.add_done_callback(_log_death)

    async def stop(self) -> None:
        """Let the last broadcasts' sends finish (up to LINGER seconds), stop background work, close streams,
        shut down the DHT process and its daemon."""
        cancelled = False
        self._stopping = True
        if self._outbound:
            try:
                await asyncio.wait(set(self._outbound), timeout=min(LINGER, self._send_timeout))
            except asyncio.CancelledError:  # stopped while lingering (a SIGTERM handler): shut down all the same
                cancelled = True
        tasks = [*self._background, *self._inbound, *self._outbound]
        tasks += [t for t in (self._refresh_task, self._store_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._background, self._refresh_task, self._store_task = [], None, None
        for streams in self._idle.values():
            for stream in streams:
                stream.writer.close()
        self._idle = {}
        if self._p2p is not None:
            await self._p2p.shutdown()
            self._p2p = None
        if self._dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._dht.shutdown)
            self._dht = None
        self._view, self._by_libp2p, self._maddrs, self._own = {}, {}, [], None
        if cancelled:
            raise asyncio.CancelledError

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<libp2p id>) that other peers can pass as `initial_peers`."""
        if not self._maddrs:
            raise LocalError("visible_maddrs() is known only after `await start()`")
        return list(self._maddrs)

    def _write_libp2p_key(self, path: str) -> None:
        """Write our Ed25519 key in libp2p's format, readable only by us, for the daemon to load."""
        seed = self.identity.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + self.identity.public_key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())

    @staticmethod
    async def _every(interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            await job()

    # --- membership ----------------------------------------------------------

    @property
    def failure_detection(self) -> float:
        return self._ttl  # a dead peer's record expires at most one ttl after its last refresh

    def members(self) -> list[str]:
        now = get_dht_time()
        return sorted({self.peer_id, *(p for p, r in self._view.items() if r.expiration > now)})

    async def wait_for_members(self, n: int, timeout: float) -> list[str]:
        """Wait until the view holds at least `n` members (self included) and return it.

        Raises TimeoutError if it does not within `timeout` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(members := self.members()) < n:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"{len(members)} of {n} members in view after {timeout}s: {members}")
            await asyncio.sleep(min(0.05, remaining))
        return members

    def _fresh_record(self) -> MembershipRecord:
        return MembershipRecord.create(self.identity, self.run_id, get_dht_time() + self._ttl)

    def _presented_record(self) -> MembershipRecord:
        """Our record as a stream presents it: signed afresh once a third of its ttl has passed. Its re-store
        runs every ttl/3 on a loop that may run late under load (and waits on the DHT process), and a record
        that expired while we were alive and talking got our streams refused ("no valid membership record")."""
        assert self._own is not None
        if self._own.expiration - get_dht_time() < 2 * self._ttl / 3:
            self._own = self._fresh_record()
        return self._own

    async def _publish(self) -> None:
        """Store a fresh record of ours that lives `membership_ttl` seconds (streams carry it too). The store
        runs as its own task; one still running is left to finish rather than waited for or doubled."""
        self._own = self._fresh_record()
        if self._store_task is None or self._store_task.done():
            self._store_task = asyncio.create_task(self._store(self._own), name="phalanx-store")

    async def _store(self, record: MembershipRecord) -> None:
        assert self._dht is not None
        try:
            stored = await self._dht.store(
                self._key, record.to_bytes(), record.expiration, subkey=self.peer_id, return_future=True
            )
        except Exception:  # the DHT process reports its failures as arbitrary exceptions
            log.warning("could not publish our membership record", exc_info=True)
            return
        if not stored:
            log.warning("the DHT refused our membership record (a newer one exists, or no node answered)")

    async def _refresh_view(self) -> None:
        """Re-read the membership records; concurrent callers share one DHT lookup."""
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.create_task(self._fetch_view())
        await asyncio.shield(self._refresh_task)

    async def _fetch_view(self) -> None:
        assert self._dht is not None
        try:
            found = await self._dht.get(self._key, latest=True, return_future=True)
        except Exception:  # the DHT process reports its failures as arbitrary exceptions
            log.warning("could not read membership records; keeping the old view", exc_info=True)
            return
        if found is None or not isinstance(found.value, dict):
            # Our own record is always stored, so no answer means the lookup failed (a busy
            # DHT times out): keep the old view rather than forget every member at once.
            log.debug("membership lookup returned nothing; keeping the old view")
            return
        entries = found.value
        self._absorb({subkey: item.value for subkey, item in entries.items()})

    def _absorb(self, entries: dict[Any, Any]) -> None:
        """Merge the valid records in `entries` (subkey -> stored value) into the view; drop expired ones.

        A lookup under load may return only some records; a member leaves the
        view when its record expires, not when one lookup misses it.
        """
        now = get_dht_time()
        view: dict[str, MembershipRecord] = {p: r for p, r in self._view.items() if r.expiration > now}
        for subkey, value in entries.items():
            if not isinstance(subkey, str) or not isinstance(value, bytes):
                log.info("ignoring a membership entry of wrong type under subkey %r", subkey)
                continue
            try:
                record = MembershipRecord.parse(
                    value, subkey, self.run_id, latest_expiration=now + self._ttl + CLOCK_SKEW, limits=self.limits
                )
            except RemoteError as exc:
                # The DHT shows the same bad record on every refresh; report it once.
                if digest(value) not in self._reported_records:
                    self._reported_records.add(digest(value))
                    self.report(exc.evidence)
                continue
            if record.expiration > now and subkey != self.peer_id and (subkey not in view or record.expiration > view[subkey].expiration):
                view[subkey] = record
        self._view = view
        self._by_libp2p = {r.libp2p_id: p for p, r in view.items()}

    def _absorb_presented(self, claimed: str, data: bytes, libp2p_id: bytes) -> None:
        """Take the record a stream's other end presented into the view, if it is valid, live, newer, and its own."""
        current = self._view.get(claimed)
        if claimed == self.peer_id or (current is not None and current.to_bytes() == data):
            return
        now = get_dht_time()
        try:
            record = MembershipRecord.parse(
                data, claimed, self.run_id, latest_expiration=now + self._ttl + CLOCK_SKEW, limits=self.limits
            )
        except RemoteError as exc:
            log.info("ignoring a membership record presented on a stream: %s", exc)
            return
        if record.libp2p_id != libp2p_id or record.expiration <= now:
            return
        if current is None or record.expiration > current.expiration:
            self._view = {**self._view, claimed: record}
            self._by_libp2p = {**self._by_libp2p, libp2p_id: claimed}

    async def _read_record(self, reader: asyncio.StreamReader, sender: str, libp2p_id: bytes) -> None:
        """Read the RECORD frame that opens each end of a stream and absorb it."""
        _, claimed, data = await _read_frame(reader, sender, self.limits, {RECORD})
        self._absorb_presented(claimed, data, libp2p_id)

    async def _write_record(self, writer: asyncio.StreamWriter) -> None:
        await _write_frame(writer, RECORD, self.peer_id.encode(), self._presented_record().to_bytes())

    async def _sender_of(self, remote: PeerID, reader: asyncio.StreamReader) -> str | None:
        """The phalanx id behind an incoming stream, from the record it opens with or from the view."""
        try:
            await self._read_record(reader, str(remote), remote.to_bytes())
        except RemoteError as exc:
            member = await self._peer_of(remote)
            if member is None:  # not one of ours: nobody to hold to account
                log.info("dropping a stream from %s: %s", remote, exc)
                return None
            raise RemoteError(dataclasses.replace(exc.evidence, peer=member)) from None
        return await self._peer_of(remote)

    async def _peer_of(self, remote: PeerID) -> str | None:
        """The phalanx id behind an authenticated libp2p id, refreshing the view once on a miss."""
        peer = self._by_libp2p.get(remote.to_bytes())
        if peer is None:
            await self._refresh_view()
            peer = self._by_libp2p.get(remote.to_bytes())
        return peer

    async def _record_of(self, peer: str) -> MembershipRecord:
        """The live record of `peer`, refreshing the view once on a miss; PeerUnreachable if none."""
        record = self._view.get(peer)
        if record is None or record.expiration <= get_dht_time():
            await self._refresh_view()
            record = self._view.get(peer)
        if record is None or record.expiration <= get_dht_time():
            raise PeerUnreachable(peer, "not in the membership view")
        return record

    # --- sending -------------------------------------------------------------

    async def request(self, peer: str, topic: str, payload: bytes, timeout: float) -> bytes:
        if not (math.isfinite(timeout) and timeout > 0):
            raise LocalError(f"request timeout must be a finite number of seconds > 0, got {timeout!r}")
        try:
            return await asyncio.wait_for(self._exchange(peer, REQUEST, topic, payload), timeout)
        except asyncio.TimeoutError:
            raise PeerTimeout(peer, f"request {topic!r} got no answer in {timeout}s") from None

    async def broadcast(self, topic: str, step: int, payload: bytes) -> SignedEnvelope:
        """Sign `payload` for slot (topic, step), start its sends to every other member, and return: as in the
        simulator, a broadcast does not wait for delivery. Each send goes on in the background until the member
        acks it or send_timeout passes; `stop` lets them finish for up to LINGER seconds. A member that has
        BROADCAST_BACKLOG sends unacknowledged is skipped (it fetches the envelope from the sender or relays).
        Once `stop` began, the envelope goes on this peer's board only.

        Waiting here for every member's ack put the slowest member's round trip through both daemons on the
        caller's path, between messages that do not depend on it: a commitment and the parts it binds, an
        aggregate's commitment and the aggregate, the next step's join and the parts' collection.
        """
        envelope = SignedEnvelope.create(self.identity, topic, step, payload)
        self.board.add(envelope)
        data = envelope.to_bytes()
        for peer in self.members() if not self._stopping else []:
            if peer == self.peer_id:
                continue
            if self._backlog.get(peer, 0) >= BROADCAST_BACKLOG:
                log.info("broadcast %r not sent to %s: %d sends to it unacknowledged", topic, peer[:8], BROADCAST_BACKLOG)
                continue
            self._backlog[peer] = self._backlog.get(peer, 0) + 1
            task = asyncio.create_task(self.send(peer, BROADCAST_TOPIC, data), name=f"phalanx-broadcast-{topic}")
            self._outbound.add(task)
            task.add_done_callback(functools.partial(self._sent, peer))
        return envelope

    def _sent(self, peer: str, task: asyncio.Task) -> None:
        self._outbound.discard(task)
        self._backlog[peer] -= 1
        if not self._backlog[peer]:
            del self._backlog[peer]
        if not task.cancelled() and task.exception() is not None:  # `send` ends every failure of the network itself
            log.error("a broadcast send failed", exc_info=task.exception())

    async def send(self, peer: str, topic: str, payload: bytes) -> None:
        try:
            await asyncio.wait_for(self._exchange(peer, MESSAGE, topic, payload), self._send_timeout)
        except asyncio.TimeoutError:
            log.info("message %r to %s not acknowledged in %ss", topic, peer[:8], self._send_timeout)
        except (PeerUnreachable, RequestFailed) as exc:
            log.info("message %r to %s lost: %s", topic, peer[:8], exc)

    async def charge_compute(self, flops: float) -> None:
        """Nothing to account for: real compute takes real time."""

    async def _exchange(self, peer: str, kind: int, topic: str, payload: bytes) -> bytes:
        """Open a stream to `peer`, write one frame, read the answer frame.

        Raises PeerUnreachable (no route, broken stream) or RequestFailed (an
        ERROR answer, or a malformed answer, which is also reported as evidence);
        LocalError on misuse.
        """
        if not isinstance(payload, bytes):
            raise LocalError(f"payload must be bytes, got {type(payload).__name__}: convert it with bytes(...)")
        topic_bytes = topic.encode()
        if len(topic_bytes) > MAX_TOPIC_BYTES:
            raise LocalError(f"topic {topic[:40]!r}... is {len(topic_bytes)} bytes; the limit is {MAX_TOPIC_BYTES}")
        if peer == self.peer_id:
            return await self._exchange_with_self(kind, topic, payload)
        if self._p2p is None:
            raise LocalError("the transport is not started; `await start()` first")
        record = await self._record_of(peer)
        stream = self._reusable(peer, record.libp2p_id)
        if stream is not None:
            try:
                return await self._exchange_on(peer, stream, kind, topic_bytes, payload, reused=True)
            except _Stale:
                pass  # closed under us before the peer took anything (it restarted, say): on a fresh stream
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID(record.libp2p_id), self._protocol)
        except (P2PDaemonError, asyncio.IncompleteReadError, OSError) as exc:  # the daemon may hang up mid-answer
            raise PeerUnreachable(peer, f"cannot open a stream: {exc!r}") from None
        return await self._exchange_on(peer, _Stream(record.libp2p_id, reader, writer, 0.0), kind, topic_bytes, payload, reused=False)

    async def _exchange_on(self, peer: str, stream: _Stream, kind: int, topic: bytes, payload: bytes, reused: bool) -> bytes:
        """One exchange on `stream`; the stream is kept for the next one if it completed, else closed.

        Raises _Stale if `reused` and the stream was found closed before any byte of an answer came."""
        done = False
        try:
            try:
                await self._write_record(stream.writer)
                await _write_frame(stream.writer, kind, topic, payload)
                await self._read_record(stream.reader, peer, stream.libp2p_id)
            except (asyncio.IncompleteReadError, OSError) as exc:
                if reused and not (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise _Stale() from None
                raise
            answer_kind, _, answer = await _read_frame(stream.reader, peer, self.limits, {RESPONSE, ERROR})
            done = True
        except RemoteError as exc:
            self.report(exc.evidence)
            raise RequestFailed(peer, f"bad answer: {exc}") from None
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise PeerUnreachable(peer, f"stream broke: {exc!r}") from None
        finally:
            # Only a stream whose exchange completed is in a known state; one cut anywhere (a timeout, a
            # cancellation, a bad answer) is closed.
            if done:
                self._park(peer, stream)
            else:
                stream.writer.close()
        if answer_kind == ERROR:
            raise RequestFailed(peer, answer.decode(errors="replace"))
        return answer

    def _reusable(self, peer: str, libp2p_id: bytes) -> _Stream | None:
        """An idle stream to `peer` (as `libp2p_id`) that can carry the next exchange; stale ones are closed."""
        streams = self._idle.get(peer, [])
        now = asyncio.get_running_loop().time()
        while streams:
            stream = streams.pop()
            fresh = now - stream.parked < POOL_IDLE and stream.libp2p_id == libp2p_id
            if fresh and not stream.writer.is_closing() and not stream.reader.at_eof():
                return stream
            stream.writer.close()
        return None

    def _park(self, peer: str, stream: _Stream) -> None:
        """Keep the stream of a completed exchange for the next one with `peer`; close every stream idle
        POOL_IDLE or longer (to this or any peer: one that left is never asked for its streams again)."""
        now = asyncio.get_running_loop().time()
        for other, idle in list(self._idle.items()):
            for old in [x for x in idle if now - x.parked >= POOL_IDLE]:
                idle.remove(old)
                old.writer.close()
            if not idle:
                del self._idle[other]
        streams = self._idle.setdefault(peer, [])
        if self._p2p is None or len(streams) >= POOL_SIZE:
            stream.writer.close()
            return
        streams.append(dataclasses.replace(stream, parked=now))

    async def _exchange_with_self(self, kind: int, topic: str, payload: bytes) -> bytes:
        """What `_exchange` does for a message or request addressed to ourselves, without the network."""
        if kind == MESSAGE:
            self._deliver_message(self.peer_id, topic, payload)
            return b""
        ok, answer = await self._serve_request(self.peer_id, topic, payload)
        if not ok:
            raise RequestFailed(self.peer_id, answer.decode(errors="replace"))
        return answer

    # --- receiving -----------------------------------------------------------

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one incoming stream: exchanges, one after another, each a message (acked) or a request
        (answered), until the requester closes it or none comes for SERVE_IDLE seconds."""
        task = asyncio.current_task()
        assert task is not None
        self._inbound.add(task)
        try:
            served = 0
            while True:
                # The requester closes first, once it has the whole answer (closing our end earlier lets the
                # daemon reset the stream and cut the answer): its close, between exchanges, ends the stream.
                try:
                    sender = await asyncio.wait_for(self._sender_of(info.peer_id, reader), SERVE_IDLE if served else self._send_timeout)
                except asyncio.IncompleteReadError as exc:
                    if served and not exc.partial:
                        return
                    raise
                except asyncio.TimeoutError:
                    if served:
                        return
                    raise
                if sender is None:
                    log.warning("dropping a stream from %s: no valid membership record", info.peer_id)
                    return
                kind, topic, payload = await asyncio.wait_for(
                    _read_frame(reader, sender, self.limits, {MESSAGE, REQUEST}), self._send_timeout
                )
                if kind == MESSAGE:
                    self._deliver_message(sender, topic, payload)
                    ok, answer = True, b""
                else:
                    ok, answer = await self._serve_request(sender, topic, payload)
                await asyncio.wait_for(self._write_answer(writer, RESPONSE if ok else ERROR, answer), self._send_timeout)
                served += 1
        except RemoteError as exc:
            self.report(exc.evidence)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as exc:
            log.info("incoming stream from %s broke: %r", info.peer_id, exc)
        except asyncio.CancelledError:
            # Only stop() cancels these tasks, which belong to asyncio's stream
            # server; ending them normally keeps Python 3.11 from logging the
            # cancellation as an error in its connection callback.
            log.debug("stopped serving a stream from %s", info.peer_id)
        except Exception:  # a bug in a handler must not take the listener down
            log.exception("error while serving a stream from %s", info.peer_id)
        finally:
            writer.close()
            self._inbound.discard(task)


    async def _write_answer(self, writer: asyncio.StreamWriter, kind: int, answer: bytes) -> None:
        await self._write_record(writer)
        await _write_frame(writer, kind, b"", answer)


class _Stale(Exception):
    """A reused stream that was closed before the exchange got any answer."""


@dataclass(frozen=True)
class _Stream:
    """An open stream to a peer, idle between exchanges since `parked` (the event loop's time)."""

    libp2p_id: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    parked: float


def _log_death(task: asyncio.Task) -> None:
    """A background loop that ends other than by cancellation is a bug: say so at once."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())


async def _write_frame(writer: asyncio.StreamWriter, kind: int, topic: bytes, payload: bytes) -> None:
    """Write one frame in chunks, so that a stream never buffers more than a chunk of a large payload."""
    writer.write(_HEADER.pack(kind, len(topic), len(payload)) + topic)
    view = memoryview(payload)
    for offset in range(0, len(view), WRITE_CHUNK):
        writer.write(view[offset : offset + WRITE_CHUNK])
        await writer.drain()
    await writer.drain()


async def _read_frame(
    reader: asyncio.StreamReader, sender: str, limits: Limits, kinds: set[int]
) -> tuple[int, str, bytes]:
    """Read one frame from `sender`, checking its kind and lengths before reading the payload."""
    kind, topic_len, size = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if kind not in kinds:
        raise RemoteError(Evidence(sender, "malformed", f"unexpected frame kind {kind}"))
    if size > limits.max_message_bytes:
        raise RemoteError(Evidence(sender, "oversize", f"{size} bytes > limit {limits.max_message_bytes}"))
    try:
        topic = (await reader.readexactly(topic_len)).decode()
    except UnicodeDecodeError:
        raise RemoteError(Evidence(sender, "malformed", "topic is not UTF-8")) from None
    return kind, topic, await reader.readexactly(size)
