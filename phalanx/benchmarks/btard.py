"""`phalanx bench btard`: BTARD's Figure 3 at laptop scale, in the simulator.

Every cell is a whole simulated swarm (`btard-digits` with overrides): one
attack (or none) against one defence, for one seed. Attacks are Byzantine
peers that run the protocol and lie (`byzantine.attack`). Defences:

- btard_1, btard_10: the secure round with CenteredClip tau = 1 / 10 and bans;
- mean_nobans: the secure round with the mean (tau = inf) and bans switched
  off: every check runs, nobody is removed (what verification alone buys);
- server_cclip_1, server_geomed, server_coordmed: the paper's trusted-server
  baselines: peer 0 (never Byzantine) collects every whole gradient and
  reduces it with CenteredClip tau = 1, the geometric median or the
  coordinate-wise median (`allreduce.topology=server`), no verification;
- no_defense: plain butterfly all-reduce with the mean, no verification.

Defences that run the secure round get one column per validator count in
`validators` (btard_1_v1, btard_1_v2, ...). The delayed-gradient attackers
replay their gradient from `attack_start` steps earlier: the paper delays by
1000 steps and attacks from step s = 1000, so at step s + t it sends the
gradient of step t; we keep that ratio.

Writes results.csv (one row per cell and seed: accuracy, steps from attack
start until every Byzantine is banned, honest peers banned by ELIMINATE
alongside a Byzantine, honest peers banned otherwise), table.md (attack x
column, accuracy averaged over seeds, and the ban times), heatmap.png and
curves.png (test accuracy vs step per attack, averaged over seeds). A cell
whose directory already holds a finished run of the same configuration is
read back, not rerun, so an interrupted bench continues where it stopped;
with read_only=true it runs nothing and tabulates the finished cells.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError
from ..runs.config import override
from ..runs.dp.config import RunConfig
from ..runs.dp.simulate import simulate
from ..runs.presets import get_preset
from .common import bench_config

ATTACKS: dict[str, list[str]] = {
    "none": ["byzantine.attack=none"],
    "sign_flip": ["byzantine.attack=sign_flip"],
    "random_direction": ["byzantine.attack=random_direction"],
    "delayed_gradient": ["byzantine.attack=delayed_gradient"],  # delay = attack_start, set in cell_config
    "label_flip": ["byzantine.attack=label_flip", "byzantine.params.num_classes=10"],
    "ipm_0.1": ["byzantine.attack=ipm", "byzantine.params.epsilon=0.1"],
    "ipm_0.6": ["byzantine.attack=ipm", "byzantine.params.epsilon=0.6"],
    "alie": ["byzantine.attack=alie"],
    "agg_shift": ["byzantine.attack=agg_shift"],
    "lie_norms": ["byzantine.attack=lie_norms"],
    "slander": ["byzantine.attack=slander"],
    "wrong_hash": ["byzantine.attack=wrong_hash"],
}
FIGURE3_ATTACKS = ("none", "sign_flip", "random_direction", "delayed_gradient", "label_flip", "ipm_0.1", "ipm_0.6", "alie")
PROTOCOL_ONLY = ("agg_shift", "lie_norms", "slander", "wrong_hash")  # need the secure round to exist

_SERVER = ["btard.enabled=false", "allreduce.topology=server"]
DEFENSES: dict[str, list[str]] = {
    "btard_1": ["btard.enabled=true", "allreduce.reducer=centered_clip", "allreduce.tau=1"],
    "btard_10": ["btard.enabled=true", "allreduce.reducer=centered_clip", "allreduce.tau=10"],
    "mean_nobans": ["btard.enabled=true", "allreduce.reducer=mean", "btard.bans=false"],
    "server_cclip_1": [*_SERVER, "allreduce.reducer=centered_clip", "allreduce.tau=1"],
    "server_geomed": [*_SERVER, "allreduce.reducer=geometric_median"],
    "server_coordmed": [*_SERVER, "allreduce.reducer=median"],
    "no_defense": ["btard.enabled=false", "allreduce.reducer=mean"],
}
SECURE = ("btard_1", "btard_10", "mean_nobans")  # run the secure round: one column per validator count
FIGURE3_DEFENSES = ("btard_1", "btard_10", "server_cclip_1", "server_geomed", "server_coordmed", "no_defense")


@dataclass(frozen=True)
class BTARDBenchConfig:
    peers: int = 16
    byzantine: int = 7
    validators: str = "1,2"  # validator counts of the secure-round defences, one column each
    steps: int = 150
    attack_start: int = 30
    eval_every: int = 5
    seed: int = 0
    seeds: int = 1  # runs seeds seed, seed + 1, ..., seed + seeds - 1
    attacks: str = ",".join(FIGURE3_ATTACKS)
    defenses: str = ",".join(FIGURE3_DEFENSES)
    jobs: int = 0  # parallel processes (0: one per core)
    read_only: bool = False  # run nothing: tables of the finished cells only (an interrupted bench)

    def __post_init__(self) -> None:
        for key in ("peers", "steps", "eval_every", "seeds"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if not 0 <= self.byzantine < self.peers - 1:
            raise ConfigError(f"byzantine={self.byzantine} must leave two honest evaluating peers of peers={self.peers}")
        if self.attack_start < 0 or self.jobs < 0:
            raise ConfigError("attack_start and jobs must be >= 0")
        for key, table in (("attacks", ATTACKS), ("defenses", DEFENSES)):
            for label in getattr(self, key).split(","):
                if label not in table:
                    raise ConfigError(f"{key} has unknown entry {label!r}; allowed: {', '.join(table)}")
        counts = self.validators.split(",")
        if not all(c.isdigit() for c in counts):
            raise ConfigError(f"validators={self.validators!r} must be comma-separated counts >= 0, e.g. 1,2")

    def columns(self) -> list[tuple[str, str, int]]:
        """(column label, defence, validator count) of every column of the figure."""
        counts = [int(c) for c in self.validators.split(",")]
        columns = []
        for defense in self.defenses.split(","):
            if defense in SECURE:
                columns += [(f"{defense}_v{k}", defense, k) for k in counts]
            else:
                columns.append((defense, defense, counts[0]))
        return columns


def quick() -> BTARDBenchConfig:
    """A few minutes on 2 cores: 8 peers (3 Byzantine), a few attacks, 2 validators."""
    return BTARDBenchConfig(
        peers=8, byzantine=3, validators="2", steps=60, attack_start=20,
        attacks="none,sign_flip,ipm_0.1,alie,agg_shift", defenses="btard_1,server_cclip_1,no_defense",
    )


def full() -> BTARDBenchConfig:
    """BTARD's Figure 3 scaled down: 16 peers, 7 Byzantine, 150 steps, 3 seeds, 1 and 2 validators."""
    return BTARDBenchConfig(seeds=3)


