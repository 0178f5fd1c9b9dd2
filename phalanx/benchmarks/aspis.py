"""`phalanx bench aspis`: distortion fractions, accuracy, detection time, coordinator cost.

1. Distortion fraction epsilon for K=15, r=3, q=2..7 (Table III of the Aspis
   paper): every entry is counted by running the real assignment, attack
   orchestration, agreement graph, detection and Alg. 2 on stand-in copies.
2. Accuracy on digits: Aspis (ATT-2) and Aspis+ (ATT-3) against no redundancy
   (median, Multi-Krum, Bulyan) and DETOX, each a full simulated run over the
   transport; also iterations until every Byzantine of a window is flagged.
3. Detection time against K (r=3): agreement graph, then clique search with and
   without the (K-q-1)-core degree pre-filter.
4. Coordinator time per iteration: Aspis against no redundancy, same K and the
   same samples per worker.
Figures are printed and written as CSV (and a PNG of the curves) under `out`.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import networkx as nx
import numpy as np

from ..algorithms.aspis.attacks import (
    Orchestration,
    detox_optimal_byzantine,
    distortion_fraction,
    symbolic_copies,
)
from ..algorithms.aspis.designs import (
    Assignment,
    group_assignment,
    single_assignment,
    subset_assignment,
)
from ..algorithms.aspis.detection import (
    Detection,
    aggregate,
    agreement_graph,
    agreement_matrix,
    detect_clique,
    disagreements,
    file_labels,
    shared_counts,
)
from ..algorithms.robust.aggregators import coordinate_median
from ..core.errors import ConfigError
from ..runs.aspis.config import AspisAttackConfig, AspisRunConfig
from ..runs.aspis.run import simulate_aspis
from ..runtime.aspis.roles import AspisConfig
from ..runtime.dp.peer import TrainConfig
from .common import bench_config

# Table III of the Aspis paper, K = 15, r = 3, q = 2..7.
PAPER_TABLE_III = {
    "aspis_att2": [0.004, 0.022, 0.062, 0.132, 0.242, 0.4],
    "baseline": [0.133, 0.2, 0.267, 0.333, 0.4, 0.467],
    "detox_optimal": [0.2, 0.2, 0.4, 0.4, 0.6, 0.6],
    "aspis_att1": [0.0, 0.002, 0.009, 0.022, 0.044, 0.077],
    "detox_weak": [0.0, 0.0, 0.0, 0.0, 0.2, 0.4],
}


@dataclass(frozen=True)
class AspisBenchConfig:
    workers: int = 15
    r: int = 3
    steps: int = 100
    qs: str = "2,4"  # Byzantine counts of the accuracy runs
    distortions: str = "alie,reversed"  # of the Aspis (ATT-2) accuracy runs; Aspis+ runs use the first
    schemes: str = "aspis,aspis+,median,multi_krum,bulyan,detox"
    lr: float = 0.2  # one SGD (momentum 0.9) rate for every scheme
    detection_ks: str = "15,31,63,100"
    detection_repeats: int = 20
    timing_steps: int = 5
    seed: int = 0
    jobs: int = 0  # parallel processes for the accuracy runs (0: one per core)

    def __post_init__(self) -> None:
        if self.workers < 3 or self.steps < 1 or self.detection_repeats < 1 or self.timing_steps < 1:
            raise ConfigError("workers must be >= 3 and steps, detection_repeats, timing_steps >= 1")
        for name in self.scheme_list():
            if name not in SCHEMES:
                raise ConfigError(f"schemes has unknown entry {name!r}; allowed: {', '.join(SCHEMES)}")
        if not self.q_list() or any(2 * q >= self.workers for q in self.q_list()):
            raise ConfigError(f"qs={self.qs!r} must list Byzantine counts below K/2 = {self.workers / 2}")
        if self.jobs < 0:
            raise ConfigError("jobs must be >= 0 (0: one per core)")

    def q_list(self) -> list[int]:
        return [int(x) for x in self.qs.split(",") if x]

    def scheme_list(self) -> list[str]:
        return [x for x in self.schemes.split(",") if x]

    def distortion_list(self) -> list[str]:
        return [x for x in self.distortions.split(",") if x]

    def k_list(self) -> list[int]:
        return [int(x) for x in self.detection_ks.split(",") if x]


# label -> (scheme, aggregator, samples per file); batch sizes follow the paper's Sec. IX-B for K = 15.
SCHEMES: dict[str, tuple[str, str, int]] = {
    "aspis": ("aspis", "median", 8),  # 455 files x 8 = 3640 samples (the paper: 3 or 32 per file)
    "aspis+": ("aspis+", "median", 22),  # 35 files x 22 = 770 samples
    "median": ("none", "median", 32),  # 15 x 32 = 480 samples
    "multi_krum": ("none", "multi_krum", 32),
    "bulyan": ("none", "bulyan", 32),
    "detox": ("detox", "median_of_means", 96),  # 5 groups x 96 = 480 samples
}


def quick() -> AspisBenchConfig:
    """A smoke test: a few iterations, q = 2, three schemes, small K for detection time."""
    return AspisBenchConfig(
        steps=6, qs="2", distortions="alie", schemes="aspis,aspis+,median", detection_ks="15,31", detection_repeats=3, timing_steps=2
    )


def full() -> AspisBenchConfig:
    return AspisBenchConfig()


PRESETS = {"quick": quick, "full": full}


# --- 1. distortion fraction ---------------------------------------------------


def _epsilon(assignment: Assignment, plan: Orchestration, detect: bool, q: int) -> float:
    copies = symbolic_copies(assignment, plan, 0)
    labels = [file_labels(c) for c in copies]
    if detect:
        detection = detect_clique(agreement_graph(shared_counts(assignment), disagreements(assignment, labels)), q)
    else:
        detection = Detection(None, frozenset())
    return distortion_fraction(assignment, copies, aggregate(assignment, copies, labels, detection, coordinate_median).chosen)


def _spread(workers: int, r: int, q: int) -> frozenset[int]:
    """The paper's weak choice against DETOX: the i-th Byzantine goes to group i mod K/r."""
    groups = workers // r
    return frozenset((i % groups) * r + i // groups for i in range(q))


def distortion_table(k: int, r: int, qs: list[int]) -> list[dict]:
    rows = []
    aspis = subset_assignment(k, r)
    for q in qs:
        byzantine = frozenset(range(q))
        targets = frozenset(range(q, 2 * q))
        row = {
            "q": q,
            "aspis_att2": _epsilon(aspis, Orchestration("att2", k, q, byzantine, targets), True, q),
            "theorem1": math.comb(2 * q, r) / 2 / math.comb(k, r),
            "aspis_att1": _epsilon(aspis, Orchestration("att1", k, q, byzantine), True, q),
            "baseline": _epsilon(single_assignment(k), Orchestration("att1", k, q, byzantine), False, q),
        }
        if k % r == 0:
            groups = group_assignment(k, r)
            row["detox_optimal"] = _epsilon(groups, Orchestration("majority", k, q, detox_optimal_byzantine(k, r, q)), False, q)
            row["detox_weak"] = _epsilon(groups, Orchestration("majority", k, q, _spread(k, r, q)), False, q)
        rows.append(row)
    return rows


# --- 2. accuracy -----------------------------------------------------------------


def run_configs(config: AspisBenchConfig) -> list[tuple[str, AspisRunConfig]]:
    """(label, run config) of every accuracy run."""
    k = config.workers
    runs = []
    first = config.distortion_list()[0]
    for q in config.q_list():
        for label in config.scheme_list():
            scheme, aggregator, per_file = SCHEMES[label]
            if label == "bulyan" and k < 4 * q + 3 or label == "multi_krum" and k <= 2 * q + 2:
                continue
            if scheme == "aspis+" and k % 6 not in (1, 3) or scheme == "detox" and k % config.r:
                continue
            aspis = AspisConfig(scheme=scheme, r=config.r, q=q, window=15, samples_per_file=per_file, aggregator=aggregator)
            base = AspisRunConfig(
                preset=f"bench-{label}",
                peers=k + 1,
                steps=config.steps,
                seed=config.seed,
                aspis=aspis,
                train=TrainConfig(task="digits-mlp", lr=config.lr, eval_every=max(1, config.steps // 10)),
            )
            # Strong setting: ATT-2 on Aspis, the optimal majority choice on DETOX, fixed Byzantines elsewhere.
            strong = {"aspis": "att2", "detox": "majority"}.get(scheme, "att1")
            if scheme != "aspis+":
                for distortion in config.distortion_list():
                    attack = AspisAttackConfig(orchestration=strong, distortion=distortion)
                    runs.append((f"strong/{distortion}/q={q}/{label}", replace(base, attack=attack)))
            # Weak setting (Sec. VII-C): random Byzantines redrawn every 50 iterations, lying where they hold a majority.
            if scheme != "aspis":
                attack = AspisAttackConfig(orchestration="att3", distortion=first, redraw_every=50)
                runs.append((f"att3/{first}/q={q}/{label}", replace(base, attack=attack)))
    return runs


def _run_one(label: str, config: AspisRunConfig) -> dict:
    result = simulate_aspis(config, None, progress=False)
    curve = [(r["step"] + 1, r["test_accuracy"]) for r in result["records"] if "test_accuracy" in r]
    return {
        "run": label,
        "final_accuracy": result["final_accuracy"],
        "mean_distorted_fraction": result["mean_distorted_fraction"],
        "detection_delays": result["detection_delays"],
        "detection_delays_from_window": result["detection_delays_from_window"],
        "wall_seconds": result["wall_seconds"],
        "curve": curve,
    }


def accuracy_runs(config: AspisBenchConfig) -> list[dict]:
    runs = run_configs(config)
    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_run_one(label, c) for label, c in runs]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_run_one, *zip(*runs)))


