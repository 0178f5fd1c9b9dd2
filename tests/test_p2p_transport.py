"""HivemindTransport on loopback: real DHT child processes and libp2p daemons in one test process."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils import MSGPackSerializer, get_dht_time

from phalanx.core import (
    ConfigError,
    Evidence,
    Identity,
    Limits,
    LocalError,
    PeerTimeout,
    PeerUnreachable,
    RemoteError,
    RequestFailed,
)
from phalanx.transport.p2p import (
    _HEADER,
    MESSAGE,
    RECORD,
    HivemindTransport,
    MembershipRecord,
    MembershipValidator,
    libp2p_id_of,
    membership_key,
)

TEST_TIMEOUT = 30.0
JOIN_TIMEOUT = 10.0


def run(body: Callable[[], Awaitable[None]], timeout: float = TEST_TIMEOUT) -> None:
    """Run an async test body on a fresh event loop, failing it after `timeout` seconds."""
    asyncio.run(asyncio.wait_for(body(), timeout))


def _live_processes() -> dict[int, tuple[int, str]]:
    """Every live (not zombie) process on this machine: pid -> (parent pid, program name), from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                name = os.path.basename(f.read().split(b"\0")[0].decode())
        except OSError:
            continue
        if state != "Z":
            found[int(entry)] = (int(ppid), name)
    return found


def _descendants() -> set[int]:
    """Pids of this test process's live descendants, except torch's shared-memory manager.

    hivemind's MPFuture puts tensors in torch shared memory, which starts one
    `torch_shm_manager` per process; it lives as long as the test process.
    """
    processes = _live_processes()
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, (ppid, _) in processes.items() if ppid in frontier}
        found |= frontier
    return {pid for pid in found if processes[pid][1] != "torch_shm_manager"}


class Mute(HivemindTransport):
    """A member that takes streams and leaves them unanswered until `released`: stalled, or Byzantine."""

    released = asyncio.Event()

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.released.wait()
        writer.close()


@asynccontextmanager
async def swarm(
    n: int, *, ttl: float = 30.0, limits: Limits = Limits(), send_timeout: float = 60.0, mute_first: bool = False
) -> AsyncIterator[list[HivemindTransport]]:
    """Start `n` peers of a fresh run, sorted by peer id; wait until all see all; stop them after.

    The first peer bootstraps the rest; with `mute_first` it is a `Mute`.
    """
    run_id = uuid.uuid4().hex[:8]
    identities = sorted((Identity.from_seed(f"{run_id}/{i}".encode()) for i in range(n)), key=lambda i: i.peer_id)

    def peer(i: int, initial_peers: list[str]) -> HivemindTransport:
        kind = Mute if mute_first and i == 0 else HivemindTransport
        return kind(
            identities[i],
            run_id=run_id,
            initial_peers=initial_peers,
            membership_ttl=ttl,
            refresh_interval=0.2,
            send_timeout=send_timeout,
            limits=limits,
        )

    peers = [peer(0, [])]
    spawned: set[int] = set()
    existing = _descendants()  # another swarm's (the module's shared one) are not ours to account for
    try:
        await peers[0].start()
        peers += [peer(i, peers[0].visible_maddrs()) for i in range(1, n)]
        await asyncio.gather(*(p.start() for p in peers[1:]))
        spawned = _descendants() - existing  # DHT processes and their daemons
        for p in peers:
            await p.wait_for_members(n, JOIN_TIMEOUT)
        yield peers
    finally:
        for p in peers:
            await p.stop()
    # Orphans would no longer be our descendants: look the spawned pids up by number too.
    leftovers = (_descendants() - existing) | (spawned & set(_live_processes()))
    assert not leftovers, f"stopped transports left processes behind: {leftovers}"


