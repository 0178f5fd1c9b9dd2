"""`phalanx bench gwtf --preset table2-paper`: GWTF's Table II in the paper's regime (issue 15, item 3).

Every cell {homogeneous capacity 4, heterogeneous 1-3} x {join-leave chance}
runs the `gwtf-table2-paper` preset (see `runs.pipeline.presets.gwtf_table2_paper`
for the paper's numbers and the scaling applied) under each routing policy,
for the same seeds (paired: a seed fixes capacities, link bandwidths and the
churn stream's seed):
- swarm-paper: SWARM as its paper specifies (a new peer for the broken stage,
  refusals not remembered: no memory awareness);
- swarm: the runtime's SWARM variant (a broken backward restarts the
  microbatch; a peer that refused a microbatch is skipped for it);
- gwtf: the flow algorithm.
The metric is the paper's: minutes per microbatch, the iterations' total time
(slowest data node, aggregation included) over the microbatches finished. Per
cell it prints each policy's mean, and per seed pair the GWTF/SWARM ratio: its
median over seeds with a 95% percentile-bootstrap interval of that median,
beside the paper's Table II. Writes table2_paper_runs.csv and
table2_paper.txt into the output directory.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.errors import ConfigError
from ..runs.config import override
from ..runs.pipeline.presets import (
    A4000_FLOPS,
    DEVICE_SHARE,
    PAPER_ACTIVATION_BYTES,
    PAPER_BANDWIDTH,
    PAPER_STAGE_FLOPS,
    WIRE_SCALE,
    gwtf_table2_paper,
)
from ..runs.pipeline.run import simulate_pipeline
from .common import CsvRows
from .gwtf_table2 import cell_config, probabilities, table2_metrics

POLICIES = ("swarm-paper", "swarm", "gwtf")

# GWTF Table II (LLaMa-like model, 25 repetitions): (setting, churn) -> policy -> (min per microbatch, throughput)
PAPER_TABLE2: dict[tuple[str, float], dict[str, tuple[float, float]]] = {
    ("homogeneous", 0.0): {"swarm": (0.53, 8.0), "gwtf": (0.58, 7.16)},
    ("homogeneous", 0.1): {"swarm": (1.26, 4.64), "gwtf": (1.01, 5.8)},
    ("homogeneous", 0.2): {"swarm": (1.76, 6.1), "gwtf": (1.17, 5.72)},
    ("heterogeneous", 0.0): {"swarm": (1.59, 2.96), "gwtf": (1.15, 3.6)},
    ("heterogeneous", 0.1): {"swarm": (4.53, 1.56), "gwtf": (2.45, 2.08)},
    ("heterogeneous", 0.2): {"swarm": (5.36, 1.72), "gwtf": (3.47, 2.12)},
}


@dataclass(frozen=True)
class PaperTable2Config:
    seeds: int = 10
    first_seed: int = 0
    steps: int = 25  # iterations per run (the paper averages 25)
    churn: str = "0,0.1,0.2"  # join-leave chances per relay and iteration
    settings: str = "homogeneous,heterogeneous"
    policies: str = ",".join(POLICIES)
    resamples: int = 10_000  # bootstrap resamples
    jobs: int = 1  # simulations run side by side (processes)
    watch_period: float = 0.0  # pipeline.watch_period of every run (0: the preset's, off)
    table_from: str = ""  # print the table of an earlier (or cut-short) run's table2_paper_runs.csv (its rows
    # of seeds first_seed..first_seed + seeds - 1), run nothing

    def __post_init__(self) -> None:
        if self.seeds < 1 or self.steps < 1 or self.resamples < 1 or self.jobs < 1:
            raise ConfigError(f"seeds={self.seeds}, steps={self.steps}, resamples={self.resamples} and jobs={self.jobs} "
                              "must be >= 1")
        probabilities("churn", self.churn)
        if not set(self.settings.split(",")) <= {"homogeneous", "heterogeneous"}:
            raise ConfigError(f"settings={self.settings!r}: allowed homogeneous, heterogeneous")
        if self.watch_period < 0:
            raise ConfigError(f"watch_period={self.watch_period} must be >= 0 seconds (0: off)")
        if not set(self.policies.split(",")) <= set(POLICIES) or "gwtf" not in self.policies.split(","):
            raise ConfigError(f"policies={self.policies!r}: gwtf and any of swarm-paper, swarm")


def header(config: PaperTable2Config) -> str:
    """What the table measures: the paper's set-up and the scaling applied, in numbers."""
    preset = gwtf_table2_paper()
    net, pipe = preset.network, preset.pipeline
    low, high = PAPER_BANDWIDTH
    hop = (PAPER_ACTIVATION_BYTES / high, PAPER_ACTIVATION_BYTES / low)
    return "\n".join([
        "GWTF Table II in the paper's regime (phalanx bench gwtf --preset table2-paper)",
        f"paper: 2 data nodes x 4 microbatches; 5 relay stages + the data nodes' stage; {preset.peers} nodes; "
        "capacity 4 (homogeneous) or 1-3 (heterogeneous)",
        f"hop: activation 4 x 512 x 1024 float32 = {PAPER_ACTIVATION_BYTES / 2**20:.0f} MiB over 50-500 Mbit/s / 32 "
        f"= {hop[0]:.1f}-{hop[1]:.1f} s, + {net.latency * 1000:.0f} ms latency; simulated as "
        f"{pipe.activation_bytes // 1024} KiB (padded) over {net.bandwidth_min / 1e3:.1f}-{net.bandwidth_max / 1e3:.1f} KB/s "
        f"(both / {WIRE_SCALE}, so control messages stay cheap)",
        f"compute: {PAPER_STAGE_FLOPS / 1e9:.0f} GFLOP forward per relay stage (3 LLaMa blocks, 2048 tokens), backward "
        f"2x, at {A4000_FLOPS / 1e12:.1f} TFLOP/s (A4000 fp32) x {DEVICE_SHARE:.3f} (0.4 utilization / 3.6 nodes per GPU) "
        f"= {net.flops / 1e12:.2f} TFLOP/s: {PAPER_STAGE_FLOPS / net.flops:.2f} s forward",
        f"capacity: per-iteration slots (capacity_mode={pipe.capacity_mode}), what finds no slot is deferred; "
        f"churn: leave = join chance per relay and iteration; {config.steps} iterations per run; seeds "
        f"{config.first_seed}..{config.first_seed + config.seeds - 1}, paired across policies; pipeline.watch_period="
        f"{config.watch_period or pipe.watch_period:g} s (0: a lost next peer is noticed only on pipeline traffic)",
        "metric: minutes per microbatch = sum over iterations of the slowest data node's iteration time "
        "(aggregation included) / microbatches finished; ratio = GWTF / SWARM per seed, median over seeds "
        f"[95% bootstrap interval of the median, {config.resamples} resamples]",
        "swarm-paper: SWARM as its paper specifies (new peer for the broken stage, refusals not remembered); "
        "swarm: the runtime's variant (restart on a broken backward, refusing peers skipped)",
    ])


