"""The transport interface: what protocols may do with the network.

Two implementations, the simulator and hivemind, must be indistinguishable to
the layers above. Point-to-point channels are authenticated by the transport
(the simulator knows who sent what; libp2p's noise channel binds a stream to a
peer), so requests and one-way messages carry no signature of their own.
Broadcasts are signed envelopes, because they must serve as proof to others.

Handlers run on the event loop. A handler that raises `RemoteError` has found
the sender at fault: the transport records the evidence (and, for a request,
answers with an error) and the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from ..core.clock import Clock
from ..core.envelope import SignedEnvelope
from ..core.errors import Evidence, LocalError, PhalanxError, RemoteError
from ..core.identity import Identity
from ..core.serialization import DEFAULT_LIMITS, Limits, decode, encode
from .broadcast import BroadcastBoard

log = logging.getLogger(__name__)

RequestHandler = Callable[[str, bytes], Awaitable[bytes]]
MessageHandler = Callable[[str, bytes], None]

BROADCAST_TOPIC = "_broadcast"
BOARD_TOPIC = "_board"  # requests for signed envelopes another peer holds (relay of broadcasts)
MAX_FETCH_SENDERS = 4096


class Transport(ABC):
    """One peer's endpoint on the network."""

    def __init__(self, identity: Identity, limits: Limits = DEFAULT_LIMITS) -> None:
        self.identity = identity
        self.limits = limits
        self.clock = Clock()
        self.evidence: list[Evidence] = []
        self._evidence_listeners: list[Callable[[Evidence], None]] = []
        self.reset_process_state()

    def reset_process_state(self) -> None:
        """Forget what a restarted process loses: handlers and received broadcasts."""
        self._request_handlers: dict[str, RequestHandler] = {BOARD_TOPIC: self._serve_board}
        self._message_handlers: dict[str, MessageHandler] = {}
        self.board = BroadcastBoard(self.report, self.limits)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def failure_detection(self) -> float:
        """Seconds after which a peer that died has left `members()` (0: at once)."""
        return 0.0

    # --- what protocols call -------------------------------------------------

    def add_request_handler(self, topic: str, handler: RequestHandler) -> None:
        """Serve requests on `topic`: `await handler(sender, payload) -> response`."""
        self._check_topic(topic, self._request_handlers)
        self._request_handlers[topic] = handler

    def add_message_handler(self, topic: str, handler: MessageHandler) -> None:
        """Take one-way messages on `topic`: `handler(sender, payload)`, called on the loop."""
        self._check_topic(topic, self._message_handlers)
        self._message_handlers[topic] = handler

    @abstractmethod
    async def request(self, peer: str, topic: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the response.

        Raises PeerTimeout, PeerUnreachable, or RequestFailed if the peer answered with an error.
        """

    @abstractmethod
    async def send(self, peer: str, topic: str, payload: bytes) -> None:
        """Send a one-way message, best effort: a lost or undeliverable message is not an error here."""

    async def broadcast(self, topic: str, step: int, payload: bytes) -> SignedEnvelope:
        """Sign `payload` for slot (topic, step) and send it to every other member at once.

        Sends run concurrently, so a member that stalls does not hold up the rest.
        """
        envelope = SignedEnvelope.create(self.identity, topic, step, payload)
        self.board.add(envelope)
        data = envelope.to_bytes()
        await asyncio.gather(*(self.send(p, BROADCAST_TOPIC, data) for p in self.members() if p != self.peer_id))
        return envelope

    async def collect_broadcasts(
        self, topic: str, step: int, senders: list[str], timeout: float, relays: int = 2,
        enough: Callable[[dict[str, SignedEnvelope]], bool] | None = None, patience: float | None = None,
    ) -> dict[str, SignedEnvelope]:
        """Envelopes of `senders` for (topic, step), waiting up to `timeout`, or until `enough`
        holds for what arrived (asked at each arrival).

        Broadcast is best effort, so what has not arrived after `patience`
        (default a quarter of the timeout), and again after each further
        `patience`, is fetched from its sender and from `relays` other members:
        envelopes are signed, so any peer may pass them on, and a lost message
        or a sender that skipped some peers does not split honest views.
        """
        clock = self.clock
        deadline = clock.now() + timeout
        patience = timeout / 4 if patience is None else patience
        while True:
            got = await self.board.wait(topic, step, senders, min(patience, max(0.0, deadline - clock.now())), enough)
            missing = [s for s in senders if s not in got and s != self.peer_id]
            if not missing or clock.now() >= deadline or (enough is not None and enough(got)):
                return got
            others = [p for p in self.members() if p != self.peer_id and p not in missing][:relays]
            await self.fetch_broadcasts(topic, step, missing, [*missing, *others], min(patience, deadline - clock.now()))

    async def collect_passing_over(
        self, topic: str, step: int, senders: list[str], timeout: float,
        quiet: Callable[[dict[str, SignedEnvelope]], set[str]], relays: int = 2, grace: float | None = None,
    ) -> dict[str, SignedEnvelope]:
        """`collect_broadcasts`, except that the senders `quiet(arrived)` names (silent in an earlier phase)
        are waited for only a `grace` (default timeout / 4) once every other sender's envelope is in, and
        those others are at least half of `senders` (so a few early arrivals never pass over the rest; half,
        not more, so that a group of two whose other member went silent is not waited for in full)."""
        clock = self.clock
        deadline = clock.now() + timeout

        def enough(got: dict[str, SignedEnvelope]) -> bool:
            rest = [p for p in senders if p not in quiet(got)]
            return 2 * len(rest) >= len(senders) and all(p in got or p == self.peer_id for p in rest)

        got = await self.collect_broadcasts(topic, step, senders, timeout, relays, enough)
        missing = [p for p in senders if p not in got and p != self.peer_id]
        if missing and clock.now() < deadline:
            wait = min(timeout / 4 if grace is None else grace, deadline - clock.now())
            got.update(await self.collect_broadcasts(topic, step, missing, wait, relays))
        return got

    async def fetch_broadcasts(self, topic: str, step: int, senders: list[str], sources: list[str], timeout: float) -> None:
        """Ask `sources` for the envelopes they hold from `senders` for (topic, step); add them to the board."""
        request = encode({"topic": topic, "step": step, "senders": senders[:MAX_FETCH_SENDERS]})

        async def ask(source: str) -> None:
            try:
                response = await self.request(source, BOARD_TOPIC, request, timeout)
                items = decode(response, source, self.limits)
                if not isinstance(items, list) or not all(isinstance(i, bytes) for i in items):
                    raise RemoteError(Evidence(source, "malformed", "board answer is not a list of envelopes", step))
            except RemoteError as exc:
                self.report(exc.evidence)
                return
            except PhalanxError as exc:
                log.debug("fetching %s@%d from %s failed: %s", topic, step, source[:8], exc)
                return
            for item in items:
                self.board.receive(source, item)

        if timeout > 0:
            await asyncio.gather(*(ask(source) for source in sources if source != self.peer_id))

    async def _serve_board(self, sender: str, payload: bytes) -> bytes:
        query = decode(payload, sender, self.limits)
        ok = (
            isinstance(query, dict)
            and isinstance(query.get("topic"), str)
            and type(query.get("step")) is int
            and isinstance(query.get("senders"), list)
            and len(query["senders"]) <= MAX_FETCH_SENDERS
        )
        if not ok:
            raise RemoteError(Evidence(sender, "malformed", "bad board request"))
        held = self.board.get(query["topic"], query["step"])
        return encode([held[s].to_bytes() for s in query["senders"] if isinstance(s, str) and s in held])

    @abstractmethod
    def members(self) -> list[str]:
        """The current membership view: sorted peer ids, this peer included."""

    @abstractmethod
    async def charge_compute(self, flops: float) -> None:
        """Account for `flops` of local work (virtual time in the simulator; a no-op on real hardware)."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    def report(self, evidence: Evidence) -> None:
        """Record evidence against a peer and tell the listeners (ban ledgers, metrics)."""
        log.info("evidence against %s: %s (%s)", evidence.peer[:8], evidence.kind, evidence.detail)
        self.evidence.append(evidence)
        for listener in self._evidence_listeners:
            listener(evidence)

    def on_evidence(self, listener: Callable[[Evidence], None]) -> None:
        self._evidence_listeners.append(listener)

    # --- what implementations call when bytes arrive ------------------------

    def _deliver_message(self, sender: str, topic: str, payload: bytes) -> None:
        if topic == BROADCAST_TOPIC:
            self.board.receive(sender, payload)
            return
        handler = self._message_handlers.get(topic)
        if handler is None:
            log.debug("no handler for message topic %r from %s", topic, sender[:8])
            return
        try:
            handler(sender, payload)
        except RemoteError as exc:
            self.report(exc.evidence)

    async def _serve_request(self, sender: str, topic: str, payload: bytes) -> tuple[bool, bytes]:
        """Run the handler; returns (ok, response or error text)."""
        handler = self._request_handlers.get(topic)
        if handler is None:
            return False, f"no handler for topic {topic!r}".encode()
        try:
            return True, await handler(sender, payload)
        except RemoteError as exc:
            self.report(exc.evidence)
            return False, str(exc).encode()

    def _check_topic(self, topic: str, table: dict) -> None:
        if topic.startswith("_"):
            raise LocalError(f"topic {topic!r} is reserved: topics starting with '_' belong to the transport")
        if topic in table:
            raise LocalError(f"a handler for topic {topic!r} is already registered on this transport")
