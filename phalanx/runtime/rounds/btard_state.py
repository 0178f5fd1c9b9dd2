"""BTARD's round: its config, the hooks it calls, and the state its parts share.

- `BTARDConfig`, `SECURE_REDUCERS`, `SecureResult`: what a run configures and what a step returns;
- `InputsHook`, `AdmissionHook`: what the round asks of a pipeline stage (inputs) and of admission (App. F);
- `RoundState`: one peer's round across steps (its transport, configs, hooks, the gradients it committed and
  the parts it aggregated), read by the critical path (`btard`), the background verification
  (`btard_verify`), the validators (`btard_validate`) and the verdicts (`btard_judge`);
- `StepState`: everything one step's checks and verdicts read, with the checks that read nothing else;
- `RecomputeCache`: a member's gradient recomputed once per (member, step), whoever asks for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...algorithms.btard.admission import Roles
from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger, BanRecord
from ...algorithms.btard.checks import Claim, norm_matches, project, s_matches
from ...core.errors import ConfigError, Evidence
from ...transport.base import Transport
from .butterfly import AllReduceConfig, AllReduceResult, Reducer

SECURE_REDUCERS = ("centered_clip", "mean")


@dataclass(frozen=True)
class BTARDConfig:
    enabled: bool = False  # run the secure round instead of plain butterfly all-reduce
    validators: int = 1  # m: validator/target pairs drawn per step
    timeout: float = 5.0  # seconds per broadcast phase (commitments, metadata, reports)
    delta_max: float = float("inf")  # V3 threshold on ||g_i(j) - ĝ(j)|| (inf: V3 never fires)
    bans: bool = True  # False: claims are resolved but nobody is banned (a benchmark baseline)
    background: bool = True  # verify step k while step k + 1 runs, its bans at the end of step k + 1's all-reduce (App. B); False: before k's SGD step
    # T of App. F: approved gradients a peer that joins mid-run needs before it is trusted (0: trusted at once).
    # 10: with m validators and n trusted peers a joiner is a target with probability ~m/(n+1-m) per step, so
    # it stays out of the average ~75 steps under btard-digits (16 peers, m=2): about 3x the ~25 steps a digits
    # run needed to recover after its last sign-flip ban (issue-6 bench), the paper's rule for T; and a Sybil
    # that splits one device between two identities gets both trusted with probability 2^-9 (App. F, eq. 77).
    admission_after: int = 10

    def __post_init__(self) -> None:
        if self.validators < 0:
            raise ConfigError(f"btard.validators={self.validators} must be >= 0")
        if not 0 < self.timeout < float("inf"):
            raise ConfigError(f"btard.timeout={self.timeout!r} must be a finite number > 0")
        if not self.delta_max > 0:
            raise ConfigError(f"btard.delta_max={self.delta_max!r} must be > 0 (inf: V3 off)")
        if self.admission_after < 0:
            raise ConfigError(f"btard.admission_after={self.admission_after} must be >= 0 (0: joiners are trusted at once)")


@dataclass(frozen=True)
class SecureResult(AllReduceResult):
    bans: tuple[BanRecord, ...] = ()  # bans that took effect since the previous result (verifications of earlier steps)


class CannotJudge(Exception):
    """This member cannot recompute a target's gradient of a step: it holds no weights of that step (it joined,
    or was behind, since) or the target departed without its inputs. It neither validates nor judges the claim."""


class InputsHook(Protocol):
    """How a member's gradient is recomputed when it is not a function of public data (a pipeline
    stage's: it depends on the activations and output gradients other relays sent it, issue 18 item 2).

    Each member commits, beside its gradient, to the digest of its inputs (signed by their senders);
    a validator fetches them from the target and recomputes; every peer judges an accusation by
    recomputing from the inputs carried as its evidence.
    """

    def commitment(self, step: int) -> bytes: ...

    async def fetch(self, target: str, step: int, committed: bytes) -> bytes | None: ...

    @property
    def departure_wait(self) -> float:
        """How long `fetch` may wait, after the target's silence, for a silent target to leave the view."""

    def recompute(self, target: str, step: int, inputs: bytes) -> torch.Tensor | None:
        """The target's gradient from its inputs; None when the inputs prove a lie; raises CannotJudge."""


class AdmissionHook(Protocol):
    """What the round asks of admission (App. F): who does what in a step, and whom its verification approved."""

    async def roles(self, step: int, group: list[str]) -> Roles: ...

    async def settle(self, step: int, approved: tuple[str, ...], departed: tuple[str, ...] = ()) -> None: ...

    def checkpoint_state(self) -> dict: ...

    def load_checkpoint_state(self, saved: dict) -> None: ...


class RecomputeCache:
    """`compute(peer, step)`, each (peer, step) computed once while its step is among the newest `steps` asked for.

    A step's verification may need one member's gradient more than once: a validator's recomputation
    (`validate`), the metadata filled in for a contributor that sent none (`_fill_missing_meta`), the verdict
    on a `gradient` accusation. The gradient is a function of public data at that step's parameters, so each
    is the same tensor; callers read it and never write to it. Older steps are dropped (they are recomputed
    if asked for again), and at most `per_step` gradients are held for a step (the first asked for: validators'
    targets and missing metadata come before the verdicts; a slanderer that accuses every member gets the rest
    recomputed, not held), so at most steps x per_step gradients are held.
    """

    def __init__(self, compute: Callable[[str, int], torch.Tensor], steps: int = 2, per_step: int = 4) -> None:
        if steps < 1 or per_step < 1:
            raise ConfigError(f"a recompute cache must hold at least one step and one gradient a step, got {steps}, {per_step}")
        self.compute = compute
        self.steps = steps
        self.per_step = per_step
        self._held: dict[tuple[str, int], torch.Tensor] = {}
        self._newest: int | None = None

    def __call__(self, peer: str, step: int) -> torch.Tensor:
        held = self._held.get((peer, step))
        if held is not None:
            return held
        held = self.compute(peer, step)
        if self._newest is None or step > self._newest:
            self._newest = step
            for key in [k for k in self._held if k[1] <= step - self.steps]:
                del self._held[key]
        if step > self._newest - self.steps and sum(1 for k in self._held if k[1] == step) < self.per_step:
            self._held[(peer, step)] = held
        return held

    def held(self) -> list[tuple[str, int]]:
        """The (peer, step) pairs held now."""
        return list(self._held)


