"""Churn of a pipeline's relays (`faults.leave_rate` / `faults.join_rate`): the simulator's draws, and the
decisions `phalanx launch` takes from the same draws for real relay processes.

`iteration_churn` is the one draw of both modes (GWTF's join-leave chance, per
relay and iteration, from the run seed): when an iteration opens, each relay
that left comes back with probability `join_rate`, under its own identity
(it joins through the leader: placement, weights download, then it serves; a
Byzantine index stays Byzantine, a banned one meets the join refusal), and
each other relay leaves with probability `leave_rate` at a random point of
the iteration: `fraction x faults.leave_span` seconds after it opens, or, with
no span set, `fraction x` the last iteration's duration. `simulate` restarts
the peer (`network.restart`); `launch` starts a new process under the same
index with `--join` after the old one is dead. join_rate brings back relays
that left, as in the simulator: no relay beyond `config.peers` joins by churn
(`faults.rejoin_after` and `phalanx peer` add new identities). The relays of
`faults.stay` never leave by churn (an attacker that wants to stay in the
run: the bench's `all` cell keeps its Byzantine relays so that every attack
runs in every seed).

Each relay draws from its own stream per iteration (`churn_draws`: seed,
relay index, iteration), its leave, its leave's point and its return, whatever
its state: a relay's fate in an iteration depends only on whether it is down
then, never on the other relays or on how many draws came before. So two runs
of the same seed at different speeds (the secure and the plain pipeline of
issue 18's bench) take the same decisions wherever the rules below do not
intervene, and with `faults.leave_span` set both place a leave at the same
moment after the iteration opens. Without it (the default) a leave's moment
follows the run's own pace, as GWTF's per-iteration churn: a slower run has
its leaves later, and they may fall in another phase or iteration.

A leave takes the relay unless it is the last live replica of its stage that
is not banned (its weights would be gone: GWTF does not say how a wiped-out
stage recovers; a banned replica serves nobody), as the simulator's `_leave`.
A relay that serves no stage (still joining, refused, or its join failed) may
always leave, in both modes. A leave falls within the iteration it was drawn
in: one not yet due when the next iteration opens falls then, before that
iteration's draws, so that whether a relay is down when an iteration opens
does not depend on how long the last one took. A relay that came back serves, and keeps its stage
alive, only from the iteration after the one under way when its weights came
in (its join event's `since`).

Under BTARD per stage churn keeps `BTARD_STAGE_FLOOR` unbanned replicas per
stage, in both modes (`stage_floor`; `faults.stage_floor` sets another): with
one left, that one may be the liar, and its ban empties the stage for good, as
no live replica is left to give a joiner the stage's weights (measured over
hivemind in session 18, where a relay that comes back needs tens of seconds to
serve, and in the simulator in session 23: issue 18's `all` cell, seed 1, lost
stage 2 at iteration 20 for the rest of the run when the link attacker, its
last replica, was banned).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ...core.rng import py_stream
from .config import ChurnConfig, PipelineRunConfig

BTARD_STAGE_FLOOR = 2  # under BTARD per stage churn leaves this many unbanned serving replicas in a stage


def stage_floor(config: PipelineRunConfig) -> int:
    """The unbanned serving replicas churn leaves in a stage: `faults.stage_floor`, or (0) `BTARD_STAGE_FLOOR`
    under BTARD per stage and one otherwise."""
    return config.faults.stage_floor or (BTARD_STAGE_FLOOR if config.btard.enabled else 1)


def churn_draws(seed: int, relay: int, it: int) -> tuple[float, float, float]:
    """Relay `relay`'s (index among the relays) draws in iteration `it`: (leave, leave's point, return), each
    uniform in [0, 1), from a stream of its own (the same in `simulate` and `launch`)."""
    rng = py_stream(seed, "pipeline", "churn", relay, it)
    return rng.random(), rng.random(), rng.random()


def iteration_churn(seed: int, it: int, relays: Sequence[str], down: Collection[str], faults: ChurnConfig,
                    stay: Collection[str] = ()) -> list[tuple[str, float | None]]:
    """The decisions of opening iteration `it`, in relay order (relay index = position in `relays`): (relay, None)
    for a relay in `down` that comes back now, (relay, fraction) for a live one that leaves `fraction` of the
    way into this iteration (`leave_offset`). A relay in `stay` (`faults.stay`) never leaves."""
    drawn: list[tuple[str, float | None]] = []
    for index, relay in enumerate(relays):
        leave, fraction, back = churn_draws(seed, index, it)
        if relay in down:
            if back < faults.join_rate:
                drawn.append((relay, None))
        elif leave < faults.leave_rate and relay not in stay:
            drawn.append((relay, fraction))
    return drawn


def leave_offset(faults: ChurnConfig, fraction: float, last_duration: float) -> float:
    """Seconds after its iteration opens that a leave drawn at `fraction` falls: of `faults.leave_span` when set
    (a moment every run of the seed shares), else of the last iteration's duration (the run's own pace)."""
    return fraction * (faults.leave_span or last_duration)


def leave_allowed(name: str, stages: Mapping[str, int], banned: Collection[str], floor: int = 1) -> bool:
    """The stage rule of both modes: churn takes relay `name` unless more than `floor` would leave its stage
    empty of unbanned replicas. `stages`: the live relays that serve, by stage (a relay not in it serves no
    stage and may always go); `banned`: the first data node's banned set (a banned replica serves nobody)."""
    if name in banned or name not in stages:
        return True
    return sum(1 for peer, stage in stages.items() if stage == stages[name] and peer not in banned) > floor