PRESETS = {"quick": quick, "full": full}


def cell_config(config: BTARDBenchConfig, attack: str, defense: str, validators: int, seed: int) -> RunConfig:
    """The simulated run of one cell."""
    delay = [f"byzantine.params.delay={config.attack_start}"] if attack == "delayed_gradient" else []
    return override(
        get_preset("btard-digits"),
        [
            f"peers={config.peers}", f"steps={config.steps}", f"seed={seed}",
            f"byzantine.count={config.byzantine if attack != 'none' else 0}", f"byzantine.start_step={config.attack_start}",
            f"btard.validators={validators}", f"train.eval_every={config.eval_every}",
            *ATTACKS[attack], *delay, *DEFENSES[defense],
        ],
    )


def _finished(cell: Path, run: RunConfig) -> bool:
    """Whether `cell` holds a finished run of exactly `run` (then it is read back, not rerun)."""
    try:
        return (cell / "summary.json").exists() and RunConfig.from_dict(json.loads((cell / "config.json").read_text())) == run
    except (ConfigError, ValueError, TypeError):
        return False


def run_cell(config: BTARDBenchConfig, attack: str, column: tuple[str, str, int], seed: int, out: Path) -> dict:
    """One simulated run (or its finished directory); returns its row of results.csv."""
    label, defense, validators = column
    row = {"attack": attack, "defense": label, "validators": validators if defense in SECURE else "", "seed": seed}
    if attack in PROTOCOL_ONLY and defense not in SECURE:
        return {**row, "accuracy": float("nan"), "note": "protocol attack: needs the secure round"}
    run = cell_config(config, attack, defense, validators, seed)
    cell = out / "cells" / f"{attack}-{label}-s{seed}"
    if not _finished(cell, run):
        if config.read_only:
            return {**row, "accuracy": float("nan"), "note": "not run"}
        simulate(run, cell, progress=False)
    return {**row, **cell_row(config, cell)}


