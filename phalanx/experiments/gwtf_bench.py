"""`phalanx bench gwtf --preset flow|join|table2`: GWTF's flow and node-addition tests.

- flow: GWTF Table V settings 1-6. Each peer runs `FlowNode` (only local
  knowledge) under the synchronous driver for at most `rounds` rounds (the last
  `settle` of them with Request Change / Redirect paused so moves in flight
  land); the total cost of the complete flows is compared with networkx's
  min-cost flow for the same number of microbatches (settings 1-4: the true
  optimum; 5-6: a lower bound, since each microbatch must return to its own
  data node) and with SWARM's greedy "closest next-stage peer with room".
- join: GWTF Table IV / Fig. 5 (see `phalanx.algorithms.placement`).
- table2: the runtime's crash benchmark (`phalanx.experiments.gwtf_table2`).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..algorithms.flow import FlowConfig, SyncDriver
from ..algorithms.flowgraph import build_nodes, max_flow, optimal, random_graph, swarm_greedy
from ..config import override
from ..core.errors import ConfigError
from ..core.rng import py_stream

# GWTF Table V: sources, relays, stages, floor(U(capacity)), floor(U(link cost))
FLOW_SETTINGS: dict[int, tuple[int, int, int, tuple[int, int], tuple[int, int]]] = {
    1: (1, 40, 8, (1, 3), (1, 20)),
    2: (1, 40, 10, (1, 3), (1, 20)),
    3: (1, 40, 8, (5, 15), (1, 20)),
    4: (1, 40, 8, (1, 3), (5, 100)),
    5: (2, 40, 8, (1, 3), (1, 20)),
    6: (4, 80, 8, (1, 3), (1, 20)),
}


@dataclass(frozen=True)
class FlowBenchConfig:
    seeds: int = 5
    rounds: int = 120
    settle: int = 10
    settings: str = "1,2,3,4,5,6"
    seed: int = 0
    flow: FlowConfig = field(default_factory=FlowConfig)

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ConfigError(f"seeds must be >= 1, got {self.seeds}")
        if not 0 <= self.settle < self.rounds:
            raise ConfigError(f"need 0 <= settle < rounds, got settle={self.settle} rounds={self.rounds}")
        for part in self.settings.split(","):
            if not part.strip().isdigit() or int(part) not in FLOW_SETTINGS:
                raise ConfigError(f"settings must be a comma list of 1..6, got {self.settings!r}")

    def chosen(self) -> list[int]:
        return [int(p) for p in self.settings.split(",")]


def run_flow_case(setting: int, seed: int, config: FlowBenchConfig) -> dict:
    """One graph of one setting: GWTF, SWARM greedy and the optimum."""
    sources, relays, stages, capacity, link_cost = FLOW_SETTINGS[setting]
    graph = random_graph(py_stream(config.seed, "gwtf-flow-graph", setting, seed), sources, relays, stages,
                         capacity, link_cost, demand=10**6)
    best_value = max_flow(graph)
    graph = replace(graph, demand={d: max(1, best_value // sources) for d in graph.data})
    start = time.perf_counter()
    driver = SyncDriver(build_nodes(graph, config.flow, config.seed * 1000 + seed))
    driver.run(config.rounds - config.settle)
    used = config.rounds - config.settle + driver.settle(config.settle)
    wall = time.perf_counter() - start
    paths = driver.paths()
    value, cost = len(paths), driver.total_cost()
    _, opt_same = optimal(graph, value) if value else (0, 0.0)
    _, opt_full = optimal(graph, sum(graph.demand.values()))
    greedy = swarm_greedy(graph)
    g_value, g_cost = len(greedy), sum(c for _, _, c in greedy)
    _, opt_greedy = optimal(graph, g_value) if g_value else (0, 0.0)
    return {
        "setting": setting, "seed": seed, "sources": sources, "relays": relays, "stages": stages,
        "demand": sum(graph.demand.values()),
        "gwtf_flow": value, "gwtf_cost": cost, "optimum_cost": opt_same,
        "gwtf_ratio": cost / opt_same if opt_same else float("nan"),
        "swarm_flow": g_value, "swarm_cost": g_cost,
        "swarm_ratio": g_cost / opt_greedy if opt_greedy else float("nan"),
        "gwtf_per_mb": cost / value if value else float("nan"),
        "swarm_per_mb": g_cost / g_value if g_value else float("nan"),
        "optimum_per_mb": opt_full / sum(graph.demand.values()),
        "rounds": used, "messages": driver.messages, "wall_s": wall,
        "optimum_exact": sources == 1,
    }


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f}±{statistics.stdev(values):.3f}"


def format_flow_table(rows: list[dict]) -> str:
    head = (f"{'set':>3} {'src':>3} {'relays':>6} {'stages':>6} {'flow/demand':>11} {'GWTF/opt':>13} "
            f"{'SWARM/opt':>13} {'GWTF c/mb':>9} {'SWARM c/mb':>10} {'opt c/mb':>8} {'rounds':>6}")
    lines = [head, "-" * len(head)]
    for s in sorted({r["setting"] for r in rows}):
        rs = [r for r in rows if r["setting"] == s]
        mark = "" if rs[0]["optimum_exact"] else "*"
        lines.append(
            f"{s:>3} {rs[0]['sources']:>3} {rs[0]['relays']:>6} {rs[0]['stages']:>6} "
            f"{sum(r['gwtf_flow'] for r in rs):>5}/{sum(r['demand'] for r in rs):<5} "
            f"{_mean_std([r['gwtf_ratio'] for r in rs]) + mark:>13} {_mean_std([r['swarm_ratio'] for r in rs]) + mark:>13} "
            f"{statistics.mean(r['gwtf_per_mb'] for r in rs):>9.2f} {statistics.mean(r['swarm_per_mb'] for r in rs):>10.2f} "
            f"{statistics.mean(r['optimum_per_mb'] for r in rs):>8.2f} {max(r['rounds'] for r in rs):>6}"
        )
    lines.append("ratios: total cost / networkx min-cost flow for the same number of microbatches (mean±std over seeds)")
    lines.append("* settings 5-6: the reference is a lower bound (any source may feed any sink); GWTF returns each microbatch home")
    return "\n".join(lines)


def run_flow(config: FlowBenchConfig, out: Path) -> list[dict]:
    rows = [run_flow_case(s, seed, config) for s in config.chosen() for seed in range(config.seeds)]
    _write_csv(out / "flow.csv", rows)
    return rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def run_cli(args: argparse.Namespace) -> int:
    """Dispatch `phalanx bench gwtf` on --preset."""
    preset = "flow" if args.preset == "quick" else args.preset
    out = Path(args.out) if args.out else Path("runs") / f"bench-gwtf-{preset}"
    if preset == "flow":
        config = override(FlowBenchConfig(), args.set or [])
        rows = run_flow(config, out)
        print(format_flow_table(rows))
        print(f"wrote {out / 'flow.csv'}")
        return 0
    if preset == "join":
        from .gwtf_join import run_join_cli

        return run_join_cli(args, out)
    if preset == "table2":
        from .gwtf_table2 import run_cli as run_table2

        return run_table2(args)
    raise ConfigError(f"unknown gwtf bench preset {args.preset!r}; allowed: flow, join, table2")
