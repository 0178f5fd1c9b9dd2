"""`phalanx bench btard-redteam`: random multi-point Byzantine strategies against BTARD's round.

Each trial draws, from its seed, a swarm (n peers, f colluders running
`RedTeam` at a random rate, m validators) and runs it in the simulator for a
few steps, then checks three invariants on what the honest peers did:

1. honest models identical: every honest peer ends with the same parameters
   and the same ban ledger;
2. no honest peer banned, except as the partner of a Byzantine in an
   ELIMINATE (App. D.3's price: an owner's "their part never came" cannot be
   disproved, so both go);
3. bounded effect: on a step where, on some partition, the update the honest
   peers applied is further from the honest-only CenteredClip than
   CenteredClip's bound (tau · b / h for b colluders, h the honest parts within
   tau of the honest-only result, plus float slack), some colluder's ban takes effect within K steps: for
   a claim of the step before (resolved after this step's update, App. B),
   of this step, or of the next K - 1 steps. A colluder's partition that the
   honest peers left out (its owner passed over as silent: the slice is zero
   on every honest peer) is an omission, not a push: what an honest owner's
   crash costs. It passes if that colluder is out of the group or banned
   within K steps (else it could leave its share of the model out for ever).

A violation is printed with its trial seed and the colluders' moves (each
move is a pure function of the seed, so the seed reproduces it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..algorithms.btard.redteam import RedTeam
from ..algorithms.robust.reducers import make_reducer
from ..core.errors import ConfigError
from ..core.rng import py_stream
from ..runs.dp.swarm import peer_identity
from ..runtime.dp.peer import DataParallelPeer, TrainConfig, task_of
from ..runtime.rounds.btard_state import BTARDConfig
from ..runtime.rounds.butterfly import AllReduceConfig, part_bounds
from ..training.task import flat_params
from ..transport.sim import SimConfig, SimNetwork, run_simulation
from .common import bench_config

TAU = 1.0
SLACK = 1e-4  # relative float slack on CenteredClip's bound (its own eps and float32 rounding are far below)


@dataclass(frozen=True)
class RedTeamConfig:
    trials: int = 20
    first_seed: int = 0
    steps: int = 6
    min_peers: int = 4
    max_peers: int = 7
    k: int = 2  # a harmful step must be followed by a colluder's ban within k steps of claims
    minutes: float = 0.0  # > 0: keep drawing trials until this much wall time has passed (trials is then a floor)
    points: str = ""  # comma-separated decision points the colluders may deviate at ("": all), e.g. "aggregate,declare"

    def __post_init__(self) -> None:
        if self.trials < 1 or self.steps < 2 or self.k < 1:
            raise ConfigError("btard-redteam needs trials >= 1, steps >= 2 and k >= 1")
        if not 4 <= self.min_peers <= self.max_peers:
            raise ConfigError(f"btard-redteam needs 4 <= min_peers ({self.min_peers}) <= max_peers ({self.max_peers})")


def quick() -> RedTeamConfig:
    return RedTeamConfig()


def full() -> RedTeamConfig:
    return RedTeamConfig(trials=200, steps=8, max_peers=8)


PRESETS = {"quick": quick, "full": full}


@dataclass
class Trial:
    seed: int
    peers: int
    colluders: int
    validators: int
    rate: float
    violations: list[str]
    moves: list[tuple[int, str, str]]
    bans: list[dict]


@dataclass
class Update:
    group: list[str]  # the step's group; partition j belongs to group[j] (no admission in the harness)
    vector: torch.Tensor  # the update an honest peer applied
    missing: set[str]  # owners whose partition it left out (passed over, or no aggregate)


def bounded_effect(
    updates: dict[int, Update], gradients: dict[int, dict[str, torch.Tensor]], colluders: frozenset[str],
    banned_colluders: list[int], k: int,
) -> list[str]:
    """Invariant 3 over the honest peers' updates and honest gradients (`gradients[step][peer]`):
    the steps where a partition moved further than CenteredClip's bound from the honest-only
    CenteredClip, or a colluder's partition was left out (more than once per colluder, or while it
    stayed in the group), with no colluder's ban to answer for it."""
    reduce = make_reducer("centered_clip", tau=TAU)
    violations: list[str] = []
    excused: set[str] = set()  # colluders whose left-out partition was excused once
    for step, update in sorted(updates.items()):
        group, applied = update.group, update.vector
        present = [p for p in group if p in gradients.get(step, {})]
        b = sum(1 for p in group if p in colluders)
        # step s's claims are resolved at the end of step s + 1's all-reduce (App. B): a ban for
        # the step before this one takes effect after this step's update, so it counts
        answered = any(step - 1 <= s < step + k for s in banned_colluders)
        if not present or b == 0 or answered:
            continue
        rows = torch.stack([gradients[step][p] for p in present])
        for owner, (a, z) in zip(group, part_bounds(applied.numel(), len(group))):
            if owner in colluders and owner in update.missing and not applied[a:z].any():
                # A colluder that stops costs its partition for one step, as a crash does: excused once per
                # colluder per trial (it could otherwise leave, come back and stop again), and only if it
                # stays out of the next k steps (those the trial has: in its last ones, the once is the bound).
                later = [updates[s].group for s in range(step + 1, step + k + 1) if s in updates]
                if any(owner in g for g in later):
                    violations.append(f"step {step}: colluder {owner[:8]}'s partition was left out and it stayed in the group for {k} more steps unbanned")
                    break
                if owner in excused:
                    violations.append(f"step {step}: colluder {owner[:8]}'s partition was left out again (a crash costs it once)")
                    break
                excused.add(owner)
                continue
            honest_only = reduce(rows[:, a:z])
            gap = float((applied[a:z] - honest_only).norm())
            # b clipped rows of norm <= tau move the fixed point by about tau·b over the number of honest
            # rows that are not clipped themselves (each of those pulls back with weight 1)
            inside = int(((rows[:, a:z] - honest_only).norm(dim=1) <= TAU).sum())
            bound = TAU * b / max(1, inside) * (1 + SLACK) + SLACK * float(honest_only.norm())
            if gap > bound:
                violations.append(f"step {step}: a partition moved {gap:.3g} > {bound:.3g} from the honest-only CenteredClip and no colluder was banned within {k} steps")
                break
    return violations


