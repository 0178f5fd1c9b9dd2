"""`phalanx bench sentinel`: SENTINEL's Table 1 at laptop scale.

By default (`engine=simulator`) every cell is a run of the pipeline runtime in
the simulator, with verifiers on the stage boundaries or in the data node
(`benchmarks/sentinel_sim.py`). `--set engine=inprocess` runs the fast
in-process reference described here: one process trains the small character GPT cut into 4 stages
(`GPT.stages(4)`: embedding | block 0 | block 1 | head). The data node holds
stages 0 and 3 and the loss (honest, as the paper assumes); each middle stage
is served by `relays` relays; each iteration, microbatches are dealt
round-robin over a seeded shuffle of the relays that are not banned (so a
relay meets different neighbours). Relays of a stage share the stage's parameters, which is
exactly "copies kept identical by averaging their gradients every step" (the
loss is the mean over all microbatches, so the summed gradient is the same).
Each relay sends its outgoing activations and activation gradients through its
`LinkAttack` policy (honest relays: the no-op policy); `malicious` relays per
middle stage attack from `attack_start`. One `Sentinel` verifier watches the
three stage links; it checks every tensor a relay sends (the data node's own
tensors are trusted) and never sees the attack log, which is only used to
score it afterwards.

Per run it reports per-tensor precision / recall / F1 (after warm-up),
iterations from attack start to each malicious relay's ban, the banned set,
the false-positive rate, and the final validation loss, for every attack with
and without SENTINEL next to the clean run; then an ablation (beta = 0, each
distance alone, all combined) and the in-process verifier overhead (wall time
of the clean run with the verifier over without; network hops not included).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..algorithms.sentinel.attacks import (
    ACTIVATION,
    GRADIENT,
    TARGETS,
    LinkAttack,
    LinkView,
    make_link_attack,
)
from ..algorithms.sentinel.statistics import BACKWARD, FORWARD, Sentinel, SentinelConfig
from ..core.errors import ConfigError
from ..core.rng import py_stream
from ..runs.attack_axes import check_name
from ..training.task import CharGPTTask
from .common import bench_config
from .sentinel_variants import apply_variant, format_cell

TABLE_ATTACKS = ("zeros", "random", "scaling", "sign_flip", "delay", "bias", "invisible_noise", "mixed", "adaptive",
                 "mimic", "budget")
ABLATIONS = ("beta0", "l1", "l2", "sign", "swd", "all")
DATA_NODE = "data"


@dataclass(frozen=True)
class SentinelBenchConfig:
    iterations: int = 300
    attack_start: int = 100  # malicious relays behave honestly before this iteration
    microbatches: int = 8  # per iteration
    batch_size: int = 8  # sequences per microbatch
    block_size: int = 32
    n_embd: int = 64
    relays: int = 4  # per middle stage (stages 1 and 2)
    malicious: int = 1  # per middle stage: 1 of 4 = 25%, 3 of 8 = 37.5%
    lr: float = 3e-3
    clip: float = 1.0  # global gradient-norm clipping before each AdamW step (0: none), as LLM recipes do
    seed: int = 0
    attacks: str = ",".join(TABLE_ATTACKS)
    target: str = "both"  # activations, gradients or both
    fraction: float = 1.0  # of a malicious relay's microbatches that it attacks
    delay: int = 20  # iterations by which the delay attack's tensors are stale
    ablation: str = ",".join(ABLATIONS)  # variants run with SENTINEL on `ablation_attacks` ("" for none)
    ablation_attacks: str = "zeros,random,scaling,sign_flip,invisible_noise,mixed"
    jobs: int = 0  # parallel processes (0: one per core)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    engine: str = "simulator"  # simulator (the pipeline runtime) or inprocess (the fast reference)
    placement: str = "boundary"  # simulator: verifiers on the boundaries, or data_node (client-routed)
    routing: str = "swarm"  # simulator: swarm or gwtf (data_node placement needs swarm)
    forward_response: str = "pass"  # simulator: pass a flagged activation on, or substitute the activation momentum
    undefended: bool = True  # also run every attack without verification (the "loss none" column)
    detect: bool = False  # simulator: also run every attack (and the clean run) detect-only (flag, never ban)
    flops_scale: float = 200.0  # simulator: compute charged x this (a GPT block then costs ~0.1 s per microbatch: compute-bound)

    def __post_init__(self) -> None:
        for key in ("iterations", "microbatches", "batch_size", "block_size", "n_embd", "relays"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if not 0 <= self.malicious < self.relays / 2:
            raise ConfigError(f"malicious={self.malicious} must be >= 0 and under half of relays={self.relays} (honest majority per stage)")
        if not 0 <= self.attack_start < self.iterations:
            raise ConfigError(f"attack_start={self.attack_start} must be in [0, iterations={self.iterations})")
        warm = -(-self.sentinel.warmup // self.microbatches)  # iterations until every link and direction is judged
        if self.attack_start < warm:
            raise ConfigError(f"attack_start={self.attack_start} falls inside the verifiers' warm-up ({warm} iterations of "
                              f"{self.microbatches} microbatches for sentinel.warmup={self.sentinel.warmup}): the fences "
                              f"would learn the attack as honest; start it at >= {warm} or lower sentinel.warmup")
        if self.target not in TARGETS:
            raise ConfigError(f"target={self.target!r} must be one of {', '.join(TARGETS)}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction={self.fraction} must be in (0, 1]")
        if self.engine not in ("simulator", "inprocess"):
            raise ConfigError(f"engine={self.engine!r} must be simulator or inprocess")
        if self.jobs < 0 or self.lr <= 0 or self.clip < 0:
            raise ConfigError(f"jobs={self.jobs} and clip={self.clip} must be >= 0 and lr={self.lr} > 0")
        for name in _names(self.attacks) + _names(self.ablation_attacks):
            check_name("attacks", name, ("link",), honest=False)
        for name in _names(self.ablation):
            apply_variant(self.sentinel, name)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def quick() -> SentinelBenchConfig:
    """Smoke scale: a zero-constant and a scaling attacker, 1 of 4 relays per middle stage, from iteration 20
    (warm-up: 120 tensors per link and direction, i.e. 15 iterations)."""
    return SentinelBenchConfig(iterations=40, attack_start=20, microbatches=8, relays=4, malicious=1,
                               attacks="zeros,scaling", ablation="", jobs=1, sentinel=SentinelConfig(warmup=120))


def table1() -> SentinelBenchConfig:
    """Table 1: every attack, 1 of 4 relays malicious in stages 1 and 2 (25%), from iteration 25; warm-up 160
    tensors (20 iterations). The in-process reference recorded in docs/notes/issue-9.md used 3 of 8 relays
    (37.5%): `--set engine=inprocess --set relays=8 --set malicious=3 ...`."""
    return SentinelBenchConfig(iterations=60, attack_start=25, microbatches=8, relays=4, malicious=1, lr=1e-3,
                               batch_size=4, ablation="", ablation_attacks="zeros,scaling,invisible_noise,mixed",
                               jobs=2, sentinel=SentinelConfig(warmup=160))


PRESETS = {"quick": quick, "table1": table1}


# ---------------------------------------------------------------------------
# one training run


@dataclass(frozen=True)
class RunSpec:
    attack: str  # "none" for the clean run
    defended: bool
    variant: str = "all"  # ablation variant of the verifier config


def _verifier_config(config: SentinelBenchConfig, variant: str) -> SentinelConfig:
    return apply_variant(dataclasses.replace(config.sentinel, seed=config.seed), variant)


def malicious_relays(config: SentinelBenchConfig) -> dict[int, list[str]]:
    """Relay names per middle stage, and which are malicious (seeded, public to the experiment only)."""
    chosen = {}
    for stage in (1, 2):
        picks = py_stream(config.seed, "sentinel-malicious", stage).sample(range(config.relays), config.malicious)
        chosen[stage] = [f"s{stage}r{i}" for i in sorted(picks)]
    return chosen


def run_one(config: SentinelBenchConfig, spec: RunSpec) -> dict:
    """Train once; return the run's figures (detection scored against the attack log)."""
    torch.set_num_threads(1)
    task = CharGPTTask(block_size=config.block_size, n_embd=config.n_embd, n_layer=2, n_head=2)
    model = task.build_model(config.seed)
    stages = model.stages(4)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    bad = malicious_relays(config)
    relays = {s: [f"s{s}r{i}" for i in range(config.relays)] for s in (1, 2)}
    policies: dict[str, LinkAttack] = {}
    for s in (1, 2):
        for name in relays[s]:
            if spec.attack != "none" and name in bad[s]:
                extra = {"delay": config.delay} if spec.attack == "delay" else {}
                policies[name] = make_link_attack(spec.attack, target=config.target, start_step=config.attack_start,
                                                  fraction=config.fraction, seed=config.seed, worker=name, **extra)
            else:
                policies[name] = LinkAttack(worker=name)
    verifier = Sentinel(_verifier_config(config, spec.variant)) if spec.defended else None
    # (iteration, worker, tampered, caught, reason); a tampered gradient the verifier replaced counts as caught
    records: list[tuple[int, str, bool, bool, str]] = []
    ban_iteration: dict[str, int] = {}
    train_losses = []
    stalled = None  # iteration at which a middle stage had no relay left (every one banned)
    start = time.perf_counter()
    for it in range(config.iterations):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(config.microbatches):
            mb = it * config.microbatches + j
            x, y = task.batch(config.seed, DATA_NODE, mb, config.batch_size)
            banned = verifier.banned() if verifier else frozenset()
            path = {}
            if any(all(r in banned for r in relays[s]) for s in (1, 2)):
                stalled = it
                break
            for s in (1, 2):
                order = [r for r in relays[s] if r not in banned]
                py_stream(config.seed, "sentinel-route", it, s).shuffle(order)
                path[s] = order[j % len(order)]
            total += _microbatch(stages, x, y, it, mb, path, policies, verifier, records, config.microbatches)
            if verifier:
                for worker in verifier.banned() - set(ban_iteration):
                    ban_iteration[worker] = it
        if stalled is not None:
            break
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        train_losses.append(total)
    wall = time.perf_counter() - start
    val = task.evaluate(model)["loss"]
    return {**_score(config, spec, bad, records, ban_iteration, train_losses, val, wall), "stalled_at": stalled}