class Shared:
    """One default swarm(3) on one event loop, for the tests that leave its peers as they found them.

    They only add handlers (each on its own topic), send, request and read, so
    they share the swarm instead of starting one each (saves ~1.5 s a test).
    Evidence is per test: `new_evidence` gives what a peer gathered since the test began.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._swarm = swarm(3)
        self.peers: list[HivemindTransport] = self.loop.run_until_complete(
            asyncio.wait_for(self._swarm.__aenter__(), TEST_TIMEOUT)
        )
        self.evidence_at_join = [list(p.evidence) for p in self.peers]
        self._marks = [0] * len(self.peers)

    def run(self, body: Callable[[], Awaitable[None]], timeout: float = TEST_TIMEOUT) -> None:
        self._marks = [len(p.evidence) for p in self.peers]
        self.loop.run_until_complete(asyncio.wait_for(body(), timeout))

    def new_evidence(self, peer: HivemindTransport) -> list[Evidence]:
        return peer.evidence[self._marks[self.peers.index(peer)] :]

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self._swarm.__aexit__(None, None, None))  # checks no process is left
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    started = Shared()
    yield started
    started.close()


@pytest.mark.hivemind
def test_membership_converges(shared: Shared) -> None:
    everyone = sorted(p.peer_id for p in shared.peers)
    for p in shared.peers:
        assert p.members() == everyone
    assert shared.evidence_at_join == [[], [], []]


def _established_tcp_ports() -> list[tuple[int, int]]:
    """(local port, remote port) of every established IPv4 TCP connection in this network namespace."""
    pairs = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01":
                pairs.append((int(local.split(":")[1], 16), int(remote.split(":")[1], 16)))
    return pairs


@pytest.mark.hivemind
def test_daemons_dial_from_ephemeral_ports(shared: Shared) -> None:
    # Dialled from its listening port, a connection between two daemons joins two listening ports, and
    # two crossing dials become one TCP connection that both ends fail to secure (see REUSEPORT_ENV).
    listening = {int(addr.split("/tcp/")[1].split("/")[0]) for p in shared.peers for addr in p.visible_maddrs()}
    between = [(a, b) for a, b in _established_tcp_ports() if b in listening]
    assert between, "the daemons hold no connection to each other"
    assert not [(a, b) for a, b in between if a in listening]


@pytest.mark.hivemind
def test_request_roundtrip_1mb(shared: Shared) -> None:
    a, b, _ = shared.peers

    async def body() -> None:
        seen: list[str] = []

        async def reverse(sender: str, payload: bytes) -> bytes:
            seen.append(sender)
            return payload[::-1]

        b.add_request_handler("reverse", reverse)
        payload = os.urandom(2**20)
        assert await a.request(b.peer_id, "reverse", payload, timeout=10) == payload[::-1]
        assert seen == [a.peer_id]  # the authenticated stream is bound to a's phalanx id

    shared.run(body)


@pytest.mark.hivemind
def test_request_timeout(shared: Shared) -> None:
    a, b, _ = shared.peers

    async def body() -> None:
        async def stall(sender: str, payload: bytes) -> bytes:
            await asyncio.sleep(5)
            return b""

        b.add_request_handler("stall", stall)
        with pytest.raises(PeerTimeout):
            await a.request(b.peer_id, "stall", b"", timeout=0.5)

    shared.run(body)


@pytest.mark.hivemind
def test_one_way_send(shared: Shared) -> None:
    a, b, _ = shared.peers

    async def body() -> None:
        got: list[tuple[str, bytes]] = []
        b.add_message_handler("memo", lambda sender, payload: got.append((sender, payload)))
        await a.send(b.peer_id, "memo", b"hello")
        assert got == [(a.peer_id, b"hello")]  # send returns once the peer has acknowledged

    shared.run(body)


@pytest.mark.hivemind
def test_exchanges_with_a_peer_one_after_another_share_one_stream(shared: Shared) -> None:
    a, _, c = shared.peers

    async def body() -> None:
        got: list[bytes] = []
        c.add_message_handler("pooled", lambda sender, payload: got.append(payload))
        c.add_request_handler("pooled.echo", lambda sender, payload: asyncio.sleep(0, payload))
        p2p, opened = a._p2p, []
        assert p2p is not None
        open_stream = p2p.call_binary_stream_handler

        async def counted(*args):
            opened.append(args)
            return await open_stream(*args)

        p2p.call_binary_stream_handler = counted  # type: ignore[method-assign]
        try:
            for i in range(5):
                await a.send(c.peer_id, "pooled", bytes([i]))
                assert await a.request(c.peer_id, "pooled.echo", bytes([i]), timeout=5) == bytes([i])
        finally:
            del p2p.call_binary_stream_handler
        assert got == [bytes([i]) for i in range(5)]
        assert len(opened) <= 1  # one stream (none if an earlier test left one to c open), not one per exchange

    shared.run(body)


@pytest.mark.hivemind
def test_a_stream_the_answerer_closed_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.transport import p2p

    async def body() -> None:
        async with swarm(2) as (a, b):
            got: list[bytes] = []
            b.add_message_handler("late", lambda sender, payload: got.append(payload))
            await a.send(b.peer_id, "late", b"first")
            monkeypatch.setattr(p2p, "SERVE_IDLE", 0.1)  # b closes its end of a stream idle for 0.1 s
            await a.send(b.peer_id, "late", b"second")  # on the stream the first left, which b still serves
            await asyncio.sleep(1.0)
            await a.send(b.peer_id, "late", b"third")  # a saw b's close of that stream: on a fresh one
            await asyncio.sleep(1.0)
            (stream,) = a._idle[b.peer_id]  # closed by b too, but taken before a sees it (the race):
            monkeypatch.setattr(stream.reader, "at_eof", lambda: False)
            await a.send(b.peer_id, "late", b"fourth")  # sent on it, found closed, sent again on a fresh one
            assert got == [b"first", b"second", b"third", b"fourth"]

    run(body)


@pytest.mark.hivemind
def test_broadcast_reaches_every_board(shared: Shared) -> None:
    a, b, c = shared.peers

    async def body() -> None:
        envelope = await a.broadcast("grad", 7, b"commitment")
        for p in (b, c):
            got = await p.board.wait("grad", 7, [a.peer_id], timeout=5)
            assert got == {a.peer_id: envelope}

    shared.run(body)


@pytest.mark.hivemind
def test_broadcast_returns_before_the_acks_and_its_send_to_a_stalled_member_goes_on() -> None:
    async def body() -> None:
        Mute.released = asyncio.Event()
        async with swarm(3, mute_first=True) as (mute, a, b):  # send_timeout 60 s: a wait for mute's ack outlasts the test
            try:
                envelope = await a.broadcast("grad", 1, b"commitment")  # the mute member never acks
                assert await b.board.wait("grad", 1, [a.peer_id], timeout=5.0) == {a.peer_id: envelope}
                while len(a._outbound) > 1:  # b's ack is on its way
                    await asyncio.sleep(0.01)
                assert len(a._outbound) == 1  # the send to the mute member still waits for its ack
            finally:
                Mute.released.set()

    run(body)


@pytest.mark.hivemind
def test_a_member_that_never_acks_holds_a_bounded_backlog_and_a_stop_cancelled_while_lingering_still_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from phalanx.transport import p2p

    monkeypatch.setattr(p2p, "BROADCAST_BACKLOG", 4)

    async def body() -> None:
        Mute.released = asyncio.Event()
        async with swarm(3, mute_first=True) as (mute, a, b):
            try:
                for step in range(6):
                    envelope = await a.broadcast("grad", step, b"commitment")
                    assert await b.board.wait("grad", step, [a.peer_id], timeout=5.0) == {a.peer_id: envelope}
                    while b.peer_id in a._backlog:  # b's ack is on its way
                        await asyncio.sleep(0.01)
                assert a._backlog == {mute.peer_id: 4}  # 4 sends wait for the mute member's ack, not 6
                stopping = asyncio.create_task(a.stop())  # lingers for the mute member's sends...
                await asyncio.sleep(0.5)
                stopping.cancel()  # ... and is cancelled there (a SIGTERM handler)
                with pytest.raises(asyncio.CancelledError):
                    await stopping
                assert a._dht is None and a._p2p is None  # shut down all the same
            finally:
                Mute.released.set()

    run(body)


@pytest.mark.hivemind
def test_a_broadcast_just_before_stop_is_delivered() -> None:
    async def body() -> None:
        async with swarm(2) as (a, b):
            envelope = await a.broadcast("grad", 2, b"last words")
            await a.stop()  # lets the broadcast's sends finish first
            assert b.board.get("grad", 2) == {a.peer_id: envelope}

    run(body)


@pytest.mark.hivemind
def test_remote_error_fails_request_and_is_evidence(shared: Shared) -> None:
    a, b, _ = shared.peers

    async def body() -> None:
        async def picky(sender: str, payload: bytes) -> bytes:
            raise RemoteError(Evidence(sender, "wrong_shape", "expected 4 bytes", step=3))

        b.add_request_handler("picky", picky)
        with pytest.raises(RequestFailed, match="expected 4 bytes"):
            await a.request(b.peer_id, "picky", b"123", timeout=5)
        assert [(e.peer, e.kind, e.step) for e in shared.new_evidence(b)] == [(a.peer_id, "wrong_shape", 3)]
        assert shared.new_evidence(a) == []

    shared.run(body)


@pytest.mark.hivemind
def test_unknown_peer_is_unreachable(shared: Shared) -> None:
    a, _, _ = shared.peers

    async def body() -> None:
        ghost = Identity.from_seed(b"ghost").peer_id
        with pytest.raises(PeerUnreachable):
            await a.request(ghost, "anything", b"", timeout=5)
        await a.send(ghost, "anything", b"")  # best effort: never raises

    shared.run(body)


@pytest.mark.hivemind
def test_stopped_peer_leaves_views_after_its_record_expires() -> None:
    ttl = 2.0

    async def body() -> None:
        async with swarm(3, ttl=ttl) as (a, b, c):
            loop = asyncio.get_running_loop()
            await c.stop()
            stopped = loop.time()
            while c.peer_id in a.members() or c.peer_id in b.members():
                assert loop.time() - stopped < ttl + 2, "the stopped peer outlived its record"
                await asyncio.sleep(0.1)
            assert a.members() == b.members() == sorted([a.peer_id, b.peer_id])
            with pytest.raises(PeerUnreachable):
                await a.request(c.peer_id, "anything", b"", timeout=5)

    run(body)


@pytest.mark.hivemind
def test_oversize_message_is_evidence() -> None:
    limits = Limits(max_message_bytes=64 * 2**10)

    async def body() -> None:
        async with swarm(2, limits=limits) as (a, b):
            got: list[bytes] = []
            b.add_message_handler("blob", lambda sender, payload: got.append(payload))
            await a.send(b.peer_id, "blob", bytes(limits.max_message_bytes + 1))  # logged, not raised
            await a.send(b.peer_id, "blob", bytes(limits.max_message_bytes))
            assert [len(p) for p in got] == [limits.max_message_bytes]
            assert [(e.peer, e.kind) for e in b.evidence] == [(a.peer_id, "oversize")]

    run(body)


@pytest.mark.hivemind
def test_stream_from_non_member_is_dropped(shared: Shared) -> None:
    _, b, _ = shared.peers

    async def body() -> None:
        got: list[bytes] = []
        b.add_message_handler("note", lambda sender, payload: got.append(payload))
        outsider = await P2P.create(initial_peers=b.visible_maddrs())  # a libp2p peer with no record
        try:
            libp2p_id = PeerID(libp2p_id_of(b.identity.public_key))
            _, reader, writer = await outsider.call_binary_stream_handler(libp2p_id, b._protocol)
            writer.write(_HEADER.pack(MESSAGE, 4, 2) + b"note" + b"hi")
            await writer.drain()
            assert await reader.read() == b""  # closed without an ack
            writer.close()
        finally:
            await outsider.shutdown()
        assert got == []

    shared.run(body)


class DhtBlind(HivemindTransport):
    """A member whose DHT lookups all fail (a busy DHT that timed out, or backed off from every node)."""

    async def _fetch_view(self) -> None:
        return


@pytest.mark.hivemind
def test_streams_keep_talking_peers_in_view_while_dht_lookups_fail() -> None:
    ttl = 3.0

    async def body() -> None:
        run_id = uuid.uuid4().hex[:8]
        first = HivemindTransport(Identity.from_seed(b"first"), run_id=run_id, membership_ttl=ttl, refresh_interval=0.2)
        await first.start()
        blind = DhtBlind(
            Identity.from_seed(b"blind"), run_id=run_id, initial_peers=first.visible_maddrs(),
            membership_ttl=ttl, refresh_interval=0.2,
        )
        outsider = None
        try:
            await blind.start()
            await first.wait_for_members(2, JOIN_TIMEOUT)
            assert blind.members() == [blind.peer_id]  # the DHT told it nothing
            got: list[tuple[str, bytes]] = []
            blind.add_message_handler("note", lambda sender, payload: got.append((sender, payload)))
            async def echo(sender: str, payload: bytes) -> bytes:
                return payload

            first.add_request_handler("echo", echo)
            await first.send(blind.peer_id, "note", b"hi")  # accepted: the stream carries first's record
            assert got == [(first.peer_id, b"hi")] and first.peer_id in blind.members()
            # Requests renew the record both ways: first stays in view for several ttls without the DHT.
            loop = asyncio.get_running_loop()
            until = loop.time() + 2.5 * ttl
            while loop.time() < until:
                assert await blind.request(first.peer_id, "echo", b"x", timeout=5) == b"x"
                await asyncio.sleep(0.5)
            assert first.peer_id in blind.members()
            # An outsider that replays first's genuine record on its own stream is not taken for first.
            outsider = await P2P.create(initial_peers=blind.visible_maddrs())  # dialled directly: no routing-table race
            assert first._own is not None
            _, reader, writer = await outsider.call_binary_stream_handler(
                PeerID(libp2p_id_of(blind.identity.public_key)), blind._protocol
            )
            topic = first.peer_id.encode()
            record = first._own.to_bytes()
            writer.write(_HEADER.pack(RECORD, len(topic), len(record)) + topic + record)
            writer.write(_HEADER.pack(MESSAGE, 4, 3) + b"note" + b"bad")
            await writer.drain()
            assert await reader.read() == b""  # closed without an ack
            writer.close()
            assert got == [(first.peer_id, b"hi")] and blind.evidence == []
        finally:
            if outsider is not None:
                await outsider.shutdown()
            await blind.stop()
            await first.stop()

    run(body)


@pytest.mark.hivemind
def test_dht_refuses_forged_and_replayed_records(shared: Shared) -> None:
    a, b, _ = shared.peers

    async def body() -> None:
        dht = a._dht
        assert dht is not None
        victim, forger = Identity.from_seed(b"victim"), Identity.from_seed(b"forger")
        expiration = get_dht_time() + 10
        genuine = MembershipRecord.create(victim, a.run_id, expiration)
        forged = MembershipRecord(
            victim.peer_id, victim.public_key, genuine.libp2p_id, expiration, forger.sign(b"\0" * 32)
        )
        key = membership_key(a.run_id)
        attempts = [(forged, expiration), (genuine, expiration + 100)]  # bad signature; replay with longer life
        for record, dht_expiration in attempts:
            stored = await dht.store(key, record.to_bytes(), dht_expiration, subkey=victim.peer_id, return_future=True)
            assert stored is False
        await asyncio.sleep(0.5)
        assert victim.peer_id not in a.members() + b.members()
        assert shared.new_evidence(a) == shared.new_evidence(b) == []

    shared.run(body)


def test_validator_checks_signature_binding_and_lifetime() -> None:
    run_id = "r"
    validator = MembershipValidator(run_id, max_lifetime=60, limits=Limits())
    key_id = DHTID.generate(source=membership_key(run_id)).to_bytes()
    ident, other = Identity.from_seed(b"x"), Identity.from_seed(b"y")

    def accepts(record: MembershipRecord, subkey: str, expiration: float) -> bool:
        value = MSGPackSerializer.dumps(record.to_bytes())
        return validator.validate(DHTRecord(key_id, MSGPackSerializer.dumps(subkey), value, expiration))

    now = get_dht_time()
    good = MembershipRecord.create(ident, run_id, now + 30)
    assert accepts(good, ident.peer_id, good.expiration)
    assert not accepts(good, other.peer_id, good.expiration)  # moved to another peer's subkey
    assert not accepts(good, ident.peer_id, good.expiration + 1)  # DHT expiration differs from the signed one
    assert not accepts(MembershipRecord.create(ident, "other-run", now + 30), ident.peer_id, now + 30)
    far = MembershipRecord.create(ident, run_id, now + 3600)
    assert not accepts(far, ident.peer_id, far.expiration)  # would outlive any ttl
    assert validator.validate(DHTRecord(b"other key", b"x", b"y", now))  # other keys are not ours to judge


def test_invalid_record_in_view_is_evidence_once() -> None:
    transport = HivemindTransport(Identity.from_seed(b"me"), run_id="r")
    victim, forger = Identity.from_seed(b"victim"), Identity.from_seed(b"forger")
    genuine = MembershipRecord.create(victim, "r", get_dht_time() + 10)
    forged = MembershipRecord(
        victim.peer_id, victim.public_key, genuine.libp2p_id, genuine.expiration, forger.sign(b"\0" * 32)
    )
    for _ in range(2):
        transport._absorb({victim.peer_id: forged.to_bytes()})
    assert [(e.peer, e.kind) for e in transport.evidence] == [(victim.peer_id, "bad_record")]
    assert transport.members() == [transport.peer_id]
    transport._absorb({victim.peer_id: genuine.to_bytes()})
    assert transport.members() == sorted([transport.peer_id, victim.peer_id])


@pytest.mark.hivemind
def test_misuse_is_a_clear_local_error() -> None:
    with pytest.raises(ConfigError, match="refresh_interval"):
        HivemindTransport(Identity.from_seed(b"me"), run_id="r", membership_ttl=3, refresh_interval=2)

    async def body() -> None:
        existing = _descendants()
        transport = HivemindTransport(Identity.from_seed(b"me"), run_id="r")
        other = Identity.from_seed(b"other").peer_id
        with pytest.raises(LocalError, match="not started"):
            await transport.request(other, "t", b"", timeout=1)
        with pytest.raises(LocalError, match="must be bytes"):
            await transport.send(other, "t", bytearray(3))  # type: ignore[arg-type]
        with pytest.raises(LocalError, match="timeout"):
            await transport.request(other, "t", b"", timeout=float("inf"))
        with pytest.raises(LocalError, match="visible_maddrs"):
            transport.visible_maddrs()
        absent_peer = f"/ip4/127.0.0.1/tcp/9/p2p/{PeerID(libp2p_id_of(bytes(32)))}"
        nowhere = HivemindTransport(Identity.from_seed(b"lost"), run_id="r", initial_peers=[absent_peer])
        with pytest.raises(LocalError, match="initial_peers"):
            await nowhere.start()
        assert not _descendants() - existing

    run(body)


class _Writer:
    """A stream writer that keeps what is written."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        return None