# --- 3. detection time -------------------------------------------------------------


def detection_times(ks: list[int], r: int, repeats: int, seed: int) -> list[dict]:
    """Milliseconds per iteration to build the agreement graph and to find the cliques (q = floor((K-1)/4))."""
    rows = []
    for k in ks:
        q = (k - 1) // 4
        assignment = subset_assignment(k, r)
        members = np.asarray(assignment.files)
        shared = shared_counts(assignment)
        for kind in ("att1", "att2"):
            byzantine = frozenset(range(q))
            plan = Orchestration(kind, k, q, byzantine, frozenset(range(q, 2 * q)) if kind == "att2" else frozenset())
            lies = np.zeros(len(assignment.files), dtype=bool)
            lies[sorted(plan.distorted_files(0, assignment))] = True
            liar = np.isin(members, sorted(byzantine)) & lies[:, None]
            # Stand-in agreement classes: honest copies class 0, colluders' lies class 1, ATT-1 lies their own class.
            labels = np.where(liar, 1 + (members if kind == "att1" else 0), 0)
            build, prefiltered, plain = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                adjacency = agreement_matrix(shared, disagreements(assignment, labels))
                build.append(time.perf_counter() - start)
                start = time.perf_counter()
                detection = detect_clique(adjacency, q)
                prefiltered.append(time.perf_counter() - start)
                graph = agreement_graph(shared, disagreements(assignment, labels))
                start = time.perf_counter()
                sizes = [len(c) for c in nx.find_cliques(graph)]
                plain.append(time.perf_counter() - start)
            rows.append(
                {
                    "K": k,
                    "q": q,
                    "attack": kind,
                    "files": len(assignment.files),
                    "graph_ms": 1e3 * float(np.median(build)),
                    "cliques_prefilter_ms": 1e3 * float(np.median(prefiltered)),
                    "cliques_plain_ms": 1e3 * float(np.median(plain)),
                    "detected": detection.success,
                    "max_clique": max(sizes),
                }
            )
    return rows