def _microbatch(stages, x, y, it, mb, path, policies, verifier, records, microbatches) -> float:
    """Forward and backward of one microbatch through data node -> relay 1 -> relay 2 -> data node."""
    h0 = stages[0](x)
    received = h0.detach()
    kept = {}
    for s in (1, 2):
        worker = path[s]
        if verifier and verifier.binds:
            verifier.record_input(mb, s, FORWARD, verifier.sketch(received))
        inp = received.requires_grad_(True)
        out = stages[s](inp)
        probe = (lambda t, s=s: verifier.would_accept(s, FORWARD, t, mb)) if verifier else None
        sent = policies[worker].relay(LinkView(ACTIVATION, it, mb, out.detach(), probe))
        if verifier:
            verdict = verifier.check_forward(s, worker, mb, sent.tensor)
            records.append((it, worker, sent.tampered, verdict.flagged, verdict.reason))
        kept[s] = (inp, out)
        received = sent.tensor.detach()
    inp3 = received.requires_grad_(True)
    logits = stages[3](inp3)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / microbatches
    loss.backward()
    grad = inp3.grad
    for s in (2, 1):
        worker = path[s]
        inp, out = kept[s]
        if verifier and verifier.binds:
            verifier.record_input(mb, s, BACKWARD, verifier.sketch(grad))
        out.backward(grad)
        probe = (lambda t, s=s: verifier.would_accept(s - 1, BACKWARD, t, mb)) if verifier else None
        sent = policies[worker].relay(LinkView(GRADIENT, it, mb, inp.grad.detach(), probe))
        grad = sent.tensor
        if verifier:
            verdict = verifier.check_backward(s - 1, worker, mb, sent.tensor)
            caught = verdict.flagged or (sent.tampered and verdict.substitute is not None)
            records.append((it, worker, sent.tampered, caught, verdict.reason))
            grad = verdict.passed_on(sent.tensor)
    h0.backward(grad)
    return loss.item()


