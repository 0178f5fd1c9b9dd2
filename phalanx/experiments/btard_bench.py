"""`phalanx bench btard`: BTARD's Figure 3 at laptop scale, in the simulator.

Every cell is a whole simulated swarm (`btard-digits` with overrides): one
attack (or none) against one defence. Defences:

- btard_1, btard_10: the secure round with CenteredClip tau = 1 / 10 and bans;
- no_defense: plain butterfly all-reduce with the mean, no verification;
- mean_nobans: the secure round with the mean (tau = inf) and bans switched
  off: every check runs, nobody is removed (what verification alone buys).

Writes results.csv (accuracy, steps from attack start until every Byzantine
is banned, honest peers banned by ELIMINATE alongside a Byzantine, honest
peers banned otherwise), heatmap.png, and one curve_ATTACK.png per attack with
the ban times of the btard_1 run marked.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import override
from ..core.errors import ConfigError
from ..presets import get_preset
from .simulate import simulate

ATTACKS: dict[str, list[str]] = {
    "none": ["byzantine.attack=none"],
    "sign_flip": ["byzantine.attack=sign_flip"],
    "random_direction": ["byzantine.attack=random_direction"],
    "label_flip": ["byzantine.attack=label_flip", "byzantine.params.num_classes=10"],
    "ipm_0.6": ["byzantine.attack=ipm", "byzantine.params.epsilon=0.6"],
    "alie": ["byzantine.attack=alie"],
    "agg_shift": ["byzantine.attack=agg_shift"],
    "lie_norms": ["byzantine.attack=lie_norms"],
    "slander": ["byzantine.attack=slander"],
    "wrong_hash": ["byzantine.attack=wrong_hash"],
}

DEFENSES: dict[str, list[str]] = {
    "btard_1": ["btard.enabled=true", "allreduce.reducer=centered_clip", "allreduce.tau=1"],
    "btard_10": ["btard.enabled=true", "allreduce.reducer=centered_clip", "allreduce.tau=10"],
    "no_defense": ["btard.enabled=false", "allreduce.reducer=mean"],
    "mean_nobans": ["btard.enabled=true", "allreduce.reducer=mean", "btard.bans=false"],
}
PROTOCOL_ONLY = ("agg_shift", "lie_norms", "slander", "wrong_hash")  # need the secure round to exist


@dataclass(frozen=True)
class BTARDBenchConfig:
    peers: int = 16
    byzantine: int = 7
    validators: int = 2
    steps: int = 150
    attack_start: int = 30
    eval_every: int = 5
    seed: int = 0
    attacks: str = ",".join(ATTACKS)
    defenses: str = ",".join(DEFENSES)
    jobs: int = 0  # parallel processes (0: one per core)

    def __post_init__(self) -> None:
        for key in ("peers", "steps", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if not 0 <= self.byzantine < self.peers - 1:
            raise ConfigError(f"byzantine={self.byzantine} must leave two honest evaluating peers of peers={self.peers}")
        if self.attack_start < 0 or self.jobs < 0 or self.validators < 0:
            raise ConfigError("attack_start, validators and jobs must be >= 0")
        for key, table in (("attacks", ATTACKS), ("defenses", DEFENSES)):
            for label in getattr(self, key).split(","):
                if label not in table:
                    raise ConfigError(f"{key} has unknown entry {label!r}; allowed: {', '.join(table)}")


def quick() -> BTARDBenchConfig:
    """A few minutes on 2 cores: 8 peers (3 Byzantine), four attacks."""
    return BTARDBenchConfig(peers=8, byzantine=3, steps=60, attack_start=20, attacks="none,sign_flip,alie,agg_shift,slander")


def full() -> BTARDBenchConfig:
    """BTARD's setting scaled down: 16 peers, 7 Byzantine, 2 validators, every attack."""
    return BTARDBenchConfig()


PRESETS = {"quick": quick, "full": full}


def run_cell(config: BTARDBenchConfig, attack: str, defense: str, out: Path) -> dict:
    """One simulated run; returns its row of results.csv."""
    cell = out / "cells" / f"{attack}-{defense}"
    row = {"attack": attack, "defense": defense}
    if attack in PROTOCOL_ONLY and not defense.startswith(("btard", "mean_nobans")):
        return {**row, "accuracy": float("nan"), "note": "protocol attack: needs the secure round"}
    run = override(
        get_preset("btard-digits"),
        [
            f"peers={config.peers}", f"steps={config.steps}", f"seed={config.seed}",
            f"byzantine.count={config.byzantine if attack != 'none' else 0}", f"byzantine.start_step={config.attack_start}",
            f"btard.validators={config.validators}", f"train.eval_every={config.eval_every}",
            *ATTACKS[attack], *DEFENSES[defense],
        ],
    )
    simulate(run, cell, progress=False)
    return cell_row(config, attack, defense, cell)