# --- 4. coordinator time -------------------------------------------------------------


def coordinator_times(config: AspisBenchConfig) -> list[dict]:
    """Aspis (r-fold redundant files) against no redundancy, same K, same samples per worker."""
    k, r = config.workers, config.r
    load = math.comb(k - 1, r - 1)  # files per Aspis worker
    rows = []
    for label, scheme, per_file in (("aspis", "aspis", 1), ("none (median)", "none", load)):
        run = AspisRunConfig(
            peers=k + 1,
            steps=config.timing_steps,
            seed=config.seed,
            aspis=AspisConfig(scheme=scheme, r=r, q=2, samples_per_file=per_file),
            attack=AspisAttackConfig(orchestration="att1", distortion="reversed"),
            train=TrainConfig(task="digits-mlp", lr=config.lr, eval_every=config.timing_steps),
        )
        records = simulate_aspis(run, None, progress=False)["records"]
        rows.append(
            {
                "scheme": label,
                "files": records[0]["files"],
                "samples_per_worker": load if scheme == "aspis" else per_file,
                "coordinator_ms": 1e3 * float(np.median([x["coordinator_seconds"] for x in records])),
                "detect_ms": 1e3 * float(np.median([x["detect_seconds"] for x in records])),
                "simulated_iteration_s": float(np.median([x["t_end"] - x["t_start"] for x in records])),
            }
        )
    return rows