def _score(config, spec, bad, records, ban_iteration, train_losses, val, wall) -> dict:
    scored = [r for r in records if r[4] not in ("warmup", "banned") and (r[2] or r[4] != "tainted")]
    tp = sum(1 for r in scored if r[2] and r[3])
    fp = sum(1 for r in scored if not r[2] and r[3])
    fn = sum(1 for r in scored if r[2] and not r[3])
    honest_checks = sum(1 for r in scored if not r[2])
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / (tp + fn) if tp + fn else float("nan")
    f1 = 2 * precision * recall / (precision + recall) if tp else (0.0 if fn else float("nan"))
    malicious = sorted(bad[1] + bad[2]) if spec.attack != "none" else []
    delays = [ban_iteration[w] - config.attack_start + 1 for w in malicious if w in ban_iteration]
    return {
        "attack": spec.attack, "defended": spec.defended, "variant": spec.variant,
        "tampered": tp + fn, "tp": tp, "fp": fp, "fn": fn,
        "precision": precision, "recall": recall, "f1": f1,
        "fp_rate": fp / honest_checks if honest_checks else float("nan"),
        "banned": sorted(ban_iteration), "malicious": malicious,
        "exact_bans": sorted(ban_iteration) == malicious,
        "ban_iterations": delays, "max_ban_iterations": max(delays) if len(delays) == len(malicious) and delays else None,
        "val_loss": val, "final_train_loss": sum(train_losses[-10:]) / max(1, len(train_losses[-10:])), "wall_s": wall,
    }


# ---------------------------------------------------------------------------
# the grid