def paper_run(task: tuple[str, float, str, int, int, float]) -> dict:
    """One simulated run of a cell under one policy: the Table II metrics and what explains them."""
    setting, churn, policy, seed, steps, watch = task
    config = cell_config(setting, churn, policy, seed, steps, gwtf_table2_paper)
    if watch > 0:
        config = replace(config, pipeline=replace(config.pipeline, watch_period=watch))
    summary = simulate_pipeline(config, None, progress=False)
    mbs = summary["microbatches"]
    branches = summary["routing_branches"]
    return {
        "setting": setting, "churn": churn, "policy": policy, "seed": seed, **table2_metrics(summary),
        "finished": sum(1 for mb in mbs if mb["outcome"] == "ok"),
        "deferred": sum(1 for mb in mbs if mb["outcome"] != "ok"),
        "restarts": sum(mb["restarts"] for mb in mbs), "repairs": sum(mb["repairs"] for mb in mbs),
        "fallback_hops": branches.get("fallback", 0), "hops": sum(branches.values()),
        "evidence": len(summary["evidence"]),
    }


def bootstrap_median(values: list[float], resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """The median of `values` and a 95% percentile-bootstrap interval of it."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * resamples)], medians[min(resamples - 1, int(0.975 * resamples))]


def ratios(rows: list[dict], setting: str, churn: float, baseline: str) -> list[float]:
    """GWTF / `baseline` minutes per microbatch, one per seed both ran."""
    by = {(r["policy"], r["seed"]): r["time_per_microbatch"] for r in rows if r["setting"] == setting and r["churn"] == churn}
    return [by[("gwtf", s)] / by[(baseline, s)] for (p, s) in sorted(by) if p == baseline and ("gwtf", s) in by]


def format_table(rows: list[dict], config: PaperTable2Config) -> str:
    policies = config.policies.split(",")
    baselines = [p for p in policies if p != "gwtf"]
    lines = [header(config), ""]
    cols = " ".join(f"{p + ' min/mb (thr)':>22s}" for p in policies)
    cols += " ".join(f"{'gwtf/' + b + ' med [95% CI]':>34s}" for b in baselines)
    lines.append(f"{'setting':13s} {'churn':>5s} {'n':>3s} {cols} | paper: swarm gwtf min/mb (thr), ratio")
    verdicts = []
    for setting in config.settings.split(","):
        for churn in probabilities("churn", config.churn):
            cell = [r for r in rows if r["setting"] == setting and r["churn"] == churn]
            if not cell:
                continue
            parts = []
            for p in policies:
                runs = [r for r in cell if r["policy"] == p]
                tpm = statistics.fmean(r["time_per_microbatch"] for r in runs) / 60 if runs else float("nan")
                thr = statistics.fmean(r["throughput"] for r in runs) if runs else float("nan")
                parts.append(f"{tpm:>14.2f} ({thr:4.2f}) ")
            for b in baselines:
                values = ratios(rows, setting, churn, b)
                if values:
                    med, lo, hi = bootstrap_median(values, config.resamples)
                    parts.append(f"{med:>16.2f} [{lo:.2f}, {hi:.2f}]     ")
                    if churn > 0:
                        goal = med < 1 and (med <= 0.6 if (setting, churn) == ("heterogeneous", 0.1) else True)
                        verdicts.append(f"{setting} {churn:.0%} gwtf/{b}: median {med:.2f} "
                                        f"({'meets' if goal else 'MISSES'} the goal"
                                        f"{' <= 0.6' if (setting, churn) == ('heterogeneous', 0.1) else ' < 1'})")
                else:
                    parts.append(f"{'-':>34s}")
            n = len({r["seed"] for r in cell})
            paper = PAPER_TABLE2.get((setting, churn))
            ref = (f"{paper['swarm'][0]:.2f} {paper['gwtf'][0]:.2f} ({paper['swarm'][1]:.2f} {paper['gwtf'][1]:.2f}), "
                   f"{paper['gwtf'][0] / paper['swarm'][0]:.2f}") if paper else "-"
            lines.append(f"{setting:13s} {churn:>5.2f} {n:>3d} {' '.join(parts)} | {ref}")
    lines += ["", "diagnostics (means per run): finished, deferred, restarts, repairs, fallback hops / hops, evidence"]
    for setting in config.settings.split(","):
        for churn in probabilities("churn", config.churn):
            for p in policies:
                runs = [r for r in rows if r["setting"] == setting and r["churn"] == churn and r["policy"] == p]
                if runs:
                    mean = {k: statistics.fmean(r[k] for r in runs) for k in
                            ("finished", "deferred", "restarts", "repairs", "fallback_hops", "hops", "evidence")}
                    lines.append(f"  {setting:13s} {churn:4.2f} {p:11s} finished {mean['finished']:6.1f} deferred "
                                 f"{mean['deferred']:6.1f} restarts {mean['restarts']:5.1f} repairs {mean['repairs']:5.1f} "
                                 f"fallback {mean['fallback_hops']:6.1f}/{mean['hops']:6.1f} evidence {mean['evidence']:.1f}")
    return "\n".join(lines + ["", "goals (churn cells):", *[f"  {v}" for v in verdicts]])


def read_runs(path: Path) -> list[dict]:
    """The rows of a table2_paper_runs.csv, typed as `paper_run` returns them."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    text = ("setting", "policy")
    return [{k: v if k in text else int(v) if k == "seed" else float(v) for k, v in row.items()} for row in rows]


def run_cli(args: argparse.Namespace) -> int:
    config = override(PaperTable2Config(), args.set or [])
    if config.table_from:
        chosen = range(config.first_seed, config.first_seed + config.seeds)
        print(format_table([r for r in read_runs(Path(config.table_from)) if r["seed"] in chosen], config))
        return 0
    out = Path(args.out) if args.out else Path("runs") / "bench-gwtf-table2-paper"
    out.mkdir(parents=True, exist_ok=True)
    print(header(config), flush=True)
    tasks = [(setting, churn, policy, seed, config.steps, config.watch_period)
             for seed in range(config.first_seed, config.first_seed + config.seeds)  # seeds outermost: a cut-short
             for setting in config.settings.split(",")  # run still covers every cell
             for churn in probabilities("churn", config.churn)
             for policy in config.policies.split(",")]
    rows: list[dict] = []
    start = time.perf_counter()
    with open(out / "table2_paper_runs.csv", "w", newline="") as f:
        runs = CsvRows(f)
        pool = multiprocessing.get_context("fork").Pool(config.jobs) if config.jobs > 1 else None
        try:
            results = pool.imap(paper_run, tasks) if pool is not None else map(paper_run, tasks)
            for row in results:
                rows.append(row)
                runs.write(row)
                print(f"[{time.perf_counter() - start:6.0f}s] {row['setting']} churn={row['churn']} {row['policy']} "
                      f"seed={row['seed']}: {row['time_per_microbatch'] / 60:.2f} min/microbatch, "
                      f"{row['throughput']:.2f} per iteration", flush=True)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    table = format_table(rows, config)
    (out / "table2_paper.txt").write_text(table + "\n")
    print(table)
    return 0
