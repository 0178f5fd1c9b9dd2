"""`phalanx bench robustness`: aggregators x attacks with a trusted server.

Re-creates the baselines of BTARD's Figure 3 on the digits task: n workers, f
of them Byzantine, a trusted server that aggregates their vectors with one
rule and steps the model. Every cell of the grid (attack x aggregator, plus
the no-attack reference of each aggregator) is one training run; the result
is `results.csv` and a heatmap of final test accuracy.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..algorithms.robust.aggregators import make_aggregator, rule_parameters
from ..algorithms.robust.attacks import AttackSchedule, AttackView, make_attack
from ..core.errors import ConfigError
from ..training.task import TASKS, compute_gradient, make_task, set_flat_grad
from .common import bench_config

# label -> (attack registry name, parameters); "none" is the no-attack reference.
ATTACKS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "sign_flip": ("sign_flip", {}),
    "random_direction": ("random_direction", {}),
    "label_flip": ("label_flip", {"num_classes": 10}),
    "delayed_gradient": ("delayed_gradient", {}),
    "ipm_0.1": ("ipm", {"epsilon": 0.1}),
    "ipm_0.6": ("ipm", {"epsilon": 0.6}),
    "alie": ("alie", {}),
    "min_max": ("min_max", {}),
    "min_sum": ("min_sum", {}),
}

# label -> (rule, its parameters besides those of (n, f), which `rule_parameters` gives unclamped: a cell
# whose (n, f) the rule cannot take is reported, not weakened).
AGGREGATORS: dict[str, tuple[str, dict]] = {
    "mean": ("mean", {}),
    "centered_clip_1": ("centered_clip", {"tau": 1.0}),
    "centered_clip_10": ("centered_clip", {"tau": 10.0}),
    "median": ("median", {}),
    "geometric_median": ("geometric_median", {}),
    "trimmed_mean": ("trimmed_mean", {}),
    "krum": ("krum", {}),
    "multi_krum": ("multi_krum", {}),
    "bulyan": ("bulyan", {}),
    "nnm_centered_clip_1": ("centered_clip", {"tau": 1.0, "pre": "nnm"}),
}


def aggregator_arguments(label: str, n: int, f: int) -> tuple[str, dict]:
    """make_aggregator's name and keyword arguments for an AGGREGATORS label, n workers and f Byzantines."""
    name, extra = AGGREGATORS[label]
    params = {**rule_parameters(name, n, f, clamp=False), **extra}
    if extra.get("pre") == "nnm":
        params["f"] = f
    return name, params