@dataclass(frozen=True)
class RelayChurn:
    """In iteration `it`, relay `name` (its index) left (was killed) or returned (was started again with --join)."""

    it: int
    name: str
    event: str  # "left" or "returned"


@dataclass(order=True)
class _Leave:
    at: float  # when (the launcher's monotonic clock)
    it: int
    name: str = field(compare=False)


class PipelineChurn:
    """Which relays to stop and start again as iterations open (decisions only; the launcher acts)."""

    def __init__(self, config: PipelineRunConfig, floor: int = 1) -> None:
        """`floor`: the unbanned serving replicas a leave leaves in its stage (`stage_floor(config)` in a run)."""
        self.config = config
        self.floor = floor
        self.relays = [str(i) for i in range(config.data_nodes, config.peers)]
        self.stay = {str(config.data_nodes + r) for r in config.faults.staying}  # process names churn never takes
        self.down: set[str] = set()  # relays that left (the simulator's `crashed`): they may come back
        self.opened = -1  # the last iteration whose draws are made
        self.scheduled: list[_Leave] = []  # leaves drawn and not yet due, by time
        self.events: list[RelayChurn] = []

    @staticmethod
    def wanted(config: PipelineRunConfig) -> bool:
        return bool(config.faults.leave_rate or config.faults.join_rate)

    def crashed(self, name: str) -> None:
        """Relay `name` was killed by another fault (`faults.crash_relay`): it may come back, as in the simulator."""
        self.down.add(name)

    def open(self, it: int, at: float, duration: float) -> list[RelayChurn]:
        """Iteration `it` opened at time `at`, the one before it lasted `duration` seconds: the relays that come
        back now; the leaves drawn are scheduled (`leave`). Iterations open in order, each once."""
        if it != self.opened + 1:
            raise ValueError(f"iteration {it} opened after {self.opened}")
        self.opened = it
        back = []
        faults = self.config.faults
        for name, fraction in iteration_churn(self.config.seed, it, self.relays, self.down, faults, self.stay):
            if fraction is None:
                self.down.discard(name)
                back.append(RelayChurn(it, name, "returned"))
            else:
                bisect.insort(self.scheduled, _Leave(at + leave_offset(faults, fraction, duration), it, name))
        self.events.extend(back)
        return back

    def due(self, now: float, opening: int | None = None) -> bool:
        """Whether a scheduled leave is due by `now`, or (`opening`: iteration `opening` opens now) was drawn in an
        earlier iteration: a leave falls within its iteration."""
        return any(leave.at <= now or (opening is not None and leave.it < opening) for leave in self.scheduled)

    def leave(self, now: float, serving: dict[str, int], banned: frozenset[str] = frozenset(),
              opening: int | None = None) -> list[RelayChurn]:
        """The leaves due by `now` (and, as iteration `opening` opens, those drawn before it), in time order, that
        take their relay. `serving` maps each live relay that serves (weights in) to its stage; `banned`: the
        relays the first data node has banned so far (they do not keep a stage alive)."""
        stages = dict(serving)
        gone = []
        due: list[_Leave] = []
        later: list[_Leave] = []
        for leave in self.scheduled:
            (due if leave.at <= now or (opening is not None and leave.it < opening) else later).append(leave)
        self.scheduled = later
        for leave in due:
            name = leave.name
            if name in self.down or not leave_allowed(name, stages, banned, self.floor):
                continue
            stages.pop(name, None)
            self.down.add(name)
            gone.append(RelayChurn(leave.it, name, "left"))
        self.events.extend(gone)
        return gone
