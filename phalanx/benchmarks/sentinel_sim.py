"""`phalanx bench sentinel` in the simulator: SENTINEL's Table 1 over the pipeline runtime.

Each run is a `simulate_pipeline` run: one data node (embedding and loss), three
relay stages of `relays` relays each (block 0 | block 1 | head), routed by
SWARM or GWTF over the simulated network, with SENTINEL's verifiers on the stage
boundaries (`placement=boundary`) or in the data node (client-routed). In
stages 1 and 2, `malicious` relays (drawn from the seed) run an
`AttackingRelay` from `attack_start`; the head stage and the data node are
honest, as the paper assumes. Detection is scored per tensor against the attack
log (the verifiers never read it): a tampered tensor is caught when it is
flagged or replaced by the momentum; tensors judged during warm-up, refused
from banned senders, or tainted honest ones are not scored. Loss = held-out
loss of the model made of one honest replica per stage after the last
iteration. Overhead = mean simulated iteration time of the clean run with
verifiers over the clean run without (and the same for wall time).
Per worker, a relay is detected when a verifier banned it or, in detect-only
runs (`detect=true`: flag and respond, never ban), convicted it (it reached the
strike rule). Detect-only runs also replay other distance sets and votes over
their own verdicts (`replay_votes`): the vote ablation.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from ..algorithms.sentinel.statistics import vote
from ..core.rng import py_stream
from ..runs.dp.swarm import peer_identity
from ..runs.pipeline.config import (
    LinkAttackConfig,
    PipelineNetworkConfig,
    PipelineRunConfig,
)
from ..runs.pipeline.run import simulate_pipeline
from ..runtime.dp.peer import TrainConfig
from ..runtime.pipeline.config import PipelineConfig
from ..runtime.pipeline.verifier import VerifierConfig
from .sentinel_variants import VOTE_TOKENS, apply_variant, format_cell

STAGES = 3  # relay stages: block 0 | block 1 | head (the head stage is honest)


def malicious_indices(config) -> list[int]:
    """Relay indices of the malicious relays: `malicious` per attacked stage (1 and 2), seeded."""
    chosen = []
    for stage in (1, 2):
        members = [r for r in range(STAGES * config.relays) if 1 + r % STAGES == stage]
        chosen += py_stream(config.seed, "sentinel-sim-malicious", stage).sample(members, config.malicious)
    return sorted(chosen)


def run_config(config, attack: str, defended: bool, variant: str = "all") -> PipelineRunConfig:
    """The pipeline run of one cell of the grid."""
    # the stage's size is the configuration's (the weighted vote's cap: `Sentinel._voters_of`)
    verifier = VerifierConfig(**{**dataclasses.asdict(config.sentinel), "enabled": defended,
                                 "stage_relays": config.sentinel.stage_relays or config.relays,
                                 "placement": config.placement, "forward_response": config.forward_response})
    verifier = apply_variant(verifier, variant)
    relays = ",".join(map(str, malicious_indices(config))) if attack != "none" else ""
    return PipelineRunConfig(
        preset=f"sentinel-{attack}-{'sentinel' if defended else 'none'}", peers=1 + STAGES * config.relays,
        data_nodes=1, steps=config.iterations, seed=config.seed,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=config.lr, batch_size=config.batch_size),
        pipeline=PipelineConfig(stages=STAGES, microbatches=config.microbatches, capacity=config.microbatches,
                                routing=config.routing, flops_scale=config.flops_scale),
        network=PipelineNetworkConfig(),
        sentinel=verifier,
        attack=LinkAttackConfig(name=attack, relays=relays, target=config.target, start=config.attack_start,
                                fraction=config.fraction, delay=config.delay),
    )


def _f1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / (tp + fn) if tp + fn else float("nan")
    f1 = 2 * precision * recall / (precision + recall) if tp else (0.0 if fn else float("nan"))
    return precision, recall, f1


def scored_verdicts(summary: dict) -> list[tuple[dict, bool]]:
    """(verdict, tampered) of every verdict that counts for per-tensor detection: warm-up verdicts, refused
    traffic of banned senders and tainted honest tensors are left out."""
    log = {(a["peer"], a["direction"], a["src"], a["seq"], a["att"]): a["tampered"] for a in summary["attacks"]
           if "src" in a}  # lies in a stage all-reduce (target aggregation) pass no link
    out = []
    for v in summary["verdicts"]:
        if v["reason"] in ("warmup", "banned"):
            continue
        tampered = log.get((v["peer"], v["direction"], v["src"], v["seq"], v["att"]), False)
        if v["reason"] == "tainted" and not tampered:
            continue
        out.append((v, tampered))
    return out


def score(summary: dict, malicious: list[str], attack_start: int, relays: list[str] | None = None) -> dict:
    """Per-tensor and per-worker detection against the attack log, bans, loss and timing of one run.

    Per worker, a relay counts as detected when a verifier banned it or (detect-only) convicted it."""
    tp = fp = fn = honest = 0
    for v, tampered in scored_verdicts(summary):
        caught = v["flagged"] or (tampered and v["substituted"])
        tp += tampered and caught
        fn += tampered and not caught
        fp += caught and not tampered
        honest += not tampered
    precision, recall, f1 = _f1(tp, fp, fn)
    first_ban = {}
    for b in summary["bans"]:
        first_ban.setdefault(b["peer"], b["step"])
    detected = dict(first_ban)
    for v in summary["verdicts"]:
        for w in v.get("convicted", ()):
            detected.setdefault(w, v["it"])
    relays = relays if relays is not None else sorted(set(detected) | set(malicious))
    w_tp = sum(1 for w in relays if w in detected and w in malicious)
    w_fp = sum(1 for w in relays if w in detected and w not in malicious)
    w_fn = sum(1 for w in malicious if w not in detected)
    _, _, worker_f1 = _f1(w_tp, w_fp, w_fn)
    delays = [detected[w] - attack_start + 1 for w in malicious if w in detected]
    durations = [m["duration"] for m in summary["metrics"]]
    losses = [m["loss"] for m in summary["metrics"][-5:] if m["loss"] is not None]
    return {
        "tampered": tp + fn, "tp": tp, "fp": fp, "fn": fn, "precision": precision, "recall": recall, "f1": f1,
        "fp_rate": fp / honest if honest else float("nan"), "honest_checked": honest,
        "worker_f1": worker_f1, "detected": sorted(detected), "honest_detected": w_fp,
        "banned": sorted(first_ban), "malicious": sorted(malicious), "exact_bans": sorted(first_ban) == sorted(malicious),
        "honest_banned": len(set(first_ban) - set(malicious)), "ban_iterations": delays,
        "max_ban_iterations": max(delays) if malicious and len(delays) == len(malicious) else None,
        "val_loss": summary["val_loss"], "train_loss": sum(losses) / len(losses) if losses else None,
        "iteration_seconds": sum(durations) / len(durations), "wall_s": summary["wall_seconds"],
        "completed": sum(m["completed"] for m in summary["metrics"]),
    }


def replay_votes(summary: dict, rules: list[str]) -> dict[str, dict]:
    """Per-tensor detection of other distance sets and votes, replayed from a run's verdicts.

    Each judged tensor records which distances were outside their fences; a rule "d1+d2:vote" flags it
    when `vote` of those distances are outside. Only tensors the run judged by the fences count (not those
    its own flags tainted). Approximate: the EMA and the windows were those of the run's own rule (a tensor
    this rule would accept but the run flagged did not update them)."""
    out = {}
    scored = [(v, t) for v, t in scored_verdicts(summary) if v["reason"] in ("fence", "ok")]
    for rule in rules:
        names, rule_vote = rule.split(":")
        subset = set(names.split("+"))
        tp = fp = fn = honest = 0
        for v, tampered in scored:
            present = subset & set(v["distances"])  # bind is missing where no input sketch was recorded
            caught = bool(present) and vote(len(present & set(v["outside"])), len(present), VOTE_TOKENS[rule_vote])
            tp += tampered and caught
            fn += tampered and not caught
            fp += caught and not tampered
            honest += not tampered
        precision, recall, f1 = _f1(tp, fp, fn)
        out[rule] = {"f1": f1, "precision": precision, "recall": recall, "fp_rate": fp / honest if honest else float("nan"),
                     "tampered": tp + fn}
    return out


REPLAY_RULES = ["l1+l2+sign+swd:any", "l1+l2+sign+swd:majority", "l1+l2+sign+swd:unanimous", "l1:any", "l2:any",
                "sign:any", "swd:any", "scale:any", "bind:any", "align:any", "sign+swd:any", "sign+swd:unanimous",
                "sign+bind:any", "sign+swd+bind:any", "sign+swd+bind+align:any", "sign+swd+bind+scale:any",
                "sign+swd+bind+align+scale:any", "sign+swd+bind+align+scale:majority", "l1+l2+sign+swd+bind:any",
                "l1+l2+sign+swd+bind:majority"]


def replay_rules(measured: tuple[str, ...]) -> list[str]:
    """The rules of `REPLAY_RULES` a run can replay: those whose distances the run measured."""
    return [rule for rule in REPLAY_RULES if set(rule.split(":")[0].split("+")) <= set(measured)]


def run_one(config, attack: str, defended: bool, variant: str = "all") -> dict:
    run = run_config(config, attack, defended, variant)
    summary = simulate_pipeline(run, progress=False, evaluate=True)
    ids = [peer_identity(run.seed, run.data_nodes + i).peer_id for i in run.attack.indices]
    row = {"attack": attack, "defended": defended, "variant": variant,
           **score(summary, ids, config.attack_start, summary["peer_ids"][run.data_nodes:])}
    if defended and "detect" in variant.split("/"):
        row["replay"] = replay_votes(summary, replay_rules(run.sentinel.distance_names))
    return row


def _packed(args: tuple) -> dict:
    return run_one(*args)


def run_grid(config, specs: list, partial: Path | None = None) -> list[dict]:
    """Every (attack, defended, variant) of `specs`, in `config.jobs` processes (0: one per core);
    each row is appended to `partial` (JSON lines) as soon as its run ends."""
    todo = [(config, s.attack, s.defended, s.variant) for s in specs]
    jobs = config.jobs or os.cpu_count() or 1
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        if partial is not None:
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")

    if jobs == 1:
        for t in todo:
            keep(_packed(t))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(_packed, t) for t in todo]):
                keep(future.result())
    return rows


def format_table(config, rows: list[dict], attacks: list[str], ablation: list[str], ablation_attacks: list[str]) -> str:
    by = {(r["attack"], r["defended"], r["variant"]): r for r in rows}
    clean, clean_def = by[("none", False, "all")], by[("none", True, "all")]
    lines = [
        f"SENTINEL bench - SIMULATOR pipeline runtime (placement={config.placement}, routing={config.routing}, "
        f"forward_response={config.forward_response})",
        f"chars-gpt in {STAGES} relay stages x {config.relays} relays + 1 data node; {config.iterations} iterations x "
        f"{config.microbatches} microbatches of {config.batch_size}; {config.malicious}/{config.relays} relays malicious "
        f"in stages 1 and 2 from iteration {config.attack_start}; target={config.target}, fraction={config.fraction}; "
        f"warm-up {config.sentinel.warmup} tensors per link and direction",
        "",
        "with bans (F1 per tensor, and per worker: banned relays against the malicious ones)",
        f"{'attack':16s} {'F1':>6s} {'prec':>6s} {'recall':>6s} {'tamp':>5s} {'F1 wkr':>6s} {'bans(it)':>10s} {'exact':>5s} "
        f"{'honest':>6s} {'loss SENT':>9s} {'loss none':>9s} {'clean':>7s} {'gap%':>6s}",
    ]
    for attack in attacks:
        d, u = by[(attack, True, "all")], by.get((attack, False, "all"), {"val_loss": None})
        gap = 100 * (d["val_loss"] / clean["val_loss"] - 1) if d["val_loss"] and clean["val_loss"] else float("nan")
        bans = ",".join(map(str, d["ban_iterations"])) or "-"
        lines.append(
            f"{attack:16s} {format_cell(d['f1']):>6s} {format_cell(d['precision']):>6s} {format_cell(d['recall']):>6s} {d['tampered']:5d} "
            f"{format_cell(d.get('worker_f1')):>6s} {bans:>10s} {str(d['exact_bans']):>5s} {d['honest_banned']:6d} {format_cell(d['val_loss'], '9.4f')} "
            f"{format_cell(u['val_loss'], '9.4f')} {format_cell(clean['val_loss'], '7.4f')} {format_cell(gap, '+6.2f')}")
    lines += [
        "",
        f"clean run: val loss {format_cell(clean['val_loss'], '.4f')} without verifiers, {format_cell(clean_def['val_loss'], '.4f')} "
        f"with; false-positive rate {100 * clean_def['fp_rate']:.3f}% ({clean_def['fp']} flags), "
        f"bans {clean_def['banned'] or 'none'}",
        f"overhead: simulated iteration time with / without verifiers = "
        f"{clean_def['iteration_seconds'] / clean['iteration_seconds']:.3f} ({clean_def['iteration_seconds']:.3f} s / "
        f"{clean['iteration_seconds']:.3f} s); wall with / without = {clean_def['wall_s'] / clean['wall_s']:.3f} "
        f"({clean_def['wall_s']:.1f} s / {clean['wall_s']:.1f} s)",
    ]
    if ("none", True, "detect") in by:
        lines += detect_section(by, attacks)
    if ablation:
        lines += ["", "ablation: F1 per verifier variant (beta0: beta_h = beta_g = 0; l1/l2/sign/swd: that distance alone; "
                  "all: combined)", f"{'variant':8s} " + " ".join(f"{a[:10]:>10s}" for a in ablation_attacks) + f" {'mean':>6s}"]
        for variant in ablation:
            f1s = [by[(a, True, variant)]["f1"] for a in ablation_attacks]
            good = [v for v in f1s if v == v]
            mean = sum(good) / len(good) if good else float("nan")
            lines.append(f"{variant:8s} " + " ".join(f"{format_cell(v):>10s}" for v in f1s) + f" {format_cell(mean):>6s}")
    return "\n".join(lines)


def detect_section(by: dict, attacks: list[str]) -> list[str]:
    """Detect-only runs (nobody banned): F1 per tensor and per worker (convicted = reached the strike rule),
    then the replayed vote ablation over the same verdicts."""
    clean = by[("none", True, "detect")]
    lines = ["", "detect-only (verifiers flag and respond, nobody is banned; per worker: relays that reached the strike rule)",
             f"{'attack':16s} {'F1':>6s} {'prec':>6s} {'recall':>6s} {'tamp':>5s} {'F1 wkr':>6s} {'convicted(it)':>13s} "
             f"{'honest':>6s} {'loss':>7s}"]
    for attack in attacks:
        d = by.get((attack, True, "detect"))
        if d is None:
            continue
        lines.append(
            f"{attack:16s} {format_cell(d['f1']):>6s} {format_cell(d['precision']):>6s} {format_cell(d['recall']):>6s} "
            f"{d['tampered']:5d} {format_cell(d['worker_f1']):>6s} {','.join(map(str, d['ban_iterations'])) or '-':>13s} "
            f"{d['honest_detected']:6d} {format_cell(d['val_loss'], '7.4f')}")
    lines.append(f"clean detect-only run: false-positive rate {100 * clean['fp_rate']:.3f}% ({clean['fp']} of "
                 f"{clean['honest_checked']} honest tensors), convicted {clean['detected'] or 'none'}")
    rules = list(clean.get("replay", {}))
    if rules:
        shown = [a for a in attacks if (a, True, "detect") in by]
        lines += ["", "vote ablation, replayed from the detect-only verdicts (per-tensor F1; clean FP%: false flags "
                  "of the clean run)", f"{'rule':26s} " + " ".join(f"{a[:9]:>9s}" for a in shown) +
                  f" {'mean':>6s} {'min':>6s} {'clean FP%':>9s}"]
        for rule in rules:
            f1s = [by[(a, True, "detect")]["replay"][rule]["f1"] for a in shown]
            good = [v for v in f1s if v == v]
            lines.append(f"{rule:26s} " + " ".join(f"{format_cell(v):>9s}" for v in f1s) +
                         f" {format_cell(sum(good) / len(good) if good else float('nan')):>6s} "
                         f"{format_cell(min(good) if good else float('nan')):>6s} "
                         f"{100 * clean['replay'][rule]['fp_rate']:9.3f}")
    return lines
