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
join or restart mid-run: they take the state a majority of the others agree
on, as catch-up does for the model.
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
from ...algorithms.catchup import agreed
from ...core.errors import Evidence, PhalanxError, RemoteError
from ...core.serialization import decode, digest, encode
from ..rounds.btard import BTARDConfig, SecureRound
from .catchup import CatchupFailed, CatchupService
from .peer import DataParallelPeer

log = logging.getLogger(__name__)

STATE = "adm.state"
KEEP_STEPS = 64  # past steps' states each replica serves to peers that join


class AdmissionService:
    """One replica's admission state, wired into its secure round."""

    def __init__(self, peer: DataParallelPeer, catchup: CatchupService, config: AdmissionConfig) -> None:
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
        peer.allreduce.admission = self
        catchup.voters = lambda: set(self.state.trusted) if self.state is not None else set()
        self.transport.add_request_handler(STATE, self._serve_state)

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
        """What a checkpoint taken between rounds (every verification settled) keeps: state, entries, history."""
        return {
            "state": self._require().to_dict(),
            "entered": sorted([p, s] for p, s in self._entered),
            "history": dict(self._history),
        }

    def load_checkpoint_state(self, saved: dict) -> None:
        """Take back `checkpoint_state()`; `start` then keeps this state instead of building or fetching one."""
        self.state = Admission.from_dict(saved["state"])
        self._entered = {(p, s) for p, s in saved["entered"]}
        self._history = {int(s): state for s, state in saved["history"].items()}

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
            # A vote counts only from a peer that the state it vouches for lists as trusted: queued and
            # untrusted identities never vote for the real state. (A state made up by Sybils that lists
            # only themselves passes this too; telling it apart needs signed per-step state digests.)
            states = {p: a for p, a in states.items() if p in a.trusted}
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


def admission_for(peer: DataParallelPeer, catchup: CatchupService, btard: BTARDConfig) -> AdmissionService | None:
    """The admission service of a peer (None: BTARD off, or btard.admission_after=0: joiners trusted at once)."""
    if not btard.enabled or btard.admission_after == 0:
        return None
    return AdmissionService(peer, catchup, AdmissionConfig(btard.admission_after))
