"""`phalanx bench pipeline-soak`: the pipeline under sustained churn, in the simulator.

For every routing policy, seed and churn rate (leave = join chance per relay
and iteration) it runs a pipeline preset (default `chars-gpt-pipeline`) for
`iterations` iterations and measures, per run:
- microbatches finished and deferred (a deferred one goes again next iteration;
  the fraction is finished / all microbatch slots the iterations opened);
- evidence between honest peers: the soak has no attacker, so every evidence
  record is one honest peer accusing another;
- distinct stage versions after each aggregation: the most versions any stage's
  replicas hold after one aggregation (1 = they agree), and the most distinct
  parameter digests any stage ends with;
- loss against the churn-free run of the same routing and seed, compared at an
  equal number of finished microbatches: the mean loss of the run's last
  `window` iterations against the churn-free run's mean loss over the
  iterations that end at the same cumulative count;
- simulated seconds against the churn-free run.

Writes soak_runs.csv (one row per run) and soak.txt (the table) into the output
directory and prints the table. Presets: quick (60 iterations, 2 seeds), full
(300 iterations, 5 seeds); `--set key=value` overrides any SoakConfig field.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.errors import ConfigError
from ..runs.pipeline.config import ChurnConfig, PipelineRunConfig
from ..runs.pipeline.presets import PIPELINE_PRESETS
from ..runs.pipeline.run import simulate_pipeline
from .common import bench_config
from .gwtf_table2 import probabilities


@dataclass(frozen=True)
class SoakConfig:
    preset: str = "chars-gpt-pipeline"
    iterations: int = 300
    seeds: int = 5
    first_seed: int = 1
    rates: str = "0,0.1,0.2"  # leave = join chance per relay and iteration
    routings: str = "swarm,gwtf"
    window: int = 10  # iterations whose mean loss is compared

    def __post_init__(self) -> None:
        if self.preset not in PIPELINE_PRESETS:
            raise ConfigError(f"preset={self.preset!r} is not a pipeline preset; allowed: {', '.join(PIPELINE_PRESETS)}")
        if self.iterations < 1 or self.seeds < 1 or self.window < 1:
            raise ConfigError("iterations, seeds and window must be >= 1")
        probabilities("rates", self.rates)
        if not set(self.routings.split(",")) <= {"swarm", "gwtf"}:
            raise ConfigError(f"routings={self.routings!r}: allowed swarm, gwtf")

    def rate_list(self) -> list[float]:
        rates = sorted(set(probabilities("rates", self.rates)))
        return rates if 0.0 in rates else [0.0, *rates]  # the churn-free run is the loss reference


PRESETS = {
    "quick": lambda: SoakConfig(iterations=60, seeds=2),
    "full": SoakConfig,
}


def run_config(config: SoakConfig, routing: str, seed: int, rate: float) -> PipelineRunConfig:
    base = PIPELINE_PRESETS[config.preset]()
    return replace(base, steps=config.iterations, seed=seed, pipeline=replace(base.pipeline, routing=routing),
                   faults=ChurnConfig(leave_rate=rate, join_rate=rate))


def measure(summary: dict) -> dict:
    """The soak's figures of one run (see the module docstring)."""
    mbs = summary["microbatches"]
    finished = sum(mb["outcome"] == "ok" for mb in mbs)
    versions: dict[tuple[int, int], set[int]] = defaultdict(set)
    for e in summary["events"]:
        if e["kind"] == "aggregate" and not e.get("stale"):  # a stale one reports the newer version it kept
            versions[(e["it"], e["stage"])].add(e["version"])
    digests: dict[int, set[str]] = defaultdict(set)
    for stage, _version, digest in summary["replicas"].values():
        digests[stage].add(digest)
    return {
        "finished": finished, "deferred": len(mbs) - finished, "slots": len(mbs),
        "honest_evidence": len(summary["evidence"]),
        "max_versions_after_aggregation": max((len(v) for v in versions.values()), default=0),
        "max_final_digests": max((len(d) for d in digests.values()), default=0),
        "simulated_seconds": summary["simulated_seconds"],
        "joins": sum(e["kind"] == "join" for e in summary["events"]),
        "leaves": sum(e["kind"] == "leave" for e in summary["events"]),
    }