def _presented(transport: HivemindTransport) -> bytes:
    """The membership record `transport` presents at the head of a stream."""
    writer = _Writer()
    asyncio.run(transport._write_record(writer))
    _, topic_len, size = _HEADER.unpack(writer.data[: _HEADER.size])
    return writer.data[_HEADER.size + topic_len:][:size]


def test_a_live_peer_whose_record_store_ran_late_is_taken_into_view_and_a_stopped_ones_record_is_not() -> None:
    # At load 16-25 (issue 18, the first seed-0 launch of session 22) every process logged "dropping a stream
    # from ...: no valid membership record": a stream presents the sender's record, which was re-signed only by
    # the re-store loop (every ttl/3, after the previous DHT store had returned), so a busy peer presented a
    # record that had expired while it was alive and talking, and its streams were refused. Now the presented
    # record is signed afresh once a third of the ttl has passed. A record that expired stays refused: a peer
    # that stopped signs nothing more, so it leaves every view at most one ttl after its last stream or store.
    ttl = 30.0
    busy, reader = Identity.from_seed(b"busy"), Identity.from_seed(b"reader")
    sender = HivemindTransport(busy, run_id="r", membership_ttl=ttl)
    stale = MembershipRecord.create(busy, "r", get_dht_time() - 5)  # re-stored last ttl + 5 s ago
    sender._own = stale
    receiver = HivemindTransport(reader, run_id="r", membership_ttl=ttl)
    receiver._absorb_presented(busy.peer_id, _presented(sender), libp2p_id_of(busy.public_key))
    assert receiver.members() == sorted([reader.peer_id, busy.peer_id])
    young = MembershipRecord.create(busy, "r", get_dht_time() + 5 * ttl / 6)  # 5 s old: presented as it is
    sender._own = young
    assert _presented(sender) == young.to_bytes()
    other = HivemindTransport(reader, run_id="r", membership_ttl=ttl)
    other._absorb_presented(busy.peer_id, stale.to_bytes(), libp2p_id_of(busy.public_key))  # a stopped peer's last one
    assert other.members() == [reader.peer_id]