# --- output ----------------------------------------------------------------------------


def _table(rows: list[dict], keys: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) >= 0.001 or value == 0 else f"{value:.2e}"
        return str(value)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({r["run"].rsplit("/", 1)[0] for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for r in results:
            if r["run"].rsplit("/", 1)[0] == panel and r["curve"]:
                steps, accuracy = zip(*r["curve"])
                ax.plot(steps, accuracy, label=r["run"].rsplit("/", 1)[1], marker=".")
        ax.set_title(panel)
        ax.set_xlabel("iteration")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bench(config: AspisBenchConfig, out: Path) -> str:
    """Run all four parts, write CSVs and the curves PNG into `out`, return the printed report."""
    out.mkdir(parents=True, exist_ok=True)
    report = []
    epsilon = distortion_table(config.workers, config.r, list(range(2, min(8, (config.workers + 1) // 2))))
    if config.workers == 15 and config.r == 3:
        for row in epsilon:
            for key, values in PAPER_TABLE_III.items():
                if 2 <= row["q"] <= 7:
                    row[f"paper_{key}"] = values[row["q"] - 2]
    _write_csv(out / "epsilon.csv", epsilon)
    keys = ["q", "aspis_att2", "theorem1", "paper_aspis_att2", "baseline", "paper_baseline", "detox_optimal", "paper_detox_optimal",
            "aspis_att1", "paper_aspis_att1", "detox_weak", "paper_detox_weak"]
    report += [f"## distortion fraction epsilon, K={config.workers}, r={config.r} (paper: Table III)", _table(epsilon, [k for k in keys if k in epsilon[0]])]

    results = accuracy_runs(config)
    _write_csv(out / "accuracy.csv", [{k: v for k, v in r.items() if k != "curve"} for r in results])
    _write_csv(out / "curves.csv", [{"run": r["run"], "iteration": s, "accuracy": a} for r in results for s, a in r["curve"]])
    _plot(results, out / "curves.png")
    report += [f"## accuracy on digits after {config.steps} iterations (K={config.workers})",
               _table(results, ["run", "final_accuracy", "mean_distorted_fraction", "detection_delays", "detection_delays_from_window", "wall_seconds"])]

    detection = detection_times(config.k_list(), config.r, config.detection_repeats, config.seed)
    _write_csv(out / "detection.csv", detection)
    report += [f"## detection time per iteration, r={config.r}, q=floor((K-1)/4), median of {config.detection_repeats}",
               _table(detection, ["K", "q", "attack", "files", "graph_ms", "cliques_prefilter_ms", "cliques_plain_ms", "detected", "max_clique"])]

    timing = coordinator_times(config)
    _write_csv(out / "coordinator.csv", timing)
    report += [f"## coordinator time per iteration, K={config.workers}",
               _table(timing, ["scheme", "files", "samples_per_worker", "coordinator_ms", "detect_ms", "simulated_iteration_s"])]
    report.append(f"wrote epsilon.csv, accuracy.csv, curves.csv, curves.png, detection.csv, coordinator.csv in {out}")
    return "\n\n".join(report)


def run_cli(args: argparse.Namespace) -> int:
    config, out = bench_config(args, "aspis", PRESETS)
    print(run_bench(config, out))
    return 0