def loss_curve(summary: dict) -> list[tuple[int, float]]:
    """(cumulative finished microbatches, mean loss) after each iteration that finished any."""
    curve, total = [], 0
    for row in summary["metrics"]:
        total += row["completed"]
        if row["loss"] is not None:
            curve.append((total, row["loss"]))
    return curve


def loss_gap(run: list[tuple[int, float]], reference: list[tuple[int, float]], window: int) -> float | None:
    """Relative loss of `run` over its last `window` points against `reference` at the same finished count."""
    if not run or not reference:
        return None
    mine = run[-window:]
    count = mine[-1][0]
    upto = [i for i, (n, _) in enumerate(reference) if n <= count]
    if not upto:
        return None
    end = upto[-1] + 1
    theirs = reference[max(0, end - len(mine)): end]
    ours, ref = statistics.fmean(v for _, v in mine), statistics.fmean(v for _, v in theirs)
    return ours / ref - 1


def run_soak(config: SoakConfig, out: Path, log=print) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    path = out / "soak_runs.csv"
    for routing in config.routings.split(","):
        for seed in range(config.first_seed, config.first_seed + config.seeds):
            reference = None
            for rate in config.rate_list():
                start = time.perf_counter()
                summary = simulate_pipeline(run_config(config, routing, seed, rate), progress=False)
                curve = loss_curve(summary)
                if rate == 0:
                    reference = summary
                row = {"routing": routing, "seed": seed, "rate": rate, **measure(summary),
                       "loss_gap": loss_gap(curve, loss_curve(reference), config.window) if rate else 0.0,
                       "time_ratio": summary["simulated_seconds"] / max(reference["simulated_seconds"], 1e-9),
                       "final_loss": curve[-1][1] if curve else None, "wall_seconds": time.perf_counter() - start}
                rows.append(row)
                log(f"{routing} seed {seed} churn {rate:.2f}: finished {row['finished']}/{row['slots']}, "
                    f"evidence {row['honest_evidence']}, versions {row['max_versions_after_aggregation']}, "
                    f"loss gap {row['loss_gap']:+.3f}, time x{row['time_ratio']:.0f} ({row['wall_seconds']:.0f} s)"
                    if row["loss_gap"] is not None else f"{routing} seed {seed} churn {rate}: no loss")
                with open(path, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
    return rows


def format_table(rows: list[dict], config: SoakConfig) -> str:
    head = (f"pipeline soak: {config.preset}, {config.iterations} iterations, seeds "
            f"{config.first_seed}..{config.first_seed + config.seeds - 1}, leave = join chance per relay and iteration\n"
            f"{'routing':>7} {'churn':>5} {'runs':>4} {'finished % (min)':>16} {'deferred':>8} {'honest ev.':>10} "
            f"{'versions':>8} {'digests':>7} {'loss gap % (max)':>16} {'sim time x':>10}")
    lines = [head]
    cells: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["routing"], r["rate"])].append(r)
    for (routing, rate), rs in sorted(cells.items()):
        fractions = [100 * r["finished"] / r["slots"] for r in rs]
        gaps = [100 * r["loss_gap"] for r in rs if r["loss_gap"] is not None]
        lines.append(
            f"{routing:>7} {rate:>5.2f} {len(rs):>4} {statistics.fmean(fractions):>8.1f} ({min(fractions):>5.1f}) "
            f"{sum(r['deferred'] for r in rs):>8} {sum(r['honest_evidence'] for r in rs):>10} "
            f"{max(r['max_versions_after_aggregation'] for r in rs):>8} {max(r['max_final_digests'] for r in rs):>7} "
            f"{(statistics.fmean(gaps) if gaps else float('nan')):>+8.2f} ({(max(gaps) if gaps else float('nan')):>+5.2f}) "
            f"{statistics.fmean(r['time_ratio'] for r in rs):>10.1f}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """`phalanx bench pipeline-soak --preset quick|full [--set iterations=100 ...]`."""
    config, out = bench_config(args, "pipeline-soak", PRESETS)
    rows = run_soak(config, out)
    table = format_table(rows, config)
    (out / "soak.txt").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'soak_runs.csv'} and {out / 'soak.txt'}")
    return 0
