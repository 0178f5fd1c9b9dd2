"""`phalanx bench gwtf --preset table2`: GWTF's Table II (crash-prone relays) re-run in the simulator.

Every cell {homogeneous capacity 4, heterogeneous 1-3} x {0, 10, 20% join-leave
chance} runs the `gwtf-table2` preset under SWARM and GWTF routing for each
seed. Per run, as the paper defines them (Sec. VI):
- time per microbatch: the iterations' total time (slowest data node) over the
  microbatches finished;
- throughput: microbatches finished per iteration;
- communication time: per finished microbatch, its end-to-end seconds minus
  the compute seconds on its path (transfers, queueing and waiting);
- wasted compute: compute seconds on microbatch attempts or nodes that are not
  on a finished path (restarted, repaired-away or deferred work).
Writes table2_runs.csv (one row per run), table2.csv (mean and std per cell
and policy) and table2.png into the output directory; prints the table.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..core.errors import ConfigError  # noqa: E402
from ..runs.config import override  # noqa: E402
from ..runs.pipeline.config import ChurnConfig, PipelineRunConfig  # noqa: E402
from ..runs.pipeline.presets import gwtf_table2  # noqa: E402
from ..runs.pipeline.run import simulate_pipeline  # noqa: E402
from .common import CsvRows

METRICS = ("time_per_microbatch", "throughput", "communication", "wasted_compute")


@dataclass(frozen=True)
class Table2Config:
    seeds: int = 10
    steps: int = 5  # iterations per run
    churn: str = "0,0.1,0.2"  # join-leave chances per relay and iteration
    settings: str = "homogeneous,heterogeneous"
    policies: str = "swarm,gwtf"

    def __post_init__(self) -> None:
        if self.seeds < 1 or self.steps < 1:
            raise ConfigError(f"seeds={self.seeds} and steps={self.steps} must be >= 1")
        probabilities("churn", self.churn)
        if not set(self.settings.split(",")) <= {"homogeneous", "heterogeneous"}:
            raise ConfigError(f"settings={self.settings!r}: allowed homogeneous, heterogeneous")
        if not set(self.policies.split(",")) <= {"swarm", "gwtf"}:
            raise ConfigError(f"policies={self.policies!r}: allowed swarm, gwtf")


def probabilities(key: str, text: str) -> list[float]:
    """A bench option of comma-separated probabilities ("0,0.1,0.2"), or a ConfigError naming `key`."""
    try:
        values = [float(c) for c in text.split(",")]
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be comma-separated probabilities, e.g. 0,0.1,0.2") from None
    if not all(0 <= v <= 1 for v in values):
        raise ConfigError(f"{key}={text!r} must hold probabilities in [0, 1]")
    return values


def cell_config(setting: str, churn: float, policy: str, seed: int, steps: int,
                preset: Callable[[], PipelineRunConfig] = gwtf_table2) -> PipelineRunConfig:
    """`preset` for one Table II cell: capacities (heterogeneous: 1-3), join-leave chance, routing, seed."""
    config = preset()
    return replace(
        config, seed=seed, steps=steps, pipeline=replace(config.pipeline, routing=policy),
        faults=ChurnConfig(leave_rate=churn, join_rate=churn),
        **({"capacity_min": 1, "capacity_max": 3} if setting == "heterogeneous" else {}),
    )


def run_one(setting: str, churn: float, policy: str, seed: int, steps: int) -> dict:
    """One simulated run of the gwtf-table2 preset; the four Table II metrics."""
    summary = simulate_pipeline(cell_config(setting, churn, policy, seed, steps), None, progress=False)
    return {"setting": setting, "churn": churn, "policy": policy, "seed": seed, **table2_metrics(summary)}


def table2_metrics(summary: dict) -> dict:
    """The four Table II metrics of a simulated run's summary (and its wall seconds)."""
    metrics = summary["metrics"]
    finished = [mb for mb in summary["microbatches"] if mb["outcome"] == "ok"]
    compute: dict[tuple, float] = {}
    for e in summary["events"]:
        if e["kind"] in ("fwd", "bwd"):
            key = (e["src"], e["seq"], e["att"], e["peer"])
            compute[key] = compute.get(key, 0.0) + e["t1"] - e["t0"]
    comm = [
        (mb["t_end"] - mb["t_start"]) - sum(compute.get((mb["src"], mb["seq"], mb["att"], p), 0.0) for p in mb["path"])
        for mb in finished
    ]
    total_time = sum(m["duration"] for m in metrics)
    return {
        "time_per_microbatch": total_time / max(1, len(finished)),
        "throughput": len(finished) / len(metrics),
        "communication": statistics.fmean(comm) if comm else float("nan"),
        "wasted_compute": summary["wasted_compute_seconds"],
        "wall_seconds": summary["wall_seconds"],
    }