def cell_row(config: BTARDBenchConfig, cell: Path) -> dict:
    """The measured columns of a finished cell directory (summary.json, bans.jsonl)."""
    summary = json.loads((cell / "summary.json").read_text())
    bans = [json.loads(line) for line in (cell / "bans.jsonl").read_text().splitlines()] if (cell / "bans.jsonl").exists() else []
    byzantine = set(summary["byzantine"])
    ban_step = {b["peer"]: b["step"] for b in bans}
    all_banned = byzantine and byzantine <= set(ban_step)
    honest = [b for b in bans if b["peer"] not in byzantine]
    return {
        "accuracy": summary["final_accuracy"] if summary["final_accuracy"] is not None else float("nan"),
        "byzantine_banned": len(byzantine & set(ban_step)),
        "steps_to_ban_all": max(ban_step[p] for p in byzantine) - config.attack_start + 1 if all_banned else "",
        "honest_banned_by_eliminate": sum(1 for b in honest if b["reason"] == "eliminator"),
        "honest_banned_other": sum(1 for b in honest if b["reason"] != "eliminator"),
        "wall_seconds": round(summary["wall_seconds"], 1),
        "note": "",
    }


FIELDS = ["attack", "defense", "validators", "seed", "accuracy", "byzantine_banned", "steps_to_ban_all",
          "honest_banned_by_eliminate", "honest_banned_other", "wall_seconds", "note"]


def run_bench(config: BTARDBenchConfig, out: Path) -> list[dict]:
    seeds = range(config.seed, config.seed + config.seeds)
    cells = [(a, c, s) for s in seeds for a in config.attacks.split(",") for c in config.columns()]
    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        rows = [run_cell(config, a, c, s, out) for a, c, s in cells]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(run_cell, [config] * len(cells), *zip(*cells), [out] * len(cells)))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in FIELDS})
    (out / "table.md").write_text(format_table(config, rows) + "\n")
    _draw(config, rows, out)
    return rows


def _by_cell(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    cells: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["attack"], row["defense"]), []).append(row)
    return cells


def _mean_accuracy(rows: list[dict]) -> float:
    values = [r["accuracy"] for r in rows if r["accuracy"] == r["accuracy"]]
    return statistics.fmean(values) if values else float("nan")


def _accuracy_text(rows: list[dict]) -> str:
    values = [r["accuracy"] for r in rows if r["accuracy"] == r["accuracy"]]
    if not values:
        return "not run" if rows and all(r["note"] == "not run" for r in rows) else "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def _ban_text(rows: list[dict], byzantine: int) -> str:
    """Steps from the attack start until every Byzantine is banned (worst seed), and honest bans."""
    rows = [r for r in rows if r["note"] != "not run"]
    if not rows or any(r.get("byzantine_banned", "") == "" for r in rows):
        return "not run" if not rows else "n/a"
    steps = [r["steps_to_ban_all"] for r in rows]
    banned = ", ".join(str(r["byzantine_banned"]) for r in rows)
    text = str(max(steps)) if all(s != "" for s in steps) else f"not all ({banned} of {byzantine} banned)"
    honest = sum(r["honest_banned_by_eliminate"] + r["honest_banned_other"] for r in rows)
    return text + (f", {honest} honest" if honest else "")


