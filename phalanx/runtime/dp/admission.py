"""Sybil-resistant admission in a running BTARD swarm (App. F): the runtime side.

`AdmissionService` holds one replica's `Admission` state and moves it only on
data every honest replica agrees on, so all of them hold the same trusted,
untrusted and queued sets at every step:

- entries: a peer that caught up announces the step it trains from
  (`catchup.ready`, kept in the catch-up `Roster`); at that step it joins the
  queue (peers entering at the same step in id order) and, when a slot is
  free (at most floor(t/2) untrusted), becomes untrusted at once;
- bans: the BTARD ban ledger, in its canonical order;
- approvals: the (validator, target) pairs drawn from the step's MPRNG value
  and each validator's signed report, neither banned when the step's
  verification is settled; the T-th approval makes the peer trusted from the
  next round on;
- chain breaks: an untrusted peer absent from a step's group (it sent no
  signed join) has missed a gradient; it loses its place for good (App. F:
  "a single missing ... hash breaks the chain").

The secure round asks `roles(step, group)` at the start of each step (trusted
members own partitions and are aggregated, untrusted ones only commit and may
be validated) and calls `settle(step, approved)` when the step's verification
is settled: with background verification (App. B) at the end of step k + 1's
all-reduce, so step k's approvals and bans count from step k + 2.

Each step's state is kept for a while and served (`adm.state`) to peers that
join or restart mid-run. What they may believe is anchored (`algorithms.btard.anchor`):
at each step every replica links (step, previous link, model digest, ledger
digest, trusted set), and a trusted replica's signed join for the next step
carries that link, so the join is its signature on the chain (no message of its
own). A joiner fetches the chain (`adm.chain`), verifies it from the run's
initial set, and counts in catch-up's snapshot vote and in the admission-state
vote only the trusted peers of the chain's last verified link; a state must
also name the trusted set the chain has for its step. Queued, untrusted and
made-up identities never vote.
"""

from __future__ import annotations

import asyncio
import logging

from ...algorithms.btard.admission import (
    Admission,
    AdmissionConfig,
    Admitted,
    Banned,
    Departed,
    Event,
    Queued,
    Roles,
    Trusted,
)
from ...algorithms.btard.anchor import Link, genesis, walk_chain
from ...algorithms.catchup import agreed
from ...core.envelope import SignedEnvelope
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ...training.task import flat_params
from ..rounds.btard import BTARDConfig, SecureRound
from .catchup import CatchupFailed, CatchupService
from .peer import DataParallelPeer

log = logging.getLogger(__name__)

STATE = "adm.state"
CHAIN = "adm.chain"
JOIN = "bt.join"  # the round's signed join for step s + 1 carries the link of step s
KEEP_STEPS = 64  # past steps' states each replica serves to peers that join
CHAIN_PAGE = 64  # links per `adm.chain` answer, at most
CHAIN_BLOBS = 1024  # byte strings per answer, at most (a link and a key and a signature per signer; a decoder takes 4096)
CHAIN_SLACK = 2  # unverified links a joiner follows past its verified tip (their signatures come with later joins)
ANCHOR_LAG = 4  # a verified tip further than this behind the step a joiner takes a state for anchors no vote


