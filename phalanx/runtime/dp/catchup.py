"""State catch-up: a peer joins a running swarm, or a diverged replica re-syncs.

Every replica, at each sync point (the start of every `sync_every`-th step),
serializes its state (model, optimizer, step, ban ledger) and keeps the last
few snapshots; it also keeps the update (aggregated gradient) it applied at
each recent step. Honest replicas hold bit-identical states, so their digests
agree (see `phalanx.algorithms.catchup`).

Requests (all under `catchup.`):
  offer      {"joining"}          -> what the peer holds: step, snapshot and update digests, roster
  manifest   {"step"}             -> the manifest of the snapshot at that step (chunk hashes)
  chunk      {"step", "index"}    -> one chunk of that snapshot
  updates    {"start", "count"}   -> the updates applied at steps start .. start+count-1
Broadcasts:
  catchup.ready  at step r: "I train from step r on" (a joiner that caught up)
  catchup.digest at sync step s: the sender's state digest (the sync-point check)

A joiner asks every member for an offer, downloads the latest snapshot the
offers agree on from the peers holding it (each chunk checked against the
agreed manifest), replays the agreed updates until it stands at the step the
swarm trains, announces `ready` for a step `margin` ahead and follows until
then. Until that step the others leave it out of their groups (`Roster`).
A replica whose digest at a sync point differs from the agreed one loads the
agreed snapshot and replays the updates since, without leaving its group.
A peer's bad answer (wrong hash, malformed state) is evidence against it.

The state's bytes and update digests are in `state.py`, the roster in `roster.py`; here are the service
every replica runs and the joiner's side (offers, snapshot download).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from ...algorithms.btard.bans import BanRecord
from ...algorithms.catchup import (
    Agreed,
    Offer,
    agreed,
    agreed_updates,
    choose_snapshot,
    manifest_digest,
    manifest_of,
    swarm_step,
)
from ...core.errors import ConfigError, Evidence, LocalError, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ...transport.base import Transport
from .peer import DataParallelPeer
from .roster import READY, Roster
from .state import apply_update, load_state, state_bytes, update_digest

log = logging.getLogger(__name__)

DIGEST = "catchup.digest"


@dataclass(frozen=True)
class CatchupConfig:
    sync_every: int = 10  # snapshot and compare digests at the start of every k-th step
    confirmations: int = 2  # peers besides the source that must report the same digest (fewer peers: majority)
    margin: int = 3  # a joiner enters this many steps after the step the swarm trains when it caught up
    keep_snapshots: int = 2  # snapshots each replica keeps
    keep_updates: int = 64  # applied updates each replica keeps for joiners to replay
    chunk_bytes: int = 4 * 2**20  # a snapshot is served in chunks of this size
    request_timeout: float = 30.0  # seconds per catch-up request
    poll: float = 0.02  # seconds between a joiner's looks at the swarm
    timeout: float = 300.0  # seconds a joiner tries before giving up

    def __post_init__(self) -> None:
        for key in ("sync_every", "confirmations", "margin", "keep_snapshots", "chunk_bytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"catchup.{key}={getattr(self, key)} must be >= 1")
        if self.keep_updates < 2 * self.sync_every:
            raise ConfigError(
                f"catchup.keep_updates={self.keep_updates} must be >= 2 * catchup.sync_every ({2 * self.sync_every})"
                " so a joiner can replay from the older kept snapshot"
            )
        for key in ("request_timeout", "poll", "timeout"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"catchup.{key}={value} must be a finite number of seconds > 0")


class CatchupFailed(LocalError):
    """The swarm did not agree on a state to fetch in time (too few peers answered, or they disagree)."""


# --- the service ------------------------------------------------------------------


class CatchupService:
    """One replica's side of catch-up: serves its snapshots and updates, joins, re-syncs."""

    def __init__(self, peer: DataParallelPeer, config: CatchupConfig = CatchupConfig(), initial: list[str] | None = None) -> None:
        self.peer = peer
        self.config = config
        self.transport = peer.transport
        self.roster = Roster(peer.transport, initial, config.margin)
        self.training = False  # False while joining: we have nothing to offer yet
        self.resyncs = 0
        self._snapshots: dict[int, tuple[bytes, dict, bytes]] = {}  # step -> (data, manifest, digest)
        self._updates: dict[int, tuple[torch.Tensor, list[list], bytes]] = {}  # step -> (update, bans, digest)
        self._step_bans: dict[int, list[list]] = {}  # bans the step's round returned, until its update is recorded
        self._check_at: int | None = None
        self._alone_since: float | None = None  # when a joiner last saw no other peer in its view
        self._rosters: list[dict] = []  # the roster views of the last offers
        # Who votes at a sync-point digest check (None: the whole group). BTARD's admission sets it to the
        # trusted peers: queued and untrusted identities are cheap and must not outvote the replicas.
        self.voters: Callable[[], set[str]] | None = None
        # Who votes while joining (offers: the snapshot, the updates, the roster); None: every peer asked.
        # BTARD's admission sets it to the trusted set of its anchor chain's last verified link.
        self.join_voters: Callable[[], Awaitable[set[str] | None]] | None = None
        self._sending: set[asyncio.Future] = set()
        peer.admit = self.roster.admit
        peer.on_update.append(self._record_update)
        peer.on_result.append(lambda step, result: self.roster.observe(step, result.group, result.dropped_senders))
        peer.on_result.append(self._note_bans)
        t = peer.transport
        t.add_request_handler("catchup.offer", self._serve_offer)
        t.add_request_handler("catchup.manifest", self._serve_manifest)
        t.add_request_handler("catchup.chunk", self._serve_chunk)
        t.add_request_handler("catchup.updates", self._serve_updates)

    def set_roster(self, initial: list[str] | None) -> None:
        """Start over with `initial` as the peers that train from step 0 (None: every member)."""
        self.roster = Roster(self.transport, initial, self.config.margin)
        self.peer.admit = self.roster.admit

    # --- as a training replica ---------------------------------------------

    async def before_step(self, step: int) -> None:
        """Call before training `step`: snapshot at sync points, re-sync if the last sync point says we diverged."""
        self.training = True
        if self._check_at is not None and step >= self._check_at + 2:
            sync, self._check_at = self._check_at, None
            await self._check(sync, step)
        if step % self.config.sync_every == 0:
            self._snapshot(step)
            self._check_at = step
            # In the background: a slow member must not hold up our step.
            task = asyncio.ensure_future(self.transport.broadcast(DIGEST, step, self._snapshots[step][2]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _snapshot(self, step: int) -> None:
        data = state_bytes(self.peer, step)
        manifest = manifest_of(data, self.config.chunk_bytes)
        self._snapshots[step] = (data, manifest, manifest_digest(manifest))
        for old in sorted(self._snapshots)[: -self.config.keep_snapshots]:
            del self._snapshots[old]

    def state_digest(self) -> bytes:
        """The digest of this replica's current state (as a snapshot now would name it)."""
        return manifest_digest(manifest_of(state_bytes(self.peer, self.peer.step), self.config.chunk_bytes))

    def _note_bans(self, step: int, result) -> None:
        self._step_bans[step] = [[r.step, r.peer, r.reason, r.accuser] for r in getattr(result, "bans", ())]

    def _record_update(self, step: int, vector: torch.Tensor) -> None:
        vector = vector.detach().to(torch.float32).clone()
        bans = self._step_bans.pop(step, [])
        self._updates[step] = (vector, bans, update_digest(vector, bans))
        for old in [s for s in self._updates if s <= step - self.config.keep_updates]:
            del self._updates[old]

    async def _check(self, sync: int, step: int) -> None:
        """Compare our digest at sync step `sync` with the group's; load the agreed state if ours differs."""
        mine = self._snapshots.get(sync)
        if mine is None:
            return
        group = set(self.peer.group(step))
        if self.voters is not None:
            group &= self.voters()
        reports = {p: e.payload for p, e in self.transport.board.get(DIGEST, sync).items() if p in group}
        reports[self.transport.peer_id] = mine[2]
        # Our own group, whose aggregate we already trust: a strict majority of its digests
        # is enough (a crash mid-gather can leave 2 of 3 survivors on one state, 1 on another).
        found = agreed(reports, len(reports), len(reports))
        if found is None or found[0] == mine[2]:
            return
        log.warning("state at sync step %d differs from the swarm's: re-syncing", sync)
        holders = [p for p in found[1] if p != self.transport.peer_id]
        try:
            data = await self._download(Agreed(sync, found[0], tuple(holders)))
            load_state(self.peer, data, holders[0])
            await self._replay(await self._offers(holders, joining=False), until=step)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
            return
        except PhalanxError as exc:
            log.warning("re-sync failed (%s); training on", exc)
            return
        if self.peer.step != step:
            log.warning("re-sync replayed up to step %d of %d; the next sync point checks again", self.peer.step, step)
        self.resyncs += 1
        self.peer.step = step

    # --- as a joiner --------------------------------------------------------

    async def join(self, end: int | None = None) -> int:
        """Catch up with the running swarm; return the step this peer trains next (its `step` is set).

        With `end` (the run's step count), raises CatchupFailed when the run ends before this peer could enter.
        """
        deadline = self.transport.clock.now() + self.config.timeout
        loaded = False
        while True:
            # Load the latest agreed snapshot, then replay agreed updates until we stand where the
            # swarm trains. If the updates stop agreeing (replicas that diverged at a crash and have
            # not re-synced yet), a newer agreed snapshot taken after their re-sync gets us past it.
            offers = await self._offers(self._others(), joining=True)
            choice = choose_snapshot(offers, self.config.confirmations)
            if choice is not None and (not loaded or choice.step > self.peer.step):
                loaded = await self._load(choice) or loaded
            if loaded:
                await self._replay(offers)
                now = swarm_step(offers)
                if now is not None and self.peer.step >= now and await self._follow(await self._enter(end), deadline):
                    return self.peer.step
            why = f"could not replay up to the swarm's step (at {self.peer.step})" if loaded else "no snapshot the swarm agrees on"
            self._give_up_after(deadline, why)
            await asyncio.sleep(self.config.poll)

    async def _load(self, choice: Agreed) -> bool:
        try:
            data = await self._download(choice)
            load_state(self.peer, data, choice.holders[0])
            self.roster.merge_majority(self._rosters)
            return True
        except RemoteError as exc:
            self.transport.report(exc.evidence)
        except PhalanxError as exc:
            log.info("snapshot download failed: %s", exc)
        return False

    async def _enter(self, end: int | None) -> int:
        """Announce the step we train from: a few steps after where the swarm trains now."""
        now = swarm_step(await self._offers(self._others(), joining=True))  # fresh: the swarm moved meanwhile
        target = max(now if now is not None else 0, self.peer.step) + self.config.margin
        if end is not None and target >= end:
            raise CatchupFailed(f"the run ends at step {end}, before this peer could enter at step {target}")
        self.roster.enter(self.transport.peer_id, target)
        await self.transport.broadcast(READY, target, b"")
        log.info("caught up at step %d; entering at step %d", self.peer.step, target)
        return target

    async def _follow(self, target: int, deadline: float) -> bool:
        """Replay the swarm's updates up to our entry step; False if we passed it and must enter again.

        The updates can stop agreeing after we announced our step (the replicas diverged at a
        crash): then a newer agreed snapshot, taken after they re-synced, gets us past that step.
        """
        while self.peer.step < target:
            offers = await self._offers(self._others(), joining=False)
            before = self.peer.step
            await self._replay(offers)
            if self.peer.step >= target:
                break
            newer = choose_snapshot(offers, self.config.confirmations)
            if self.peer.step == before and newer is not None and newer.step > before and await self._load(newer):
                log.info("the swarm's updates disagree at step %d; loaded its snapshot of step %d", before, newer.step)
                if self.peer.step > target:
                    return False
                continue
            self._give_up_after(deadline, f"could not follow the swarm to step {target}")
            await asyncio.sleep(self.config.poll)
        return True

    def _give_up_after(self, deadline: float, why: str) -> None:
        now = self.transport.clock.now()
        if self._others():
            self._alone_since = None
        elif self._alone_since is None:
            self._alone_since = now
        elif now - self._alone_since > self.config.request_timeout:  # a view can be empty for a moment
            raise CatchupFailed(f"catch-up gave up: no other peer in the view for {self.config.request_timeout:.0f} s ({why})")
        if now > deadline:
            raise CatchupFailed(f"catch-up gave up after {self.config.timeout:.0f} s: {why}")

    def _others(self) -> list[str]:
        return [p for p in self.peer.ledger.filter(self.transport.members()) if p != self.transport.peer_id]

    async def _offers(self, peers: list[str], joining: bool) -> dict[str, Offer]:
        """Offers of `peers` (every one is asked, so that each leaves a joiner out of its groups);
        while this peer is not training yet, only those of `join_voters` count."""
        voters = await self.join_voters() if self.join_voters is not None and not self.training else None
        offers, rosters = await _gather_offers(self.transport, peers, joining, self.config)
        if voters is not None:
            offers = {p: o for p, o in offers.items() if p in voters}
            rosters = {p: r for p, r in rosters.items() if p in voters}
        self._rosters = list(rosters.values())
        return offers

    async def _download(self, choice: Agreed) -> bytes:
        """Fetch the agreed snapshot: its manifest from a holder, chunks spread over all holders, each checked."""
        return await fetch_snapshot(self.transport, choice, self.config)

    async def _replay(self, offers: dict[str, Offer], until: int | None = None) -> None:
        """Apply the agreed updates from our step on (up to `until`), fetched from their holders."""
        agreed_list = agreed_updates(offers, self.peer.step, self.config.confirmations)
        if until is not None:
            agreed_list = [a for a in agreed_list if a.step < until]
        per_request = max(1, self.config.chunk_bytes // max(1, 4 * self.peer.dim))
        while agreed_list:
            batch = agreed_list[:per_request]
            fetched = await self._fetch_updates(batch)
            if fetched is None:
                return
            for vector, bans in fetched:
                apply_update(self.peer, vector)
                self.peer.ledger.extend([BanRecord(*b) for b in bans])
            agreed_list = agreed_list[per_request:]

    async def _fetch_updates(self, batch: list[Agreed]) -> list[tuple[torch.Tensor, list[list]]] | None:
        holders = set(batch[0].holders)
        for a in batch[1:]:
            holders &= set(a.holders)
        request = {"start": batch[0].step, "count": len(batch)}
        for holder in sorted(holders):
            answer = await _request(self.transport, holder, "catchup.updates", request, self.config)
            vectors = answer.get("vectors") if answer else None
            bans = answer.get("bans") if answer else None
            ok = (
                isinstance(vectors, list)
                and len(vectors) == len(batch)
                and all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == (self.peer.dim,) for v in vectors)
                and isinstance(bans, list)
                and len(bans) == len(batch)
                and all(_ban_rows(b) for b in bans)
            )
            if ok and all(update_digest(v, b) == a.digest for v, b, a in zip(vectors, bans, batch)):
                return list(zip(vectors, bans))
            if answer is not None:
                self.transport.report(Evidence(holder, "bad_update", f"updates from step {batch[0].step} do not match"))
        return None

    # --- serving ---------------------------------------------------------------

    async def _serve_offer(self, sender: str, payload: bytes) -> bytes:
        request = decode(payload, sender, self.transport.limits)
        if not isinstance(request, dict) or not isinstance(request.get("joining"), bool):
            raise RemoteError(Evidence(sender, "malformed", "bad catch-up offer request"))
        if request["joining"] and self.training:  # before training, the roster is set at the start barrier
            self.roster.mark_joining(sender, self.peer.step)
        if not self.training:
            return encode({"latest": -1, "snapshots": {}, "updates": {}, "roster": {}})
        return encode(
            {
                "latest": self.peer.step,
                "snapshots": {str(s): d for s, (_, _, d) in self._snapshots.items()},
                "updates": {str(s): d for s, (_, _, d) in self._updates.items()},
                "roster": self.roster.to_dict(),
            }
        )

    async def _serve_manifest(self, sender: str, payload: bytes) -> bytes:
        step = _int_field(payload, sender, "step", self.transport)
        held = self._snapshots.get(step)
        return encode({"manifest": held[1] if held else None})

    async def _serve_chunk(self, sender: str, payload: bytes) -> bytes:
        step = _int_field(payload, sender, "step", self.transport)
        index = _int_field(payload, sender, "index", self.transport)
        held = self._snapshots.get(step)
        if held is None:
            return encode({"data": None})
        size = self.config.chunk_bytes
        return encode({"data": held[0][index * size : (index + 1) * size]})

    async def _serve_updates(self, sender: str, payload: bytes) -> bytes:
        start = _int_field(payload, sender, "start", self.transport)
        count = _int_field(payload, sender, "count", self.transport)
        per_request = max(1, self.config.chunk_bytes // max(1, 4 * self.peer.dim))
        steps = range(start, start + min(count, per_request))
        if not all(s in self._updates for s in steps):
            return encode({"vectors": None})
        return encode({"vectors": [self._updates[s][0] for s in steps], "bans": [self._updates[s][1] for s in steps]})


def _ban_rows(rows) -> bool:
    """Whether `rows` is a list of ban records as [step, peer, reason, accuser]."""
    shape = (int, str, str, str)
    return isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == 4 and all(type(v) is t for v, t in zip(r, shape)) for r in rows
    )


async def fetch_snapshot(transport: Transport, choice: Agreed, config: CatchupConfig = CatchupConfig()) -> bytes:
    """Download the snapshot `choice` names from its holders and check it; PhalanxError if no holder serves it.

    This is the verified-download half of catch-up, for any protocol that has
    agreed on a digest (BTARD's admission, say): the manifest must hash to
    `choice.digest`, every chunk to its manifest entry, and a holder that
    sends a wrong one is reported.
    """
    holders = [h for h in choice.holders if h != transport.peer_id]
    manifest = None
    for holder in holders:
        answer = await _request(transport, holder, "catchup.manifest", {"step": choice.step}, config)
        candidate = answer.get("manifest") if answer else None
        if candidate is None:
            continue
        try:
            if manifest_digest(candidate) == choice.digest and _manifest_ok(candidate, config):
                manifest = candidate
                break
        except TypeError:
            pass
        transport.report(Evidence(holder, "bad_state", f"manifest of step {choice.step} does not match the agreed digest"))
    if manifest is None:
        raise LocalError(f"no holder served the snapshot of step {choice.step}")
    chunks: list[bytes | None] = [None] * len(manifest["hashes"])
    gate = asyncio.Semaphore(2 * len(holders))

    async def fetch(index: int) -> None:
        async with gate:
            for k in range(len(holders)):
                holder = holders[(index + k) % len(holders)]
                answer = await _request(transport, holder, "catchup.chunk", {"step": choice.step, "index": index}, config)
                data = answer.get("data") if answer else None
                if isinstance(data, bytes) and digest(data) == manifest["hashes"][index]:
                    chunks[index] = data
                    return
                if data is not None:
                    transport.report(Evidence(holder, "bad_state", f"chunk {index} of step {choice.step} has the wrong hash"))

    await asyncio.gather(*(fetch(i) for i in range(len(chunks))))
    if any(c is None for c in chunks):
        raise LocalError(f"could not fetch every chunk of the snapshot of step {choice.step}")
    data = b"".join(chunks)
    if len(data) != manifest["size"]:
        raise LocalError("snapshot size differs from its manifest")
    return data


async def collect_offers(
    transport: Transport, peers: list[str], config: CatchupConfig = CatchupConfig(), joining: bool = False
) -> dict[str, Offer]:
    """Ask `peers` what they hold; for protocols that choose with `choose_snapshot`.

    As an observer by default; with `joining`, training peers leave us out of
    their groups until we announce `ready` (ask so before anything slow).
    """
    return (await _gather_offers(transport, peers, joining, config))[0]


async def _gather_offers(
    transport: Transport, peers: list[str], joining: bool, config: CatchupConfig
) -> tuple[dict[str, Offer], dict[str, dict]]:
    """Offers of the peers that train (a peer still joining has none), and their roster views."""
    answers = await asyncio.gather(*(_request(transport, p, "catchup.offer", {"joining": joining}, config) for p in peers))
    offers, rosters = {}, {}
    for peer, answer in zip(peers, answers):
        if answer is None:
            continue
        try:
            offer = _parse_offer(answer)
        except (KeyError, TypeError, ValueError):
            transport.report(Evidence(peer, "malformed", "bad catch-up offer"))
            continue
        if offer.latest >= 0:
            offers[peer] = offer
            if isinstance(answer.get("roster"), dict):
                rosters[peer] = answer["roster"]
    return offers, rosters


async def _request(transport: Transport, peer: str, topic: str, body: dict, config: CatchupConfig) -> dict | None:
    try:
        answer = decode(await transport.request(peer, topic, encode(body), config.request_timeout), peer, transport.limits)
    except RemoteError as exc:
        transport.report(exc.evidence)
        return None
    except PhalanxError as exc:
        log.debug("%s from %s failed: %s", topic, peer[:8], exc)
        return None
    return answer if isinstance(answer, dict) else None


def _manifest_ok(manifest: object, config: CatchupConfig) -> bool:
    if not isinstance(manifest, dict) or set(manifest) != {"size", "chunk", "hashes"}:
        return False
    size, chunk, hashes = manifest["size"], manifest["chunk"], manifest["hashes"]
    return (
        type(size) is int
        and type(chunk) is int
        and chunk == config.chunk_bytes
        and isinstance(hashes, list)
        and len(hashes) == max(1, -(-size // chunk))
        and all(isinstance(h, bytes) for h in hashes)
    )


def _parse_offer(answer: dict) -> Offer:
    latest = answer["latest"]
    if type(latest) is not int:
        raise TypeError("latest")

    def steps(table: object) -> dict[int, bytes]:
        if not isinstance(table, dict) or not all(isinstance(v, bytes) for v in table.values()):
            raise TypeError("table")
        return {int(k): v for k, v in table.items()}

    return Offer(latest, steps(answer["snapshots"]), steps(answer["updates"]))


def _int_field(payload: bytes, sender: str, key: str, transport: Transport) -> int:
    obj = decode(payload, sender, transport.limits)
    value = obj.get(key) if isinstance(obj, dict) else None
    if type(value) is not int or value < 0:
        raise RemoteError(Evidence(sender, "malformed", f"catch-up request needs an integer {key!r}"))
    return value