def specs(config: SentinelBenchConfig) -> list[RunSpec]:
    out = [RunSpec("none", False), RunSpec("none", True)]
    for attack in _names(config.attacks):
        out += [RunSpec(attack, True)] + ([RunSpec(attack, False)] if config.undefended else [])
    if config.detect:
        out += [RunSpec(attack, True, "detect") for attack in ["none", *_names(config.attacks)]]
    for variant in _names(config.ablation):
        for attack in _names(config.ablation_attacks):
            if variant != "all" or attack not in _names(config.attacks):  # else: the main table's run
                out.append(RunSpec(attack, True, variant))
    return out


def _run_packed(args: tuple[SentinelBenchConfig, RunSpec]) -> dict:
    return run_one(*args)


def run_grid(config: SentinelBenchConfig, out: Path | None = None) -> list[dict]:
    """All runs of the grid (in parallel processes when jobs != 1); writes results.csv/json under `out`."""
    todo = specs(config)
    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        rows = [run_one(config, spec) for spec in todo]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(_run_packed, [(config, spec) for spec in todo]))
    if out is not None:
        _write(rows, out)
    return rows


def _write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)


def format_table(config: SentinelBenchConfig, rows: list[dict]) -> str:
    by = {(r["attack"], r["defended"], r["variant"]): r for r in rows}
    clean, clean_def = by[("none", False, "all")], by[("none", True, "all")]
    lines = [
        "SENTINEL bench - IN-PROCESS pipeline (one process, 4 stages, relays share stage parameters);",
        "the simulator/hivemind pipeline wiring comes with the pipeline runtime.",
        f"GPT n_embd={config.n_embd} block={config.block_size}, {config.iterations} iterations x {config.microbatches} "
        f"microbatches of {config.batch_size}; {config.malicious}/{config.relays} relays malicious in each middle stage "
        f"from iteration {config.attack_start}; target={config.target}, fraction={config.fraction}",
        "",
        f"{'attack':16s} {'F1':>6s} {'prec':>6s} {'recall':>6s} {'tamp':>5s} {'bans(it)':>14s} {'exact':>5s} "
        f"{'loss SENT':>9s} {'loss none':>9s} {'clean':>7s} {'gap%':>6s}",
    ]
    for attack in _names(config.attacks):
        d, u = by[(attack, True, "all")], by[(attack, False, "all")]
        gap = 100 * (d["val_loss"] / clean["val_loss"] - 1)
        bans = ",".join(map(str, d["ban_iterations"])) or "-"
        lines.append(
            f"{attack:16s} {format_cell(d['f1']):>6s} {format_cell(d['precision']):>6s} {format_cell(d['recall']):>6s} {d['tampered']:5d} "
            f"{bans:>14s} {str(d['exact_bans']):>5s} {d['val_loss']:9.4f} {u['val_loss']:9.4f} "
            f"{clean['val_loss']:7.4f} {gap:+6.2f}" + (f"  STALLED at iteration {d['stalled_at']} (a stage lost every relay)" if d["stalled_at"] is not None else ""))
    overhead = clean_def["wall_s"] / clean["wall_s"]
    lines += [
        "",
        f"clean run: val loss {clean['val_loss']:.4f} without verifier, {clean_def['val_loss']:.4f} with; "
        f"false-positive rate {100 * clean_def['fp_rate']:.3f}% ({clean_def['fp']} flags), bans {clean_def['banned'] or 'none'}",
        f"verifier overhead (in-process compute only): wall with / without = {overhead:.3f} "
        f"({clean_def['wall_s']:.1f} s / {clean['wall_s']:.1f} s)",
    ]
    variants = _names(config.ablation)
    if variants:
        attacks = _names(config.ablation_attacks)
        lines += ["", "ablation: F1 per verifier variant (beta0: beta_h = beta_g = 0; l1/l2/sign/swd: that distance alone; all: combined)",
                  f"{'variant':8s} " + " ".join(f"{a[:10]:>10s}" for a in attacks) + f" {'mean':>6s}"]
        for variant in variants:
            f1s = [by[(a, True, variant)]["f1"] for a in attacks]
            mean = sum(f1s) / len(f1s)
            lines.append(f"{variant:8s} " + " ".join(f"{format_cell(v):>10s}" for v in f1s) + f" {format_cell(mean):>6s}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    config, out = bench_config(args, "sentinel", PRESETS)
    if config.engine == "simulator":
        from . import sentinel_sim

        rows = sentinel_sim.run_grid(config, specs(config), out / "results.partial.jsonl")
        _write(rows, out)
        print(sentinel_sim.format_table(config, rows, _names(config.attacks), _names(config.ablation),
                                        _names(config.ablation_attacks)))
    else:
        rows = run_grid(config, out)
        print(format_table(config, rows))
    print(f"wrote {out / 'results.csv'} and {out / 'results.json'}")
    return 0