@dataclass(frozen=True)
class RobustnessConfig:
    workers: int = 16
    byzantine: int = 7
    steps: int = 300
    attack_start: int = 100  # Byzantines behave honestly before this step (BTARD: s = 1000 of 25k)
    batch_size: int = 8  # per worker, as in BTARD Sec. 4.1; tau = 1 then clips about half the honest vectors
    lr: float = 0.05
    momentum: float = 0.9
    task: str = "digits-mlp"
    seed: int = 0
    attacks: str = ",".join(ATTACKS)  # comma-separated labels
    aggregators: str = ",".join(AGGREGATORS)
    jobs: int = 0  # parallel processes (0: one per core)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task={self.task!r} is not known; allowed: {', '.join(TASKS)}")
        for key in ("workers", "steps", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if self.attack_start < 0 or self.jobs < 0:
            raise ConfigError(f"attack_start={self.attack_start} and jobs={self.jobs} must be >= 0 (jobs=0: one per core)")
        if not 0 < self.lr < float("inf"):
            raise ConfigError(f"lr={self.lr} must be a finite number > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum} must be in [0, 1)")
        if not 0 <= self.byzantine < self.workers:
            raise ConfigError(f"byzantine={self.byzantine} must be in [0, workers={self.workers})")
        for key, table in (("attacks", ATTACKS), ("aggregators", AGGREGATORS)):
            for label in getattr(self, key).split(","):
                if label not in table:
                    raise ConfigError(f"{key} has unknown entry {label!r}; allowed: {', '.join(table)}")

    def attack_list(self) -> list[str]:
        return self.attacks.split(",")

    def aggregator_list(self) -> list[str]:
        return self.aggregators.split(",")


def quick() -> RobustnessConfig:
    """A few minutes on 2 cores: the main attacks against the main rules."""
    return RobustnessConfig(
        attacks="none,sign_flip,random_direction,label_flip,ipm_0.6,alie",
        aggregators="mean,centered_clip_1,median,geometric_median,trimmed_mean,nnm_centered_clip_1",
    )


def full() -> RobustnessConfig:
    """The whole grid, trained twice as long."""
    return RobustnessConfig(steps=600)


PRESETS = {"quick": quick, "full": full}


def run_cell(config: RobustnessConfig, attack_label: str, aggregator_label: str) -> dict:
    """Train once with one attack and one aggregation rule; return the final accuracy."""
    torch.set_num_threads(1)
    n, f = config.workers, config.byzantine if attack_label != "none" else 0
    name, params = aggregator_arguments(aggregator_label, n, config.byzantine)
    try:
        aggregate = make_aggregator(name, **params)
        aggregate(torch.zeros(n, 2))  # let the rule reject (n, f) before training
    except ValueError as exc:
        return {"attack": attack_label, "aggregator": aggregator_label, "accuracy": float("nan"), "note": str(exc)}
    task = make_task(config.task)
    model = task.build_model(config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    attack_name, attack_params = ATTACKS[attack_label]
    schedule = AttackSchedule(start_step=config.attack_start)
    attackers = [make_attack(attack_name, schedule, **attack_params) for _ in range(f)] if f else []
    started = time.perf_counter()
    for step in range(config.steps):
        honest = []
        for worker in range(n - f):
            x, y = task.batch(config.seed, f"worker-{worker}", step, config.batch_size)
            honest.append(compute_gradient(task, model, x, y)[0])
        honest_stack = torch.stack(honest)
        sent = list(honest)
        for k, attack in enumerate(attackers):
            x, y = task.batch(config.seed, f"worker-{n - f + k}", step, config.batch_size)
            own = compute_gradient(task, model, x, y)[0]
            view = AttackView(
                step=step,
                own_gradient=own,
                honest_gradients=honest_stack if attack.omniscient else None,
                n=n,
                f=f,
                seed=config.seed,
                peer_index=n - f + k,
                recompute_gradient=lambda label_map, x=x, y=y: compute_gradient(task, model, x, y, label_map)[0],
            )
            sent.append(attack(view))
        set_flat_grad(model, aggregate(torch.stack(sent)))
        optimizer.step()
    result = task.evaluate(model)
    return {
        "attack": attack_label,
        "aggregator": aggregator_label,
        "accuracy": result["accuracy"],
        "loss": result["loss"],
        "seconds": time.perf_counter() - started,
        "note": "",
    }


def run_grid(config: RobustnessConfig, out: Path) -> list[dict]:
    """Run every (attack, aggregator) cell, write results.csv and heatmap.png into `out`."""
    cells = [(a, g) for a in config.attack_list() for g in config.aggregator_list()]
    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        rows = [run_cell(config, a, g) for a, g in cells]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(run_cell, [config] * len(cells), *zip(*cells)))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["attack", "aggregator", "accuracy", "loss", "seconds", "note"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in writer.fieldnames})
    draw_heatmap(config, rows, out / "heatmap.png")
    return rows


def draw_heatmap(config: RobustnessConfig, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks, aggregators = config.attack_list(), config.aggregator_list()
    grid = torch.full((len(attacks), len(aggregators)), float("nan"))
    for row in rows:
        grid[attacks.index(row["attack"]), aggregators.index(row["aggregator"])] = row["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(aggregators) + 2, 0.6 * len(attacks) + 2))
    image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(aggregators)), aggregators, rotation=45, ha="right")
    ax.set_yticks(range(len(attacks)), attacks)
    for i in range(len(attacks)):
        for j in range(len(aggregators)):
            value = float(grid[i, j])
            if value != value:  # the rule refused this (n, f)
                ax.text(j, i, "n/a", ha="center", va="center", color="gray", fontsize=8)
            else:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="k" if value > 0.6 else "w", fontsize=8)
    ax.set_title(f"final test accuracy, {config.byzantine} of {config.workers} Byzantine, {config.steps} steps")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(config: RobustnessConfig, rows: list[dict]) -> str:
    aggregators = config.aggregator_list()
    lookup = {(r["attack"], r["aggregator"]): r["accuracy"] for r in rows}
    lines = ["| attack | " + " | ".join(aggregators) + " |", "|---" * (len(aggregators) + 1) + "|"]
    for attack in config.attack_list():
        cells = [lookup[(attack, g)] for g in aggregators]
        lines.append(f"| {attack} | " + " | ".join("n/a" if c != c else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    config, out = bench_config(args, "robustness", PRESETS)
    rows = run_grid(config, out)
    print(format_table(config, rows))
    print(f"wrote {out / 'results.csv'} and {out / 'heatmap.png'}")
    return 0