def test_a_slow_dht_store_does_not_hold_back_the_next_record() -> None:
    # The re-store loop waited for each DHT store to return before it slept again: a store that hung under load
    # held back the next record. Now `_publish` signs the next record at once and leaves a running store alone.
    class HungDHT:
        calls = 0

        async def store(self, *args, **kwargs) -> bool:
            HungDHT.calls += 1
            await asyncio.sleep(3600)
            return True

    async def body() -> None:
        transport = HivemindTransport(Identity.from_seed(b"busy"), run_id="r", membership_ttl=30.0)
        transport._dht = HungDHT()  # type: ignore[assignment]
        await asyncio.wait_for(transport._publish(), 1.0)
        first = transport._own
        await asyncio.wait_for(transport._publish(), 1.0)
        assert transport._own is not None and first is not None and transport._own.expiration >= first.expiration
        await asyncio.sleep(0)
        assert HungDHT.calls == 1  # the hung store is left to finish, not doubled
        transport._store_task.cancel()

    run(body, timeout=5.0)


def test_a_broadcast_on_a_transport_not_running_goes_on_its_board_only() -> None:
    # A background verification may broadcast after its transport stopped (a run's teardown), as on the
    # base class: the envelope is signed and kept, and sent to nobody; no error.
    async def body() -> None:
        transport = HivemindTransport(Identity.from_seed(b"stopped"), run_id="r")
        envelope = await transport.broadcast("bt.report", 3, b"report")
        assert transport.board.get("bt.report", 3) == {transport.peer_id: envelope}
        assert not transport._outbound

    run(body)


def test_a_broadcast_while_the_transport_stops_is_sent_to_nobody() -> None:
    # A background verification may broadcast while `stop` shuts the daemon down: its sends would outlive the
    # cancellation of the others (and fail, logged as errors). It goes on the board only.
    async def body() -> None:
        transport = HivemindTransport(Identity.from_seed(b"stopping"), run_id="r")
        other = MembershipRecord.create(Identity.from_seed(b"other"), "r", get_dht_time() + 30)
        transport._absorb({other.peer_id: other.to_bytes()})
        assert other.peer_id in transport.members()
        sent = []

        class Daemon:
            async def shutdown(self) -> None:
                sent.append(await transport.broadcast("bt.report", 3, b"report"))

        transport._p2p = Daemon()  # type: ignore[assignment]
        await transport.stop()
        assert sent and not transport._outbound

    run(body)