def run_trial(seed: int, config: RedTeamConfig) -> Trial:
    """One seeded swarm under one random strategy; the invariants it broke (empty: none)."""
    draw = random.Random(seed)
    n = draw.randint(config.min_peers, config.max_peers)
    f = draw.randint(1, (n - 1) // 2)
    m = draw.randint(1, max(1, (n - f) // 2))
    rate = draw.choice((0.1, 0.3, 0.6, 1.0))
    identities = [peer_identity(seed, i) for i in range(n)]
    byzantine = sorted(draw.sample(range(n), f))
    colluders = frozenset(identities[i].peer_id for i in byzantine)
    task = task_of(TrainConfig())
    btard = BTARDConfig(enabled=True, validators=m, timeout=1.0)
    allreduce = AllReduceConfig(reducer="centered_clip", tau=TAU)
    peers: list[DataParallelPeer] = []
    policies: list[RedTeam] = []
    gradients: dict[int, dict[str, torch.Tensor]] = {}
    updates: dict[int, Update] = {}

    async def main() -> None:
        network = SimNetwork(SimConfig(seed=seed))
        for i, identity in enumerate(identities):
            points = frozenset(p for p in config.points.split(",") if p)
            policy = RedTeam(seed=seed, colluders=colluders, rate=rate, points=points) if i in byzantine else None
            if policy is not None:
                policies.append(policy)
            peer = DataParallelPeer(network.add_peer(identity), task, TrainConfig(), seed, allreduce=allreduce, btard=btard, policy=policy)
            peer.allreduce.entropy = py_stream(seed, identity.peer_id, "mprng").randbytes
            peers.append(peer)
            if i not in byzantine:
                peer.on_result.append(lambda step, result, peer=peer: gradients.setdefault(step, {}).update({peer.transport.peer_id: peer.allreduce.state.grads[step].clone()}))
        watcher = next(p for i, p in enumerate(peers) if i not in byzantine)
        watcher.on_result.append(lambda step, result: updates.__setitem__(step, Update(list(result.group), result.vector.clone(), set(result.missing_parts))))
        tasks = [network.spawn(identities[i].peer_id, lambda i=i: peers[i].run(config.steps)) for i in range(n)]
        for t in tasks:
            await t

    run_simulation(main)
    honest = [p for i, p in enumerate(peers) if i not in byzantine]
    honest_ids = {p.transport.peer_id for p in honest}
    violations: list[str] = []
    # 1. identical models and ledgers (among the honest peers still training: an eliminator stops)
    training = [p for p in honest if not p.ledger.is_banned(p.transport.peer_id)] or honest
    if len({bytes(flat_params(p.model).numpy().tobytes()) for p in training}) != 1:
        violations.append("honest models differ")
    if len({json.dumps([dataclasses.astuple(r) for r in p.ledger.records]) for p in training}) != 1:
        violations.append("honest ledgers differ")
    # 2. honest bans only as a colluder's ELIMINATE partner
    records = training[0].ledger.records
    for record in records:
        if record.peer not in honest_ids:
            continue
        partner = next((r for r in records if r.step == record.step and r.accuser == record.accuser and r.peer != record.peer), None)
        eliminate = record.reason == "eliminator" or record.reason.startswith("eliminated:")
        if not eliminate or partner is None or (partner.peer in honest_ids and record.accuser in honest_ids):
            violations.append(f"honest {record.peer[:8]} banned at step {record.step} ({record.reason}, by {record.accuser[:8] or 'all'})")
    # 3. bounded effect, or a colluder's ban within k steps
    banned_colluders = [r.step for r in records if r.peer in colluders]
    violations += bounded_effect(updates, gradients, colluders, banned_colluders, config.k)
    moves = sorted(set(policies[0].moves)) if policies else []
    return Trial(seed, n, f, m, rate, violations, moves, [dataclasses.asdict(r) for r in records])


def run_bench(config: RedTeamConfig, out: Path) -> list[Trial]:
    out.mkdir(parents=True, exist_ok=True)
    trials: list[Trial] = []
    started = time.monotonic()
    seed = config.first_seed
    with (out / "trials.jsonl").open("w") as sink:
        while len(trials) < config.trials or time.monotonic() - started < config.minutes * 60:
            trial = run_trial(seed, config)
            trials.append(trial)
            sink.write(json.dumps(dataclasses.asdict(trial)) + "\n")
            sink.flush()
            for v in trial.violations:
                print(f"VIOLATION seed={trial.seed} n={trial.peers} f={trial.colluders} m={trial.validators} rate={trial.rate}: {v}; moves={trial.moves}")
            seed += 1
    return trials


def run_cli(args: argparse.Namespace) -> int:
    config, out = bench_config(args, "btard-redteam", PRESETS)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
    trials = run_bench(config, out)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    bad = [t for t in trials if t.violations]
    moves = sum(len(t.moves) for t in trials)
    print(f"{len(trials)} trials (seeds {config.first_seed}..{config.first_seed + len(trials) - 1}), {moves} deviations played, "
          f"{len(bad)} with a violation; CPU {cpu:.0f} s; wrote {out / 'trials.jsonl'}")
    return 1 if bad else 0