@dataclass
class RoundState:
    """One peer's round across steps: what the critical path, the verification and the verdicts share."""

    transport: Transport
    dim: int
    allreduce: AllReduceConfig
    btard: BTARDConfig
    reducer: Reducer  # the configured rule (CenteredClip or the mean), rerun by CHECKAVERAGING
    ledger: BanLedger
    # None: nobody can recompute a member's gradient (a pipeline stage's depends on what other
    # relays sent it): no validators are drawn, no metadata is filled in, no gradient claim holds.
    recompute: Callable[[str, int], torch.Tensor] | None
    # Set (with recompute=None): a member's gradient is recomputed from inputs it committed to.
    inputs: InputsHook | None
    policy: ProtocolPolicy
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> the gradient this peer committed
    used: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> the parts this owner aggregated
    evidence: list[Evidence] = field(default_factory=list)  # the transport's evidence, claimed by the next verification
    pending_sends: set[asyncio.Future] = field(default_factory=set)  # sends not awaited: commitments passed on, a deadline-edge attacker's broadcasts (kept referenced)

    def __post_init__(self) -> None:
        if self.recompute is not None and not isinstance(self.recompute, RecomputeCache):
            self.recompute = RecomputeCache(self.recompute)

    @property
    def tau(self) -> float:
        """CenteredClip's tau in the V1/V2 projections (inf for the mean)."""
        return self.allreduce.tau if self.allreduce.reducer == "centered_clip" else float("inf")

    @property
    def eps(self) -> float:
        return self.allreduce.eps


@dataclass
class StepState:
    """Everything one step's checks and verdicts read."""

    step: int
    group: list[str]  # the partition owners (the whole group unless admission says otherwise)
    bounds: list[tuple[int, int]]
    g: bytes = b""  # digest of the whole group, named by every signed payload of the step
    members: list[str] = field(default_factory=list)  # the whole group
    committers: list[str] = field(default_factory=list)  # owners and untrusted members
    commits: dict[str, tuple[list[bytes], bytes]] = field(default_factory=dict)
    rcommits: dict[str, tuple[bytes, list[str], dict[str, str]]] = field(default_factory=dict)  # owner -> (hash, from, drop)
    inputs: dict[str, bytes] = field(default_factory=dict)  # committer -> digest of its committed inputs (InputsHook)
    aggregates: dict[str, torch.Tensor] = field(default_factory=dict)
    passed: set[str] = field(default_factory=set)  # owners most other owners dropped as silent: partitions left out
    passed_on: set[tuple[str, bytes]] = field(default_factory=set)  # (sender, payload digest) of declarations I passed on
    gathered_by: float = 0.0  # (clock) when my gather would have ended at the latest: other members may gather until then
    meta: dict[str, tuple[dict, dict]] = field(default_factory=dict)
    z: torch.Tensor | None = None
    z64: torch.Tensor | None = None
    pairs: list[tuple[str, str]] = field(default_factory=list)
    reports: dict[str, dict] = field(default_factory=dict)
    sum_failed: set[str] = field(default_factory=set)
    declaration_failed: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)  # members whose report for the step nobody holds
    late: set[str] = field(default_factory=set)  # committers most other owners declared late: departed (`late_for_most`)
    filled: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # metadata recomputed for contributors that sent none
    averaging: dict[str, bool] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)  # this peer's own claims, reported in step 6

    def slice(self, owner: str) -> slice:
        a, b = self.bounds[self.group.index(owner)]
        return slice(a, b)

    def contributors(self, owner: str) -> list[str]:
        """The parts partition `owner` must aggregate: every owner whose commitment is held, less the
        owners it dropped (each drop an ELIMINATE). Never the owner's own list of what it used."""
        drop = self.rcommits[owner][2] if owner in self.rcommits else {}
        return [p for p in self.group if p in self.commits and p not in drop]

    def take_inputs(self, peer: str, obj: dict) -> None:
        """Keep the digest of the inputs a parsed commitment binds (InputsHook), if it names one."""
        if "inputs" in obj:
            self.inputs[peer] = obj["inputs"]

    def meta_lie(self, peer: str, owner: str, part: torch.Tensor, tau: float) -> str | None:
        """Which of peer's reports about partition `owner` is false, given its part; None if both hold."""
        meta = self.meta.get(peer)
        if meta is None or owner not in meta[0] or owner not in meta[1]:
            return "no_meta"
        proj = project(part, self.aggregates[owner], self.z64[self.slice(owner)], tau)
        if not norm_matches(meta[0][owner], proj.norm):
            return "v1_norm"
        if not s_matches(meta[1][owner], proj, float(self.z[self.slice(owner)].norm())):
            return "v2_s"
        return None