def format_table(config: BTARDBenchConfig, rows: list[dict]) -> str:
    """Final accuracy (mean over seeds, min-max in brackets), then ban times of the secure-round columns."""
    cells = _by_cell(rows)
    attacks = config.attacks.split(",")
    labels = [label for label, _, _ in config.columns()]
    secure = [label for label, defense, _ in config.columns() if defense in SECURE]
    seeds = ", ".join(str(s) for s in range(config.seed, config.seed + config.seeds))
    lines = [f"Final test accuracy at step {config.steps} ({config.byzantine} of {config.peers} Byzantine from step {config.attack_start}; seeds {seeds})", ""]
    lines += ["| attack | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    lines += [f"| {a} | " + " | ".join(_accuracy_text(cells.get((a, c), [])) for c in labels) + " |" for a in attacks]
    if secure:
        lines += ["", "Steps from the attack start until every Byzantine is banned (worst seed; honest peers banned, summed over seeds)", ""]
        lines += ["| attack | " + " | ".join(secure) + " |", "|---" * (len(secure) + 1) + "|"]
        lines += [f"| {a} | " + " | ".join(_ban_text(cells.get((a, c), []), config.byzantine) for c in secure) + " |" for a in attacks if a != "none"]
    return "\n".join(lines)


def _accuracy_curve(cells: list[Path]) -> tuple[list[int], list[float]]:
    """Test accuracy vs step, averaged over the cells (seeds) that evaluated at that step."""
    by_step: dict[int, list[float]] = {}
    for cell in cells:
        metrics = cell / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                point = json.loads(line)
                if "test_accuracy" in point:
                    by_step.setdefault(point["step"], []).append(point["test_accuracy"])
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def _draw(config: BTARDBenchConfig, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks, labels = config.attacks.split(","), [label for label, _, _ in config.columns()]
    cells = _by_cell(rows)
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 2, 0.5 * len(attacks) + 2))
    grid = [[_mean_accuracy(cells.get((a, c), [])) for c in labels] for a in attacks]
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(attacks)), attacks)
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            text = "n/a" if value != value else f"{value:.2f}"
            ax.text(j, i, text, ha="center", va="center", color="k" if value == value and value > 0.6 else "w", fontsize=7)
    ax.set_title(f"final accuracy, {config.byzantine} of {config.peers} Byzantine from step {config.attack_start}, {config.seeds} seed(s)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "heatmap.png", dpi=90)
    plt.close(fig)

    seeds = range(config.seed, config.seed + config.seeds)
    defenses, counts = config.defenses.split(","), [int(c) for c in config.validators.split(",")]
    width = min(4, len(attacks))
    height = -(-len(attacks) // width)
    fig, axes = plt.subplots(height, width, figsize=(3.6 * width, 2.8 * height + 0.8), squeeze=False, sharey=True)
    for k, attack in enumerate(attacks):
        ax = axes[k // width][k % width]
        for label, defense, validators in config.columns():
            steps, accuracy = _accuracy_curve([out / "cells" / f"{attack}-{label}-s{s}" for s in seeds])
            if steps:  # one colour per defence; the secure round's validator counts differ in line style
                style = ("-", "--", ":", "-.")[counts.index(validators) % 4] if defense in SECURE else "-"
                ax.plot(steps, accuracy, label=label, lw=1.2, ls=style, color=f"C{defenses.index(defense) % 10}")
        ax.axvline(config.attack_start, color="k", ls=":", lw=0.8, alpha=0.5)
        ax.set(title=f"attack: {attack}", xlabel="step", ylim=(0, 1))
        if k % width == 0:
            ax.set_ylabel("test accuracy")
    for k in range(len(attacks), width * height):
        axes[k // width][k % width].axis("off")
    legend = {}  # every column that has a curve in some panel, once
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 6) or 1, fontsize=8)
    fig.suptitle(f"{config.byzantine} of {config.peers} peers Byzantine from step {config.attack_start} (dotted); mean of {config.seeds} seed(s)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(out / "curves.png", dpi=70)
    plt.close(fig)


def run_cli(args: argparse.Namespace) -> int:
    config, out = bench_config(args, "btard", PRESETS)
    rows = run_bench(config, out)
    print(format_table(config, rows))
    print(f"wrote {out / 'results.csv'}, {out / 'table.md'}, {out / 'heatmap.png'} and {out / 'curves.png'}")
    return 0