def summarize(rows: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["setting"], row["churn"], row["policy"]), []).append(row)
    out = []
    for (setting, churn, policy), runs in sorted(cells.items()):
        entry = {"setting": setting, "churn": churn, "policy": policy, "runs": len(runs)}
        for metric in METRICS:
            values = [r[metric] for r in runs if r[metric] == r[metric]]
            entry[metric] = statistics.fmean(values) if values else float("nan")
            entry[metric + "_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        out.append(entry)
    return out


def format_table(summary: list[dict]) -> str:
    lines = [f"{'setting':14s} {'churn':>5s} {'policy':6s} {'runs':>4s} "
             + " ".join(f"{m:>22s}" for m in METRICS)]
    for e in summary:
        cells = " ".join(f"{e[m]:>12.3f} ± {e[m + '_std']:<7.3f}" for m in METRICS)
        lines.append(f"{e['setting']:14s} {e['churn']:>5.2f} {e['policy']:6s} {e['runs']:>4d} {cells}")
    return "\n".join(lines)


def draw(summary: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    cells = sorted({(e["setting"][:6], e["churn"]) for e in summary})
    for ax, metric in zip(axes, METRICS):
        for offset, policy in ((-0.2, "swarm"), (0.2, "gwtf")):
            entries = {(e["setting"][:6], e["churn"]): e for e in summary if e["policy"] == policy}
            xs = [i + offset for i, c in enumerate(cells) if c in entries]
            ys = [entries[c][metric] for c in cells if c in entries]
            es = [entries[c][metric + "_std"] for c in cells if c in entries]
            ax.bar(xs, ys, 0.4, yerr=es, label=policy, capsize=2)
        ax.set_xticks(range(len(cells)), [f"{s}\n{int(c * 100)}%" for s, c in cells], fontsize=7)
        ax.set_title(metric.replace("_", " "))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_cli(args: argparse.Namespace) -> int:
    config = override(Table2Config(), args.set or [])
    out = Path(args.out) if args.out else Path("runs") / "bench-gwtf-table2"
    out.mkdir(parents=True, exist_ok=True)
    rates = probabilities("churn", config.churn)
    rows: list[dict] = []
    start = time.perf_counter()
    with open(out / "table2_runs.csv", "w", newline="") as f:
        runs = CsvRows(f)
        for seed in range(config.seeds):  # seeds outermost: a cut-short run still covers every cell
            for setting in config.settings.split(","):
                for churn in rates:
                    for policy in config.policies.split(","):
                        row = run_one(setting, churn, policy, seed, config.steps)
                        rows.append(row)
                        runs.write(row)
                        print(f"[{time.perf_counter() - start:7.0f}s] {setting} churn={churn} {policy} seed={seed}: "
                              f"{row['time_per_microbatch']:.2f} s/microbatch, {row['throughput']:.2f} per iteration",
                              flush=True)
    summary = summarize(rows)
    with open(out / "table2.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    draw(summary, out / "table2.png")
    print(format_table(summary))
    return 0