def cell_row(config: BTARDBenchConfig, attack: str, defense: str, cell: Path) -> dict:
    """The results.csv row of a finished cell directory (summary.json, bans.jsonl)."""
    row = {"attack": attack, "defense": defense}
    summary = json.loads((cell / "summary.json").read_text())
    bans = [json.loads(line) for line in (cell / "bans.jsonl").read_text().splitlines()] if (cell / "bans.jsonl").exists() else []
    byzantine = set(summary["byzantine"])
    ban_step = {b["peer"]: b["step"] for b in bans}
    all_banned = byzantine and byzantine <= set(ban_step)
    honest = [b for b in bans if b["peer"] not in byzantine]
    return {
        **row,
        "accuracy": summary["final_accuracy"] if summary["final_accuracy"] is not None else float("nan"),
        "byzantine_banned": len(byzantine & set(ban_step)),
        "steps_to_ban_all": max(ban_step[p] for p in byzantine) - config.attack_start + 1 if all_banned else "",
        "honest_banned_by_eliminate": sum(1 for b in honest if b["reason"] == "eliminator"),
        "honest_banned_other": sum(1 for b in honest if b["reason"] != "eliminator"),
        "wall_seconds": round(summary["wall_seconds"], 1),
        "note": "",
    }


FIELDS = ["attack", "defense", "accuracy", "byzantine_banned", "steps_to_ban_all", "honest_banned_by_eliminate", "honest_banned_other", "wall_seconds", "note"]


def run_bench(config: BTARDBenchConfig, out: Path) -> list[dict]:
    attacks, defenses = config.attacks.split(","), config.defenses.split(",")
    cells = [(a, d) for a in attacks for d in defenses]
    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        rows = [run_cell(config, a, d, out) for a, d in cells]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(run_cell, [config] * len(cells), *zip(*cells), [out] * len(cells)))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in FIELDS})
    _draw(config, rows, out)
    return rows


def _draw(config: BTARDBenchConfig, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks, defenses = config.attacks.split(","), config.defenses.split(",")
    lookup = {(r["attack"], r["defense"]): r["accuracy"] for r in rows}
    fig, ax = plt.subplots(figsize=(1.4 * len(defenses) + 2, 0.6 * len(attacks) + 2))
    grid = [[lookup[(a, d)] for d in defenses] for a in attacks]
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(defenses)), defenses, rotation=30, ha="right")
    ax.set_yticks(range(len(attacks)), attacks)
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            text = "n/a" if value != value else f"{value:.2f}"
            ax.text(j, i, text, ha="center", va="center", color="k" if value == value and value > 0.6 else "w", fontsize=8)
    ax.set_title(f"final accuracy, {config.byzantine} of {config.peers} Byzantine from step {config.attack_start}")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "heatmap.png", dpi=110)
    plt.close(fig)
    for attack in attacks:
        fig, ax = plt.subplots(figsize=(7, 4))
        for defense in defenses:
            metrics = out / "cells" / f"{attack}-{defense}" / "metrics.jsonl"
            if metrics.exists():
                points = [json.loads(line) for line in metrics.read_text().splitlines()]
                points = [p for p in points if "test_accuracy" in p]
                ax.plot([p["step"] for p in points], [p["test_accuracy"] for p in points], label=defense)
        bans = out / "cells" / f"{attack}-btard_1" / "bans.jsonl"
        if bans.exists():
            for k, line in enumerate(bans.read_text().splitlines()):
                ax.axvline(json.loads(line)["step"], color="tab:red", alpha=0.3, lw=1, label="ban (btard_1)" if k == 0 else None)
        ax.axvline(config.attack_start, color="k", ls="--", lw=1, label="attack start")
        ax.set(xlabel="step", ylabel="test accuracy", ylim=(0, 1), title=f"attack: {attack}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"curve_{attack}.png", dpi=110)
        plt.close(fig)


def format_table(rows: list[dict]) -> str:
    lines = ["| attack | defense | accuracy | Byzantine banned | steps to ban all | honest banned by ELIMINATE | honest banned otherwise |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "n/a" if r["accuracy"] != r["accuracy"] else f"{r['accuracy']:.3f}"
        lines.append(f"| {r['attack']} | {r['defense']} | {acc} | {r.get('byzantine_banned', '')} | {r.get('steps_to_ban_all', '')} | {r.get('honest_banned_by_eliminate', '')} | {r.get('honest_banned_other', '')} |")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    if args.preset not in PRESETS:
        raise ConfigError(f"unknown btard bench preset {args.preset!r}; allowed: {', '.join(PRESETS)}")
    config = override(PRESETS[args.preset](), args.set or [])
    out = Path(args.out) if args.out else Path("runs") / f"bench-btard-{args.preset}"
    rows = run_bench(config, out)
    print(format_table(rows))
    print(f"wrote {out / 'results.csv'}, {out / 'heatmap.png'} and curve_*.png")
    return 0