class AdmissionService:
    """One replica's admission state, wired into its secure round."""

    def __init__(self, peer: DataParallelPeer, catchup: CatchupService, config: AdmissionConfig, initial: list[str] | None = None) -> None:
        if not isinstance(peer.allreduce, SecureRound):
            raise PhalanxError("admission needs a BTARD peer (btard.enabled=true)")
        self.peer = peer
        self.catchup = catchup  # its roster (replaced by set_roster) says who enters at which step
        self.config = config
        self.transport = peer.transport
        self.state: Admission | None = None
        self._history: dict[int, dict] = {}  # step -> state at the start of that step, before its entries
        self._entered: set[tuple[str, int]] = set()
        self._absent: dict[int, list[str]] = {}  # untrusted members missing from a step's group (chain broken)
        self._away: dict[int, list[str]] = {}  # trusted members missing from a step's group (departed)
        self._records: dict[int, dict] = {}
        self._current = -1  # the step whose round ran last: what settles during it is recorded there
        self._emitted = -1  # the last step whose record was taken: what settles after it goes to the next one
        self._resync: int | None = None  # a fetched state misses what settles in its first round: refetch at this step
        # The anchor: the run's initial trusted set (None until step 0, for a replica that starts the run),
        # this replica's links, and per link the signers whose join carried it (signer -> (key, signature)).
        self.initial = sorted(initial) if initial is not None else None
        self.links: dict[int, Link] = {}
        self.signed: dict[int, dict[str, tuple[bytes, bytes]]] = {}
        # A joiner's fetched links past its verified tip: per step, per link, the signatures it was served
        # (signer -> (key, signature, the server)), each checked only once a vote could count it.
        self._candidates: dict[int, dict[Link, dict[str, tuple[bytes, bytes, str]]]] = {}
        self._offers: dict[tuple[str, int], Link] = {}  # (server, step) -> the one link it offers for the step
        self._checked: dict[tuple[int, Link], dict[str, tuple[bytes, bytes]]] = {}  # signatures checked good
        self._tip: Link | None = None  # the last link this replica verified from the initial set
        self._refreshing: asyncio.Future | None = None  # a joiner's fetch of the chain it still lacks
        peer.allreduce.admission = self
        peer.allreduce.join_payload = self.join_payload
        catchup.voters = lambda: set(self.state.trusted) if self.state is not None else set()
        catchup.join_voters = self.chain_voters
        self.transport.add_request_handler(STATE, self._serve_state)
        self.transport.add_request_handler(CHAIN, self._serve_chain)

    async def start(self, step: int) -> None:
        """Before training `step` (the first this replica trains): the initial state, or the agreed one.

        A replica restored from a checkpoint (`load_checkpoint_state`) keeps the state it saved.
        """
        if self.state is not None:
            self._history.setdefault(step, self.state.to_dict())
            return
        if step == 0:
            first = sorted(p for p, s in self.catchup.roster.active.items() if s == 0)
            self.state = Admission(first or self.peer.group(0), self.config)
            if self.initial is None:
                self.initial = sorted(self.state.trusted)
        else:
            self.state = await self._fetch(step)
            if self.peer.allreduce.state.btard.background:
                # The others settle step - 1's verification (which this replica did not take part in) during
                # round `step`: before round step + 1 it takes the state they then hold.
                self._resync = step + 1
        self._history[step] = self.state.to_dict()

    # --- the secure round's hook ---------------------------------------------

    async def roles(self, step: int, group: list[str]) -> Roles:
        """Admit this step's entries, then say who owns, commits or only listens in `group`."""
        if self._resync == step:
            self.state = await self._fetch(step)
            self._resync = None
        state = self._require()
        self._history[step] = state.to_dict()  # final: every settlement before this round is in
        self._harvest(step)
        if self.initial is not None and step > 0 and step - 1 not in self.links and (self._refreshing is None or self._refreshing.done()):
            # A joiner whose chain does not reach the last step yet (its first steps): fetch the rest in the
            # background; it links (and, once trusted, signs) from the step after it has the one before.
            self._refreshing = asyncio.ensure_future(self._refresh_chain())
        self._link(step, state)
        events: list[Event] = []
        entries = sorted((s, p) for p, s in self.catchup.roster.active.items() if 0 < s <= step and (p, s) not in self._entered)
        for s, p in entries:
            self._entered.add((p, s))
            events += state.join(p)
        for p in group:  # a member that departed (or was never known) and is back: it queues like a joiner
            if state.status(p) == "unknown":
                events += state.join(p)
        roles = state.roles(group)
        self._current = step
        self._absent[step] = sorted(p for p in state.untrusted if p not in group)
        self._away[step] = sorted(p for p in state.trusted if p not in group)
        settled = self._records.get(step, {}).get("admission_events", [])  # settled between rounds, before this one
        self._records[step] = {
            "admission": {"trusted": sorted(state.trusted), "untrusted": dict(sorted(state.untrusted.items())), "queued": list(state.queue)},
            "admission_events": settled + _describe(events),
        }
        return roles

    async def settle(self, step: int, approved: tuple[str, ...], departed: tuple[str, ...] = ()) -> None:
        """Apply step `step`'s agreed outcome: bans, chain breaks, departures, approvals (in that order).

        Departed: trusted members absent from the step's group, and the members the round found
        without a commitment or silent through the verification (not banned: they lose their place).

        It takes effect from the next round on and is recorded with the round
        it settles in (a one-step delay: during step `step` + 1's round), or
        with the next one when it settles between rounds (before a checkpoint).
        """
        state = self._require()
        events: list[Event] = []
        for record in self.peer.ledger.records:
            if record.peer not in state.banned:
                events += state.ban(record.peer, record.reason)
        for peer in self._absent.pop(step, []):
            events += state.ban(peer, "missed_step")
        for peer in sorted(set(self._away.pop(step, [])) | set(departed)):
            if state.status(peer) == "trusted":
                events += state.depart(peer)
            elif state.status(peer) == "untrusted":  # its chain of gradients broke (App. F)
                events += state.ban(peer, "missed_step")
        described = _describe(events)
        for peer in approved:
            if peer in state.untrusted:
                described.append([peer, "approved"])  # the ledger of validations a joiner's trust rests on
            described += _describe(state.approved(peer))
        following = self._current + 1  # the next round: the first to use the new state
        now = following if self._emitted >= self._current else self._current
        self._records.setdefault(now, {"admission_events": []})["admission_events"] += described
        self._history[following] = state.to_dict()
        for old in [s for s in self._history if s <= following - KEEP_STEPS]:
            del self._history[old]

    def record(self, step: int) -> dict:
        """Fields for this replica's record of `step`: the status used at the step and what changed."""
        self._emitted = max(self._emitted, step)
        return self._records.pop(step, {})

    def checkpoint_state(self) -> dict:
        """What a checkpoint taken between rounds (every verification settled) keeps: state, entries, history, anchor."""
        return {
            "state": self._require().to_dict(),
            "entered": sorted([p, s] for p, s in self._entered),
            "history": dict(self._history),
            "anchor": {"initial": self.initial, "chain": self._chain_rows(0, len(self.links) + 1)},
        }

    def load_checkpoint_state(self, saved: dict) -> None:
        """Take back `checkpoint_state()`; `start` then keeps this state instead of building or fetching one."""
        self.state = Admission.from_dict(saved["state"])
        self._entered = {(p, s) for p, s in saved["entered"]}
        self._history = {int(s): state for s, state in saved["history"].items()}
        anchor = saved.get("anchor", {})
        self.initial = anchor.get("initial", self.initial)
        for link_bytes, signers in anchor.get("chain", []):
            link = Link.from_bytes(link_bytes, self.transport.peer_id)
            if link is not None:
                self.links[link.step] = link
                self.signed[link.step] = {p: (key, sig) for p, key, sig in signers}

    # --- the anchor: a chain of per-step state digests, signed by the joins -----------

    def join_payload(self, step: int) -> bytes:
        """What my signed join for `step` carries: the link of step - 1 if I was trusted then."""
        link = self.links.get(step - 1)
        return link.to_bytes() if link is not None and self.transport.peer_id in link.trusted else b""

    def _link(self, step: int, state: Admission) -> None:
        """This replica's link of `step` (at the start of the step: the model before its update)."""
        if step == 0 and self.initial is not None:
            prev = genesis(self.initial)
        elif step - 1 in self.links:
            prev = self.links[step - 1].digest()
        else:
            return  # a joiner that has not got the chain this far yet: it signs nothing
        model = digest(flat_params(self.peer.model).numpy().tobytes())
        ledger = digest(encode([[r.step, r.peer, r.reason, r.accuser] for r in self.peer.ledger.records]))
        self.links[step] = Link(step, prev, model, ledger, tuple(sorted(state.trusted)))

    def _harvest(self, step: int) -> None:
        """Keep the signatures on links of the last two steps that the joins on the board carry.

        The link a strict majority of a step's trusted set signed (in my state) replaces mine if it
        continues my chain: a replica that joined later made none, or took one from the chain it
        fetched before those signatures were in."""
        for s in (step - 2, step - 1):
            joins = self.transport.board.get(JOIN, s + 1)
            prev = genesis(self.initial) if s == 0 and self.initial is not None else (self.links[s - 1].digest() if s - 1 in self.links else None)
            if s in self._history and prev is not None:
                trusted = set(self._history[s]["trusted"])
                votes: dict[bytes, int] = {}
                for sender, env in joins.items():
                    if sender in trusted:
                        votes[env.payload] = votes.get(env.payload, 0) + 1
                best, count = max(votes.items(), key=lambda kv: (kv[1], kv[0]), default=(b"", 0))
                link = Link.from_bytes(best, self.transport.peer_id) if 2 * count > len(trusted) else None
                if link is not None and link.step == s and link.prev == prev and self.links.get(s) != link:
                    self.links[s] = link
                    self.signed[s] = {}
            if s not in self.links:
                continue
            mine = self.links[s].to_bytes()
            signed = self.signed.setdefault(s, {})
            for sender, env in joins.items():
                if env.payload == mine and sender in self.links[s].trusted:
                    signed[sender] = (env.public_key, env.signature)

    def _chain_rows(self, start: int, count: int, blobs: int | None = None) -> list[list]:
        """Up to `count` consecutive links from `start`, each with its signers' (id, key, signature);
        with `blobs`, no more byte strings than that (the first link always goes)."""
        rows, used = [], 0
        for s in range(start, start + count):
            if s not in self.links:
                break
            signers = sorted(self.signed.get(s, {}).items())
            used += 1 + 2 * len(signers)
            if rows and blobs is not None and used > blobs:
                break
            rows.append([self.links[s].to_bytes(), [[p, key, sig] for p, (key, sig) in signers]])
        return rows

    async def _serve_chain(self, sender: str, payload: bytes) -> bytes:
        obj = decode(payload, sender, self.transport.limits)
        start = obj.get("from") if isinstance(obj, dict) else None
        if type(start) is not int or start < 0:
            raise RemoteError(Evidence(sender, "malformed", "anchor chain request needs an integer 'from' >= 0"))
        rows = self._chain_rows(start, CHAIN_PAGE, CHAIN_BLOBS)
        return encode({"links": rows, "more": start + len(rows) in self.links})

    async def chain_voters(self) -> set[str] | None:
        """The trusted set of the last link verified from the initial set (fetched from the others
        first); None when this replica knows no initial set (nothing to anchor to: every peer votes)."""
        tip = await self._refresh_chain()
        return set(tip.trusted) if tip is not None else (None if self.initial is None else set(self.initial))

    async def _refresh_chain(self) -> Link | None:
        """Fetch the links after my verified tip from every other member, and verify them on from it.
        Keeps the links up to the new verified tip (each pinned by the digests of the verified ones
        after it; a link past the tip could be anybody's) so that this replica can link its own steps
        and serve the chain in turn."""
        if self.initial is None:
            return None
        me = self.transport.peer_id
        for s, link in self.links.items():  # my own links count as candidates, with the signatures I hold
            if self._tip is None or s > self._tip.step:
                self._offer(me, link, [[p, key, sig] for p, (key, sig) in self.signed.get(s, {}).items()])
        others = [p for p in self.peer.ledger.filter(self.transport.members()) if p != me]
        await asyncio.gather(*(self._fetch_chain(p) for p in others))
        self._advance()
        return self._tip

    def _advance(self) -> None:
        """Walk the candidates on from my verified tip; keep the links up to the new tip, forget the rest before it."""
        path = walk_chain(self.initial or (), self._candidates, self._tip, self._check, CHAIN_SLACK)
        last = max((i for i, (_, ok) in enumerate(path) if ok), default=-1)
        for link, _ in path[: last + 1]:
            if self.links.get(link.step) != link:
                self.links[link.step] = link
                self.signed[link.step] = {}
            self.signed.setdefault(link.step, {}).update(self._checked.get((link.step, link), {}))
        if last < 0:
            return
        self._tip = path[last][0]
        for s in [s for s in self._candidates if s <= self._tip.step]:
            del self._candidates[s]
        self._offers = {k: v for k, v in self._offers.items() if k[1] > self._tip.step}
        self._checked = {k: v for k, v in self._checked.items() if k[0] > self._tip.step}

    def _check(self, link: Link, signer: str) -> bool:
        """Whether `signer`'s served signature on `link` is its join for the next step (checked once)."""
        good = self._checked.setdefault((link.step, link), {})
        if signer in good:
            return True
        key, signature, server = self._candidates[link.step][link][signer]
        try:
            SignedEnvelope(signer, key, JOIN, link.step + 1, link.to_bytes(), signature).verify()
        except RemoteError:
            del self._candidates[link.step][link][signer]
            if server != self.transport.peer_id:
                self.transport.report(Evidence(server, "bad_signature", f"anchor link of step {link.step} with a bad signature"))
            return False
        good[signer] = (key, signature)
        return True

    async def _fetch_chain(self, peer: str) -> None:
        """The links `peer` holds after my verified tip, page by page.

        The next page is asked for only while the peer says it holds more and the last page carried the
        verified tip (links a majority of trusted peers signed) on to about its end: a peer that makes up
        links without end adds none that verify, and is asked at most about one page past the signed chain."""
        config = self.catchup.config
        start = self._tip.step + 1 if self._tip is not None else 0
        while True:
            try:
                answer = decode(
                    await self.transport.request(peer, CHAIN, encode({"from": start}), config.request_timeout), peer, self.transport.limits
                )
            except RemoteError as exc:
                self.transport.report(exc.evidence)
                return
            except PhalanxError:
                return
            rows = answer.get("links") if isinstance(answer, dict) else None
            if not isinstance(rows, list):
                return
            for row in rows[:CHAIN_PAGE]:
                self._add_candidate(peer, row)
            self._advance()
            # Pages may be short (an answer stays under a byte-string budget), so the test is on this page:
            # it must move the verified tip to within CHAIN_SLACK links of its own end.
            tip = self._tip.step if self._tip is not None else -1
            if not rows or answer.get("more") is not True or tip < start or tip < start + len(rows) - 1 - CHAIN_SLACK:
                return
            start = tip + 1

    def _add_candidate(self, peer: str, row: object) -> None:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], bytes) and isinstance(row[1], list)):
            self.transport.report(Evidence(peer, "malformed", "bad anchor chain row"))
            return
        link = Link.from_bytes(row[0], peer)
        if link is None:
            self.transport.report(Evidence(peer, "malformed", "bad anchor link"))
            return
        if self._tip is None or link.step > self._tip.step:
            self._offer(peer, link, row[1])

    def _offer(self, server: str, link: Link, items: list) -> None:
        """`server`'s link for its step (it replaces the one it offered before) and the signatures it lists."""
        old = self._offers.get((server, link.step))
        self._offers[(server, link.step)] = link
        if old is not None and old != link and old not in self._offers.values():
            self._candidates.get(old.step, {}).pop(old, None)
            self._checked.pop((old.step, old), None)
        served = self._candidates.setdefault(link.step, {}).setdefault(link, {})
        for item in items:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and all(isinstance(x, bytes) for x in item[1:]):
                served.setdefault(item[0], (item[1], item[2], server))

    def status(self, peer: str) -> str:
        """trusted | untrusted | queued | banned | unknown, in this replica's current state."""
        return self._require().status(peer)

    def _require(self) -> Admission:
        if self.state is None:
            raise PhalanxError("AdmissionService.start(step) must run before the first step")
        return self.state

    # --- state for joiners ------------------------------------------------------

    async def _serve_state(self, sender: str, payload: bytes) -> bytes:
        obj = decode(payload, sender, self.transport.limits)
        step = obj.get("step") if isinstance(obj, dict) else None
        if type(step) is not int:
            raise RemoteError(Evidence(sender, "malformed", "admission state request needs an integer step"))
        return encode({"state": self._history.get(step)})

    async def _fetch(self, step: int) -> Admission:
        """The admission state at the start of `step` that a majority of the other peers hold."""
        config = self.catchup.config
        clock = self.transport.clock
        deadline = clock.now() + config.timeout
        me = self.transport.peer_id
        while True:
            others = [p for p in self.peer.ledger.filter(self.transport.members()) if p != me]
            answers = await asyncio.gather(*(self._ask(p, step, config.request_timeout) for p in others))
            states = {p: a for p, a in zip(others, answers) if a is not None}
            # A vote counts only from a trusted peer of the anchor's last verified link, and only for a
            # state that lists it as trusted and names the trusted set the chain has for `step` (when
            # the chain reaches it): queued, untrusted and made-up identities never vote, and a state
            # made up by Sybils that lists only themselves has no chain.
            voters = await self.chain_voters()
            if voters is not None and (self._tip is None or self._tip.step < step - ANCHOR_LAG):
                # Fail closed: a chain whose verified tip stalled far behind `step` (more than half its
                # trusted set left between two links, or withheld signatures) names an electorate that
                # may be gone but for a Byzantine few; no vote counts until the chain moves on.
                voters = set()
            anchored = self.links.get(step) if self._tip is not None and self._tip.step >= step else None
            states = {
                p: a for p, a in states.items()
                if p in a.trusted and (voters is None or p in voters) and (anchored is None or tuple(sorted(a.trusted)) == anchored.trusted)
            }
            found = agreed({p: digest(encode(s.to_dict())) for p, s in states.items()}, len(states), config.confirmations)
            if found is not None:
                return Admission.from_dict(states[found[1][0]].to_dict())
            if clock.now() > deadline:
                raise CatchupFailed(f"no admission state for step {step} that the swarm agrees on within {config.timeout:.0f} s")
            await asyncio.sleep(config.poll)

    async def _ask(self, peer: str, step: int, timeout: float) -> Admission | None:
        try:
            answer = decode(await self.transport.request(peer, STATE, encode({"step": step}), timeout), peer, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
            return None
        except PhalanxError as exc:
            log.debug("admission state from %s failed: %s", peer[:8], exc)
            return None
        data = answer.get("state") if isinstance(answer, dict) else None
        if data is None:
            return None  # it has not reached that step yet (or forgot it)
        try:
            return Admission.from_dict(data)
        except ValueError as exc:
            self.transport.report(Evidence(peer, "malformed", f"bad admission state: {exc}"))
            return None


def _describe(events: list[Event]) -> list[list[str]]:
    """Events as [peer, what] pairs for records: queued, untrusted, (approved), trusted, banned:REASON."""
    out = []
    for event in events:
        if isinstance(event, Admitted):
            out.append([event.peer, "untrusted"])
        elif isinstance(event, Queued):
            out.append([event.peer, "queued"])
        elif isinstance(event, Trusted):
            out.append([event.peer, "trusted"])
        elif isinstance(event, Banned):
            out.append([event.peer, f"banned:{event.reason}"])
        elif isinstance(event, Departed):
            out.append([event.peer, "departed"])
    return out


def admission_for(
    peer: DataParallelPeer, catchup: CatchupService, btard: BTARDConfig, initial: list[str] | None = None
) -> AdmissionService | None:
    """The admission service of a peer (None: BTARD off, or btard.admission_after=0: joiners trusted at once).

    `initial`: the run's first trusted peers, the anchor a joiner verifies the chain from (None: a
    replica that starts the run takes its step-0 trusted set; a joiner then anchors nothing)."""
    if not btard.enabled or btard.admission_after == 0:
        return None
    return AdmissionService(peer, catchup, AdmissionConfig(btard.admission_after), initial)
